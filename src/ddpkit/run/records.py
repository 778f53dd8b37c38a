"""metrics.jsonl, read back: one JSON record per line, as :class:`ddpkit.run.recorder.MetricLogger` appends them.

    records = read_records(RunFiles(run_dir).metrics)   # [{"event": "step", "step": 50, ...}, ...]

Used by the CSV logger, the plots and the resume rewind. Torch-free, so ``ddpkit plot`` starts at once.
"""

from __future__ import annotations

import json
from pathlib import Path


def read_records(path: Path) -> list[dict]:
    """The file's records in order; a last line cut short by a kill is skipped; no file, no records."""
    if not Path(path).exists():
        return []
    records = []
    for line in Path(path).read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records
