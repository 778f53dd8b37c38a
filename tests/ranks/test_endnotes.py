"""What a worker leaves its launcher as its work ends (ranks/endnotes.py), read as the launcher reads it after a
stop signal: in torch's layout of the agent's log dir (``LOG_DIR/RUN_ID_xxx/attempt_N/LOCAL_RANK/error.json``),
the newest attempt only, every local worker or none; and what the CLI makes of a job stopped after that."""

from __future__ import annotations

import pickle

import torch

from ddpkit.errors import WorkersFailed
from ddpkit.ranks import endnotes
from ddpkit.ranks.failures import exit_status


def _as_worker(monkeypatch, log_dir, attempt: int, local: int, rank: int) -> None:
    folder = log_dir / "ddpkit-run_ab12" / f"attempt_{attempt}" / str(local)
    folder.mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(folder / "error.json"))
    monkeypatch.setenv("DDPKIT_LAUNCHER_PID", "1")
    monkeypatch.setenv("RANK", str(rank))


def test_every_local_worker_of_the_newest_attempt_or_none(tmp_path, monkeypatch):
    for local in (0, 1):  # an earlier attempt whose workers all returned: not this attempt's
        _as_worker(monkeypatch, tmp_path, 0, local, 2 + local)
        endnotes.note_returned(f"old {local}")
    _as_worker(monkeypatch, tmp_path, 1, 0, 2)
    endnotes.note_returned({"loss": 0.5})
    _as_worker(monkeypatch, tmp_path, 1, 1, 3)
    assert endnotes.read_returned(tmp_path, 2) is None  # rank 3 has not returned in attempt 1
    endnotes.note_returned(None)
    assert endnotes.read_returned(tmp_path, 2) == {2: {"loss": 0.5}, 3: None}
    assert endnotes.read_run_end(tmp_path) is None
    endnotes.note_run_end(tmp_path / "run", 7, 1, "a rerun resumes at its end")
    assert endnotes.read_run_end(tmp_path)["step"] == 7


def test_a_result_too_big_to_keep_or_unpicklable_leaves_no_note(tmp_path, monkeypatch):
    _as_worker(monkeypatch, tmp_path, 0, 0, 0)
    monkeypatch.setattr(endnotes, "RESULT_MAX_BYTES", 4096)
    endnotes.note_returned(torch.zeros(2048))  # 8 KiB: the pickling stops at 4 KiB
    endnotes.note_returned(lambda: 1)
    assert endnotes.read_returned(tmp_path, 1) is None
    assert [p.name for p in (tmp_path / "ddpkit-run_ab12" / "attempt_0" / "0").iterdir()] == []
    endnotes.note_returned(torch.zeros(16))
    assert pickle.loads((tmp_path / "ddpkit-run_ab12" / "attempt_0" / "0" / endnotes.RETURNED).read_bytes())[0] == 0


_PICKLED = [0]


class _Counted:
    def __reduce__(self):
        _PICKLED[0] += 1
        return (int, (7,))


def test_the_pickling_of_a_big_result_stops_at_the_cap(tmp_path, monkeypatch):
    """A review finding: the whole result was pickled a second time before its size was checked (a multi-GB
    result on every normal run). Pickled into a writer that stops at the cap, most of it is never pickled."""
    _as_worker(monkeypatch, tmp_path, 0, 0, 0)
    monkeypatch.setattr(endnotes, "RESULT_MAX_BYTES", 4096)
    _PICKLED[0] = 0
    endnotes.note_returned([_Counted() for _ in range(200_000)])  # ~1 MB pickled; pickle writes 64 KiB frames
    assert endnotes.read_returned(tmp_path, 1) is None
    assert _PICKLED[0] < 50_000, _PICKLED[0]


def test_not_under_ddpkits_launcher_no_note_is_written(tmp_path, monkeypatch):
    _as_worker(monkeypatch, tmp_path, 0, 0, 0)
    monkeypatch.delenv("DDPKIT_LAUNCHER_PID")  # torchrun's worker: torchrun reads no such note
    endnotes.note_returned(1)
    assert endnotes.read_returned(tmp_path, 1) is None


def test_the_cli_ends_a_job_stopped_after_its_work_as_finished_and_python_gets_the_results(capsys):
    stopped = WorkersFailed("the launcher received SIGTERM after every worker had finished", False, 143, {0: "r"})
    assert stopped.results == {0: "r"} and stopped.exit_code == 143  # raised from Python: a stop asks to stop
    assert exit_status(stopped) == 0
    assert capsys.readouterr().err.strip().endswith("had finished; the job ends as finished")
    assert exit_status(WorkersFailed("interrupted: ...", False, 143)) == 143
