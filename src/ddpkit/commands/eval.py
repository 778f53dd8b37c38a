"""``ddpkit eval RUN_DIR``: re-evaluate RUN_DIR/model.pt with the run's own config."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from ..errors import RunDirError

HELP = "re-evaluate a run's model.pt on its test set, exactly and distributed"


def register(parser) -> None:
    parser.add_argument("run_dir", help="a ddpkit run directory (holds config.toml and model.pt)")
    parser.add_argument("--nproc", default="auto", help="processes: N or auto (default: auto)")
    parser.add_argument("--device", default=None, help="auto | cpu | cuda (default: the run's)")
    parser.set_defaults(run=run)


def run(args) -> int:
    from ..config import TrainConfig
    from ..launch import launch, resolve_nproc
    from ..trainer import eval_worker

    run_dir = Path(args.run_dir)
    for name in ("config.toml", "model.pt"):
        if not (run_dir / name).exists():
            raise RunDirError(f"{run_dir / name} not found; is {run_dir} a finished ddpkit run?")
    cfg = TrainConfig.from_toml(run_dir / "config.toml")
    # Evaluation runs on this node alone, whatever launched the training.
    cfg = dataclasses.replace(cfg, nproc=args.nproc, run_dir=str(run_dir), device=args.device or cfg.device,
                              nnodes=1, rdzv_endpoint="", rdzv_id="", local_addr="", max_restarts=0)
    cfg.validate()
    result = launch(eval_worker, (cfg,), resolve_nproc(cfg.nproc, cfg.device))
    print(json.dumps(result))
    return 0
