"""The run directory: who may write it, whether a run may use it, and how nothing in it gets lost.

Its files are named in :mod:`ddpkit.run.paths`. Every writer here is called on all ranks and writes
only on global rank 0, atomically (:func:`ddpkit.files.atomic_write`); :func:`ddpkit.ranks.context.on_rank0`
tells every rank whether the write worked, so no rank is left waiting for one that stopped. Before
launch, :func:`check_run_dir` refuses a run dir that cannot be used as asked, and one process at a
time owns a run dir (:func:`owning_run_dir` in the launcher, :func:`rank0_owns` under torchrun or
across nodes).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from pathlib import Path
from typing import Callable, Iterator

from torch import nn

from ..config import POWERSGD_NO_RESUME, TrainConfig
from ..data.types import Meta
from ..errors import AlreadyReported, ConfigError, DataError, DdpkitError, RunDirError
from ..files import atomic_write, describe_io_error, torch_bytes
from ..identity import READING, data_fingerprint, model_fingerprint, with_code
from ..importpath import is_import_path, resolve
from ..models import model_for, own_model
from ..ranks import env
from ..ranks.context import DistContext, on_rank0
from ..ranks.launcher import LaunchSpec
from .checkpoint import check_weights_fit, read_weights
from .paths import EXPECTED, RunFiles


# ---------------------------------------------------------------------- before launch
def finished_cli_run(run_dir: str | Path, from_python: str) -> TrainConfig:
    """The config of a finished run whose model the CLI can rebuild (``ddpkit eval``, ``show-data
    --predictions``); else one line. ``from_python``: what to do instead for a run trained from Python."""
    run_dir, files = Path(run_dir), RunFiles(run_dir)
    for path in (files.config, files.model):
        if not path.exists():
            raise RunDirError(f"{path} not found; is {run_dir} a finished ddpkit run?")
    cfg = TrainConfig.from_toml(files.config)
    # A model-loss task needs nothing from Python when its model and data are named by import path.
    custom = [
        f"{k} {getattr(cfg, k)}" for k in ("model", "dataset", "task") if str(getattr(cfg, k)).startswith("custom:")
    ]
    if cfg.task.startswith("model-loss") and not (is_import_path(cfg.model) and is_import_path(cfg.dataset)):
        custom.append(f"task {cfg.task}")
    if custom:
        raise RunDirError(
            f"{run_dir} was trained from Python ({', '.join(custom)}), which the CLI cannot rebuild; {from_python}"
        )
    return cfg


def check_rebuilt(cfg: TrainConfig, run_dir: str | Path, splits) -> None:
    """``ddpkit eval`` and ``show-data --predictions`` build a run's model and data again from their import
    paths: refuse, in one line naming the part that differs, a build that is no longer what the run trained
    on (an edited function, a constant in another module it reads), rather than score its model.pt on other
    code or data. Read as training read them (the Trainer, ``preflight.content_fingerprints``)."""
    now = {}
    if is_import_path(cfg.model) and cfg.model_digest:
        now["model_digest"] = with_code(model_fingerprint(own_model(cfg)), "factory", resolve(cfg.model, "--model"))
    if is_import_path(cfg.dataset) and cfg.data_digest:
        now["data_digest"] = with_code(
            data_fingerprint(splits.train, splits.test), "factory", resolve(cfg.dataset, "--dataset")
        )
    saved, differ = read_identity(run_dir), {}
    for key, fp in now.items():
        before, after = saved.get(key) or {}, fp.to_json()
        if before and before.get("reading", 1) != READING:
            # An older ddpkit read less, and some parts otherwise: only the code both read compares.
            code = [k for k in before.get("parts", {}) if k.startswith("code ") and k in fp.parts]
            before = {**before, "parts": {k: before["parts"][k] for k in code}}
            after = {**after, "parts": {k: fp.parts[k] for k in code}}
            if not code:
                print(f"ddpkit: note: {run_dir} was fingerprinted by an older ddpkit; its {key} cannot be compared")
                continue
            if before["parts"] == after["parts"]:
                print(f"ddpkit: note: {run_dir} was fingerprinted by an older ddpkit; its {key} compares on code only")
                continue
        elif fp.tag == getattr(cfg, key):
            continue
        flag, field = ("--model", "model") if key == "model_digest" else ("--dataset", "dataset")
        said = describe_difference(key, getattr(cfg, key), fp.tag, {key: before} if before else {}, {key: after})
        differ[f"{flag} {getattr(cfg, field)}"] = said
    if differ:
        raise RunDirError(
            f"{' and '.join(differ)} no longer build{'s' if len(differ) == 1 else ''} what {run_dir} was trained "
            f"on ({'; '.join(differ.values())}); restore the code it was trained with, or train a new run"
        )


def check_run_dir(cfg: TrainConfig, identity: dict | None = None, lr_total: str | None = None) -> dict | None:
    """Refuse a run dir that cannot be used as asked; return its summary if that run already finished.

    Checked before any worker starts: the layout (each entry a file or a directory as ddpkit
    writes it), that it can be written, that it holds the same config. A finished run whose
    summary.json is unreadable is not "finished": it resumes from its last snapshot, which
    writes model.pt and summary.json again. ``identity``: the fingerprints of what was passed in
    (``Fingerprint.to_json()`` by config field), compared with the run dir's identity.json to say in
    words what differs. A run whose horizon (``epochs``, ``max_steps``) grew is trained longer from its last
    snapshot, finished or not, unless ``lr_total`` says why its lr policy depends on the total.
    """
    run_dir, files = Path(cfg.run_dir), RunFiles(cfg.run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirError(f"--run-dir {run_dir} exists and is not a directory")
    for name, kind in EXPECTED.items():
        entry = run_dir / name
        if entry.exists() and (entry.is_dir() != (kind == "directory")):
            raise RunDirError(
                f"{entry} is a {'directory' if entry.is_dir() else 'file'}, where ddpkit keeps its "
                f"{name} {kind}; move it away, or pass another --run-dir"
            )
    check_writable(run_dir)
    if not files.config.exists():
        return None
    try:
        saved = TrainConfig.from_toml(files.config).to_dict()
    except ConfigError as exc:
        raise RunDirError(f"{run_dir} holds a config.toml ddpkit cannot read ({exc}); pass a new --run-dir") from None
    differing = cfg.differing_keys(saved)
    trained = files.model.exists() or list(files.checkpoints.glob("snapshot-*.pt"))
    if differing and trained:
        before = read_identity(run_dir)
        detail = "; ".join(
            describe_difference(k, saved.get(k), getattr(cfg, k), before, identity or {}) for k in differing
        )
        raise RunDirError(
            f"run dir {run_dir} holds a run with a different config ({detail}); "
            f"pass a new --run-dir, or delete {run_dir} to start over"
        )
    if differing:  # an attempt that failed before its first snapshot: nothing trained to lose
        if not locked(run_dir):  # else the lock's refusal at launch is the one line (or a peer of this job says it)
            print(
                f"ddpkit: {run_dir} holds an earlier attempt that saved nothing (config differs in "
                f"{', '.join(differing)}); starting over in it"
            )
        return None
    grown = cfg.horizon_changes(saved)
    if grown and trained:
        _check_longer(cfg, files, grown, lr_total)
        return None  # trained on from its last snapshot: not finished at this horizon
    summary = files.summary
    if not (summary.exists() and files.model.exists()):
        if cfg.comm_hook == "powersgd" and list(files.checkpoints.glob("snapshot-*.pt")):
            raise RunDirError(
                f"{run_dir} holds an unfinished --comm-hook powersgd run: {POWERSGD_NO_RESUME}. "
                f"Delete {run_dir} to train again from the start, or pass a new --run-dir"
            )
        return None
    try:
        return json.loads(summary.read_text())
    except (OSError, ValueError):
        if list(files.checkpoints.glob("snapshot-*.pt")):
            return None  # resume from the final snapshot: it rewrites summary.json and model.pt
        raise RunDirError(
            f"{summary} is unreadable (truncated?) and {run_dir} holds no snapshot to rebuild it "
            f"from; model.pt is intact. Evaluate it with `ddpkit eval {run_dir}`"
        ) from None


def read_identity(run_dir: str | Path) -> dict:
    """RUN_DIR/identity.json ({} where there is none, as in run dirs of ddpkit before 0.3)."""
    try:
        return json.loads(RunFiles(run_dir).identity.read_text())
    except (OSError, ValueError):
        return {}


def describe_difference(key: str, old, new, before: dict, now: dict) -> str:
    """One differing config key in words: for what was passed in, the parts that differ
    (``optimizer AdamW: group 0 lr 0.001 -> 0.0005``), else the values."""
    a, b = (before.get(key) or {}).get("parts"), (now.get(key) or {}).get("parts")
    if not (isinstance(a, dict) and isinstance(b, dict)):
        return f"{key}: {old!r} -> {new!r}"
    said = []
    for part in list(dict.fromkeys([*a, *b])):
        if part not in a:
            said.append(f"{part} added ({b[part]})")
        elif part not in b:
            said.append(f"{part} removed")
        elif a[part] != b[part]:
            said.append(f"{part} changed" if part.startswith("code ") else f"{part} {a[part]} -> {b[part]}")
    if len(said) > 8:  # a new architecture changes every layer's settings: the first few say enough
        said = [*said[:8], f"and {len(said) - 8} more parts"]
    name = (now.get(key) or {}).get("name", "")
    older = (before.get(key) or {}).get("reading", 1) != (now.get(key) or {}).get("reading", 1)
    return f"{key} {name}: {', '.join(said) or 'read differently by another ddpkit version'}" + (
        " (recorded by another ddpkit version, which read other parts)" if older and said else ""
    )


def unproven(identity: dict) -> list[str]:
    """What ddpkit could not read of what was passed in (see ddpkit.identity)."""
    return [item for fp in identity.values() for item in fp.get("unproven", [])]


def matched_on(identity: dict) -> str:
    """What a finished run returned from disk was matched on, in words."""
    what = {
        "model": "structure, code and attributes",
        "dataset": "content",
        "optimizer": "class and settings",
        "schedule": "class and state at step 0",
        "task": "code of the loss and metrics",
    }
    what["model_digest"] = what["model"]  # --model pkg.module:function: the model it built
    read = [
        f"{key.removesuffix('_digest')} {fp['name']} ({what.get(key, 'read')})"
        for key, fp in identity.items()
        if key not in ("data_digest", "init_digest")
    ]
    if "data_digest" in identity:
        read.append(f"data by content ({identity['data_digest']['name']})")
    if "init_digest" in identity:
        read.append("the --init-from file by SHA-256")
    return ", ".join(["the config", *read])


def check_writable(run_dir: Path) -> None:
    """Write and remove a probe file in ``run_dir`` (or the nearest existing parent it will be made in)."""
    where = run_dir
    while not where.exists():
        where = where.parent
    probe = where / f".ddpkit-probe-{os.getpid()}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise RunDirError(describe_io_error(exc, run_dir)) from None


# ---------------------------------------------------------------------- one run at a time
@contextmanager
def run_lock(run_dir: str | Path, other: str = "pass another --run-dir", flag: str = "--run-dir") -> Iterator[None]:
    """Hold an exclusive lock on ``RUN_DIR/.lock`` for the block; a second run gets a one-line
    error naming the holder (and ``other``: how to name another run dir; ``flag``: what names it).
    ``flock`` is released by the kernel when the holder dies, however it dies, so a killed run never
    leaves a stale lock. On NFS, Linux emulates flock with POSIX locks, which hold across nodes when the
    server supports locking (NFSv4, or NLM)."""
    path = RunFiles(run_dir).lock
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:  # a file in its place, a read-only disk: one line, not a traceback
        raise RunDirError(describe_io_error(exc, path, flag=flag)) from None
    try:
        waited = time.monotonic() + ORPHAN_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
                if _holder_gone(holder) and time.monotonic() < waited:
                    time.sleep(0.1)  # its forked children still hold it: they follow their parent out (see above)
                    continue
                raise RunDirError(
                    f"{run_dir} is in use by another ddpkit run ({holder}); wait for it to end, stop it, or {other}"
                ) from None
            except OSError as exc:  # ENOLCK: a filesystem with no locking (NFS without lockd)
                raise RunDirError(f"cannot lock {path}: {exc.strerror or exc}; point {flag} at a local disk") from None
        os.ftruncate(fd, 0)
        os.pwrite(
            fd, f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}".encode(), 0
        )
        yield
    finally:
        # Let go first, then close: a child forked meanwhile (DataLoader workers, persistent ones too) shares this
        # open file and, by close alone, kept the lock for as long as it lived (the review of the seed-003 fixes: the
        # same process was then refused its own run dir)
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)  # the file stays (removing it would race a waiting run)


# How long a run waits for a lock whose holder is dead (on this host): the holder's forked children (DataLoader
# workers) share its lock and end a few seconds after it is killed (their watchdog polls the parent every 5 s);
# a restart in between (torchrun's, of a SIGKILLed rank 0) was refused its own run dir (seconds)
ORPHAN_WAIT_S = 15.0


def _holder_gone(holder: str) -> bool:
    """Whether the lock file's holder (``pid N on HOST, since ...``) is a process of this host that has ended."""
    words = holder.split()
    if len(words) < 4 or words[0] != "pid" or not words[1].isdigit() or words[3].rstrip(",") != socket.gethostname():
        return False
    try:
        os.kill(int(words[1]), 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive, another user's
        return False
    return False


def locked(run_dir: str | Path) -> bool:
    """Whether a process holds :func:`run_lock` on ``run_dir`` now (tried and let go at once: the run takes
    it for good at launch, and is refused there in one line if another run still holds it)."""
    try:
        fd = os.open(RunFiles(run_dir).lock, os.O_RDWR)
    except OSError:  # no lock file: no run has held it
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


# ---------------------------------------------------------------------- who owns the run dir
@contextmanager
def owning_run_dir(cfg: TrainConfig, spec: LaunchSpec) -> Iterator[bool]:
    """On one node, the launcher holds the run dir's lock for the whole job, its workers (which
    die with it) included. Across nodes or under torchrun no launcher sees the whole job, and
    global rank 0 holds it instead (:func:`rank0_owns`)."""
    if env.under_launcher() or spec.nnodes > 1:
        yield False
        return
    with run_lock(cfg.run_dir):
        RunFiles(cfg.run_dir).fatal.unlink(missing_ok=True)  # a new launch: forget the last one's fatal error
        os.environ[env.RUN_LOCKED] = str(Path(cfg.run_dir).resolve())
        try:
            yield True
        finally:
            os.environ.pop(env.RUN_LOCKED, None)


def launcher_owns(run_dir: str | Path) -> bool:
    """Whether this job's launcher holds ``run_dir`` (:func:`owning_run_dir`), as its workers learn it."""
    return os.environ.get(env.RUN_LOCKED) == str(Path(run_dir).resolve())


def record_teardown(cfg: TrainConfig, summary: dict) -> dict:
    """Add ``teardown_s`` to summary.json: from rank 0 writing it to this launcher regaining control
    (process-group teardown, the agent's exit barrier, joining the workers). Written by the launcher,
    which holds the run dir's lock; the workers are gone."""
    if summary.get("finished_at") is None:
        return summary
    summary = {**summary, "teardown_s": round(time.time() - summary["finished_at"], 3)}
    atomic_write(RunFiles(cfg.run_dir).summary, summary_bytes(summary))
    return summary


@contextmanager
def rank0_locks(
    run_dir: str | Path, ctx: DistContext, then: Callable[[], object] = lambda: None, **how
) -> Iterator[None]:
    """Global rank 0 holds :func:`run_lock` (``how``: its wording) for the block, and runs ``then`` once it
    holds it; every rank learns whether it could (``on_rank0``: one all-reduce). A ``Loop``'s, from its
    ``resume()``, and a Trainer's workers' where no launcher holds the lock (:func:`rank0_owns`)."""
    with ExitStack() as stack:

        def take() -> None:
            stack.enter_context(run_lock(run_dir, **how))
            then()

        on_rank0(ctx, take, "locking the run dir")
        yield


def rank0_owns(cfg: TrainConfig, ctx: DistContext) -> AbstractContextManager:
    """Global rank 0 takes the lock when no launcher holds it (:func:`rank0_locks`); a first attempt forgets the
    last job's fatal error."""
    if launcher_owns(cfg.run_dir):
        return nullcontext()

    def fresh() -> None:
        if env.restart_count() == 0:
            RunFiles(cfg.run_dir).fatal.unlink(missing_ok=True)

    return rank0_locks(cfg.run_dir, ctx, fresh)


# ---------------------------------------------------------------------- no restarts into deterministic errors
def record_fatal(run_dir: str | Path, exc: DdpkitError) -> bool:
    """Note an error a restart would only meet again (bad data, a task mismatch), for the restarted
    workers to report instead of training into it, with the time it was noted (:func:`refuse_a_restart_into`
    honours a note of this job's alone). Every rank that met it writes it, each through a temporary file of
    its own (atomic_write's one name would let two ranks remove each other's). Returns whether it was written."""
    path = RunFiles(run_dir).fatal
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    note = {"message": str(exc), "exit_code": exc.exit_code, "at": time.time()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(note))
        os.replace(tmp, path)
        return True
    except OSError:
        tmp.unlink(missing_ok=True)
        return False


def read_fatal(run_dir: str | Path) -> dict | None:
    try:
        return json.loads(RunFiles(run_dir).fatal.read_text())
    except (OSError, ValueError):
        return None


def refuse_a_restart_into(run_dir: str | Path) -> None:
    """A restarted attempt (``--max-restarts``) whose job's last attempt met an error a restart cannot fix
    stops at once, quiet (it was said then): ``AlreadyReported``, on every rank. Both faces, before anything
    else. A note is this job's when it was written after the process that restarts the workers started
    (ddpkit's launcher, or torchrun's agent: the worker's parent); an older one, an earlier job's, is not
    (a review's find: a job whose first attempt failed for another reason, before its Loop, was stopped by the
    last job's note, quiet)."""
    fatal = read_fatal(run_dir) if env.restart_count() > 0 else None
    if fatal is None:
        return
    launcher = int(os.environ.get(env.LAUNCHER_PID) or os.getppid())
    if float(fatal.get("at", 0.0)) >= env.process_started_at(launcher):
        raise AlreadyReported(fatal["message"], fatal["exit_code"])


def note_for_restarts(run_dir: str | Path, error: BaseException | None) -> None:
    """Note ``error`` for the job's restarts where a restart would only meet it again: bad settings or code
    (``ConfigError``, ``TaskError`` among them) and bad data (``DataError``), under a launcher with restarts
    left (:func:`refuse_a_restart_into` reads it). Before, for a ``ddpkit.Loop`` script, ``ddpkit run
    --max-restarts 2`` ran into its own ConfigError three times and said it three times."""
    if (
        isinstance(error, (ConfigError, DataError))
        and not isinstance(error, AlreadyReported)
        and env.under_launcher()
        and env.restarts_left()
    ):
        record_fatal(run_dir, error)


# ---------------------------------------------------------------------- writers
def write_config(cfg: TrainConfig, ctx: DistContext, identity: dict | None = None) -> None:
    """config.toml, and identity.json (what was read of the things passed in) when there is one."""

    def write():
        files = RunFiles(cfg.run_dir)
        if identity:
            atomic_write(files.identity, (json.dumps(identity, indent=1, sort_keys=True) + "\n").encode())
        atomic_write(files.config, cfg.to_toml().encode())

    on_rank0(ctx, write)


def summary_bytes(summary: dict) -> bytes:
    return (json.dumps(summary, indent=2) + "\n").encode()


def write_summary(run_dir: Path, summary: dict, ctx: DistContext) -> None:
    on_rank0(ctx, lambda: atomic_write(RunFiles(run_dir).summary, summary_bytes(summary)))


def write_model(run_dir: Path, state: dict, ctx: DistContext) -> None:
    """The model's whole ``state_dict`` (as its strategy gives it: on global rank 0 at least), loadable with
    plain ``model.load_state_dict``."""

    def write():
        atomic_write(RunFiles(run_dir).model, torch_bytes({k: v.detach().cpu() for k, v in state.items()}))

    on_rank0(ctx, write)


class HorizonRefused(RunDirError):
    """A run dir holding this run at another horizon that it cannot be trained to (``_check_longer``): in a
    run dir the user named, the one line; in a default one, preflight trains in the next free one instead,
    saying ``held`` (what the run dir holds and why it cannot go on, without the advice for a named one)."""

    def __init__(self, message: str, held: str = ""):
        super().__init__(message)  # one argument, as an exception is rebuilt from its args (pickle)
        self.held = held

    @classmethod
    def saying(cls, run_dir: Path, held: str, advice: str = "") -> "HorizonRefused":
        return cls(f"run dir {run_dir} holds {held}{advice}", held)


def _horizon_words(changes: dict) -> str:
    """``epochs 1 -> 2, max_steps 11 -> none (the epochs' end)``: a max_steps of 0 is no cap, not a step count."""

    def said(key, value):
        return "none (the epochs' end)" if key == "max_steps" and not value else str(value)

    return ", ".join(f"{k} {said(k, a)} -> {said(k, b)}" for k, (a, b) in changes.items())


def _check_longer(cfg: TrainConfig, files: RunFiles, grown: dict, lr_total: str | None) -> None:
    """Train a run to another horizon from its last snapshot, or say in one line why not: an lr policy that
    spans the total, a horizon the run has trained past already, or a run that cannot resume."""
    run_dir = files.root
    what = _horizon_words(grown)
    if cfg.comm_hook == "powersgd":
        raise HorizonRefused.saying(run_dir, f"this run at another horizon ({what}): {POWERSGD_NO_RESUME}")
    if lr_total:
        raise HorizonRefused.saying(
            run_dir,
            f"this run at another horizon ({what}), and it cannot be trained to it: {lr_total}, so its steps so "
            f"far are not those of a run started with the new horizon",
            ". Pass a new --run-dir to train that from the start (or use a constant lr: --schedule constant)",
        )
    done = _steps_done(files)
    if "epochs" in grown and grown["epochs"][1] < grown["epochs"][0]:
        raise HorizonRefused.saying(
            run_dir,
            f"this run with more epochs ({what}): it may have trained past the new horizon",
            "; keep --epochs as it was, or pass a new --run-dir",
        )
    new_cap = grown.get("max_steps", (0, cfg.max_steps))[1]
    if new_cap and done > new_cap:
        raise HorizonRefused.saying(
            run_dir,
            f"this run trained {done} steps, past the new horizon ({what})",
            "; keep --max-steps as it was, or pass a new --run-dir",
        )
    print(
        f"ddpkit: training {run_dir} to another horizon ({what}) from its last snapshot (step {done}); its lr "
        f"policy does not depend on the total"
    )


def _steps_done(files: RunFiles) -> int:
    """The optimizer steps a run dir's run has done: its summary's, or its newest snapshot's."""
    try:
        return int(json.loads(files.summary.read_text())["steps"])
    except (OSError, ValueError, KeyError, TypeError):
        steps = [int(p.stem.rpartition("-")[2]) for p in files.checkpoints.glob("snapshot-*.pt")]
        return max(steps, default=0)


# ---------------------------------------------------------------------- a finished run's model
def load_trained_model(cfg: TrainConfig, meta: Meta, run_dir: str | Path) -> nn.Module:
    """The registry model of a finished CLI run with its model.pt loaded, on the CPU (``ddpkit eval``,
    ``show-data --predictions``); a model.pt that does not fit the config is a one-line error."""
    path = RunFiles(run_dir).model
    model = model_for(cfg, meta)
    check_weights_fit(model, path, "model.pt")
    if cfg.dtype == "float64":
        model.double()  # before loading: float64 weights would be rounded into float32 ones
    model.load_state_dict(read_weights(path, "model.pt"))
    return model
