"""Where a failure becomes one line: said once for the job, by the process that knows why.

A rank's own error (:func:`report_failure`) is printed by that rank (by the first of them, when several meet
the same one) and left in the elastic agent's per-worker error file (:func:`write_error_file`), with its
class; the launcher reads those files back (:func:`worker_reports`) and turns a failed job into one error
(:func:`launch_failure`) of the class the worker raised (a :mod:`ddpkit.errors` class, so ``fit()`` raises the
same class at every world size; anything else is :class:`WorkersFailed`), naming the cause, not its
consequences. A rank that only lost a peer, or timed out waiting for one, leaves its line to ddpkit's
launcher, which prints it only when the agent saw no rank die first: a rank killed by a signal prints nothing,
and the launcher names it from the agent's record of its exit. The CLI prints whatever reaches it once
(:func:`exit_status`).

    try: ...
    except Exception as exc: return exit_status(exc)      # the CLI's last word

Torch-free at import (the CLI imports this before torch loads); the functions that talk to the
process group import ``torch.distributed`` when called.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sys
import time
import traceback
import zlib
from dataclasses import dataclass
from pathlib import Path

from .. import errors
from ..errors import AlreadyReported, CollectiveTimeout, ConfigError, DdpkitError, PeerLost, Stopped, WorkersFailed
from ..files import atomic_write
from . import env

CONSEQUENCES = (CollectiveTimeout, PeerLost)  # what a rank meets when another fails
PEER_WAIT_S = 5.0  # under torchrun, how long a rank other than 0 leaves rank 0 to print an error first
# How long a rank that only lost a peer waits before it exits, under ddpkit's launcher. torch's agent
# records only the first worker it finds ended (it polls every 0.1 s, then stops the rest), and a peer
# that died is what made this rank fail, so it is dead already: 10 polls later, the agent has recorded
# that peer, not this rank. A rank the agent stops while it waits ends at once (SIGTERM); one it stopped
# inside the training loop, where SIGTERM is only noted, costs the job this second.
CONSEQUENCE_EXIT_DELAY_S = 1.0
_CAUSE_KEY = "ddpkit/cause-reported"
# Set instead by a rank that filed a lost peer: it silences another lost peer, never a timeout (see worker_failure)
_LOST_KEY = "ddpkit/peer-lost-reported"
_SAID_KEY = "ddpkit/said"  # + an error's checksum: how many ranks met it (_first_to_say)


@dataclass(frozen=True)
class Failure:
    """What a worker returns, instead of exiting non-zero, for an error every rank met alike."""

    message: str
    exit_code: int
    printed: bool
    kind: str = ""  # its class, when it is one of ddpkit.errors (see public_kind)


def public_kind(exc: BaseException) -> str:
    """The name of ``exc``'s class if it is one of :mod:`ddpkit.errors`'s public classes, else ""."""
    name = type(exc).__name__
    return name if name in errors.__all__ and getattr(errors, name) is type(exc) else ""


def rebuilt(kind: str, message: str, exit_code: int, reported: bool, rank: int | None = None) -> Exception:
    """A worker's error raised again in the launcher: the same :mod:`ddpkit.errors` class (looked up by
    name, nothing else is) with the same message, or :class:`WorkersFailed` for any other."""
    cls = getattr(errors, kind, None) if kind in errors.__all__ else None
    if not (isinstance(cls, type) and issubclass(cls, DdpkitError)):
        where = f"rank {rank}: " if rank is not None else ""
        return WorkersFailed(f"{where}{message}", reported, exit_code)
    exc = cls.__new__(cls)  # not cls(...): Stopped and AlreadyReported take other arguments
    Exception.__init__(exc, message)
    exc.exit_code, exc.reported = exit_code, reported
    if rank is not None:
        exc.rank = rank
    return exc


def say(line: str) -> None:
    """``line`` on stderr in one write, its newline with it: print() writes them apart, and a line another rank
    wrote between them was glued to this one (``...snapshots=backgroundddpkit: error: ...``, the porter's seed 003
    under ``python -u``)."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


# ---------------------------------------------------------------------- in a rank
def report_failure(exc: BaseException, rank: int) -> None:
    """Say once why this rank fails: its one line (a ddpkit error) or its traceback (a bug), on
    stderr and in the file where the elastic agent collects workers' errors for the launcher;
    and note in the job's store that a cause was given, so peers that merely lost this rank
    stay quiet. An error every rank meets alike (``all_ranks``) is left to the launcher, and so,
    under ddpkit's launcher, is a lost peer (``deferred``): the peer may have died without a word,
    and the launcher, which learns how it died, names it instead."""
    if getattr(exc, "reported", False) or getattr(exc, "all_ranks", False):
        return
    quiet = bool(getattr(exc, "quiet", False))
    if getattr(exc, "filed_for_launcher", False):
        # Left unprinted in the agent's error file for ddpkit's launcher already (a started Loop's script ended on
        # it, filed_for_launcher): the launcher says it once. Rewriting the file here marked it printed, and the
        # job ended with its exit status and no line at all
        if not quiet:
            _note_cause(rank, exc)
        exc.reported, exc.deferred = True, False
        return
    consequence = isinstance(exc, CONSEQUENCES)
    launcher = bool(os.environ.get(env.LAUNCHER_PID))
    deferred = consequence and launcher
    # An error several ranks may meet at once, each on its own (not all_ranks: some may not): the launcher
    # says the first it reads, once
    said_once = launcher and bool(getattr(exc, "said_by_launcher", False))
    already = getattr(exc, "already_said", False)  # by the script's excepthook (a Loop.start()-ed script's end)
    printed = not (quiet or deferred or said_once)
    if isinstance(exc, DdpkitError):
        line, code = f"rank {rank}: {exc}", exc.exit_code
        if printed and not already:
            printed = _first_to_say(exc)
            if printed:
                say(f"ddpkit: {group_of()}error: {line}")
    else:
        if not already:
            # A bug keeps its traceback: once for the job where every rank meets the very same one (the same text,
            # counted in the group's store), as a ddpkit error's line is
            text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
            printed = printed and first_to_say(text)
            if printed:
                sys.stderr.write(text)
                sys.stderr.flush()
        line, code = f"rank {rank} raised {type(exc).__name__}: {exc}", 1
    if not quiet:
        _note_cause(rank, exc)
    write_error_file(
        line,
        quiet,
        code,
        traceback_printed=not isinstance(exc, DdpkitError),
        kind=public_kind(exc),
        text=str(exc),
        rank=rank,
        consequence=consequence,
        printed=printed,
    )
    exc.reported, exc.deferred = True, deferred and not quiet


def _first_to_say(exc: DdpkitError) -> bool:
    """Whether this rank is the first of its group to say ``exc`` (its class and text, an atomic count in the
    group's store): an error every rank meets alike, such as a bad argument to a Loop, is one line for the job,
    not one per rank; a different error on another rank is its own line. True when the store cannot answer (it
    went with a dead peer): then each rank says its own."""
    return first_to_say(f"{type(exc).__name__}: {exc}")


def first_to_say(text: str) -> bool:
    """Whether this rank is the first of its process group to say ``text`` (an error's line, or a traceback): an
    atomic count in the group's store. True outside a group, or when the store cannot answer."""
    if not _group_alive():
        return True
    import torch.distributed as dist

    said = zlib.crc32(text.encode())
    try:
        return dist.distributed_c10d._get_default_store().add(f"{_SAID_KEY}/{said:08x}", 1) == 1
    except Exception:
        return True


def worker_failure(exc: BaseException, world_size: int, timeout_s: float) -> BaseException:
    """What a rank raises when its work raised ``exc``: a broken collective said in the user's
    terms (quiet if another rank already said why), reported before the group is torn down."""
    user_error = (unused_parameters(exc) or comm_failure(exc, timeout_s)) if isinstance(exc, RuntimeError) else None
    said = user_error or exc
    if isinstance(said, (PeerLost, CollectiveTimeout)):
        # Another rank's failure reached this one as a broken collective. If that rank said why,
        # this rank stays quiet: one line for one cause. A lost peer said first is not a why for a timeout: in a
        # hang, the rank that timed out closes its connections, which breaks its peer's collective at once, and
        # that peer can file its lost peer first (a clean-clone run: the job said exit 4, not the timeout's 3)
        said.quiet = world_size > 1 and cause_reported(lost_peer=isinstance(said, PeerLost))
    return said


def write_error_file(
    line: str,
    quiet: bool,
    exit_code: int,
    traceback_printed: bool = False,
    kind: str = "",
    text: str | None = None,
    rank: int | None = None,
    consequence: bool = False,
    printed: bool | None = None,
) -> None:
    """The elastic agent's per-worker error file (``TORCHELASTIC_ERROR_FILE``), read back by :func:`worker_reports`:
    ``line`` as the rank printed it (or would have); ``kind``, ``text`` and ``rank``, to raise the same
    error in the launcher; ``consequence``, a lost peer rather than a cause; ``printed``, whether this rank
    printed it (by default: unless quiet)."""
    path = os.environ.get(env.ERROR_FILE)
    if not path:
        return
    first = line.strip().splitlines()[0][:500] if line.strip() else line
    text = line if text is None else text
    ddpkit = {
        "quiet": quiet,
        "exit_code": exit_code,
        "traceback": traceback_printed,
        "kind": kind,
        "text": text.strip().splitlines()[0][:500] if text.strip() else text,
        "rank": rank,
        "consequence": consequence,
        "printed": (not quiet) if printed is None else printed,
        # When, in seconds since the epoch: the earliest of several ranks' consequences is the one nearest the
        # cause (the JSON's "timestamp", torch's, is whole seconds)
        "at": time.time(),
    }
    # Whole or not at all (files.atomic_write). Opened in place, a rank stopped between the truncation and the write
    # (the agent's SIGTERM to a rank that was filing a lost peer) left an empty file, and torch's agent failed
    # reading it with a JSONDecodeError traceback in place of the job's one line (a clean-clone run, 2026-11-29)
    data = json.dumps({"message": first, "timestamp": int(time.time()), "ddpkit": ddpkit}).encode()
    with contextlib.suppress(errors.RunDirError):  # (an OSError, said as one): the launcher then says what it saw
        atomic_write(Path(path), data, durable=False)  # (no fsync: written in a race with the agent's kill)


def _note_cause(rank: int, exc: BaseException) -> None:
    """Tell the job (through the process group's store) that this rank says why it failed: ``exc``, under its
    own key when it is a lost peer (which silences only other lost peers)."""
    import torch.distributed as dist

    try:
        dist.distributed_c10d._get_default_store().set(
            _LOST_KEY if isinstance(exc, PeerLost) else _CAUSE_KEY, str(rank)
        )
    except Exception:  # the store may be gone with a dead peer: then the others speak for themselves
        pass


def cause_reported(lost_peer: bool = True) -> bool:
    """Whether another rank already said why the job failed (a non-blocking store check); ``lost_peer``: a
    rank's lost peer counts."""
    import torch.distributed as dist

    try:
        store = dist.distributed_c10d._get_default_store()
        return store.check([_CAUSE_KEY]) or (lost_peer and store.check([_LOST_KEY]))
    except Exception:
        return False


_TIMEOUT = re.compile(r"timed out|timeout", re.IGNORECASE)
_COMM = re.compile(r"gloo|nccl|store|collective|process ?group", re.IGNORECASE)
_PEER_GONE = re.compile(r"connection (closed|reset) by peer|broken pipe|connection refused", re.IGNORECASE)


def timeout_message(timeout_s: float, detail: str = "") -> str:
    """What a collective timeout means and what to do, for gloo errors and NCCL aborts alike."""
    return (
        f"a collective did not complete within --timeout-s {timeout_s:g} s: another rank stalled, or died "
        f"without its launcher noticing. If a step, an evaluation or a snapshot save can legitimately take "
        f"that long, raise --timeout-s.{f' ({detail})' if detail else ''}"
    )


def comm_failure(exc: RuntimeError, timeout_s: float) -> Exception | None:
    """A collective's failure, said in the user's terms; None for any other error."""
    import torch.distributed as dist

    text = str(exc)
    comm = isinstance(exc, getattr(dist, "DistError", ())) or _COMM.search(text)
    if not comm:
        return None
    first = text.strip().splitlines()[0][:240] if text.strip() else type(exc).__name__
    if _TIMEOUT.search(text):
        return CollectiveTimeout(timeout_message(timeout_s, first))
    if _PEER_GONE.search(text):
        return PeerLost(
            f"another rank left mid-collective (it died or was stopped; its own output says why). ({first})"
        )
    return None


_JOINED = re.compile(r"(\d+)/(\d+) clients joined")


def rendezvous_failure(exc: Exception, world_size: int, timeout_s: float) -> PeerLost:
    """``init_process_group``'s failure to meet (torch's ``DistStoreError``/``DistNetworkError``: a 30-line
    traceback) as one line: the endpoint from MASTER_ADDR/MASTER_PORT, who did not arrive, what to check.
    The CLI puts the rank in front (``rank 1: ...``) where it is not 0."""
    where = ":".join(os.environ.get(name, "?") for name in env.MASTER_VARS)
    by = "SLURM's variables" if os.environ.get(env.LAUNCHED_BY) == "slurm" else "MASTER_ADDR/MASTER_PORT"
    text = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
    joined = _JOINED.search(text)
    if joined:  # this rank hosts the store and counted who came
        came, expected = int(joined[1]), int(joined[2])
        return PeerLost(
            f"only {came} of the {expected} ranks (WORLD_SIZE={world_size}) reached the rendezvous at {where} "
            f"(from {by}) within --timeout-s {timeout_s:g} s; the other {expected - came} never arrived: start "
            f"every rank (under SLURM every task of the step, under torchrun the same command on every node), "
            f"and check that each reaches {where}"
        )
    if _TIMEOUT.search(text) or isinstance(exc, TimeoutError):
        return PeerLost(
            f"could not reach the rendezvous at {where} (from {by}) within --timeout-s {timeout_s:g} s: "
            f"rank 0, which hosts it, has not started (or has exited), or this node cannot reach that address; "
            f"check that rank 0 runs there and that {where} is reachable from here ({text})"
        )
    return PeerLost(f"could not join the process group at {where} (from {by}): {text}")


_NO_GRAD = re.compile(r"Parameter indices which did not receive grad for rank \d+: ([\d ]+)")


def unused_parameters(exc: RuntimeError) -> ConfigError | None:
    """DDP's "Expected to have finished reduction in the prior iteration" (a rank's step left some
    parameters without a gradient, so their bucket's all-reduce never started), said in ddpkit's terms: it
    names torch's keyword ``find_unused_parameters``, where ddpkit's flag is ``--find-unused-parameters``.
    Preflight's trial step finds a branch no batch uses; this is one that depends on the batch."""
    text = str(exc)
    if "find_unused_parameters" not in text or "finished reduction in the prior iteration" not in text:
        return None
    indices = _NO_GRAD.search(text)
    which = f" (parameters {', '.join(indices[1].split())} in model.parameters() order)" if indices else ""
    error = ConfigError(
        f"parameters got no gradient in a training step{which}, and which ones depends on the batch (ddpkit's "
        f"trial step before launch used them all), so DDP could not finish its gradient sync: pass "
        f"--find-unused-parameters (find_unused_parameters=True in TrainConfig or Loop.wrap), or make every "
        f"parameter take part in every step's loss"
    )
    error.said_by_launcher = True  # every rank whose step left them out meets it: one line for the job
    return error


def outside_group_failure(exc: DdpkitError) -> None:
    """A rank's error raised outside the process group (before it was made): print and file it here."""
    if getattr(exc, "reported", False):  # inside the group, report_failure said it
        return
    many = int(os.environ.get(env.WORLD_SIZE, "1")) > 1
    where = f"rank {env.env_rank()}: " if many else ""
    rank = env.env_rank() if many else None
    write_error_file(f"{where}{exc}", False, exc.exit_code, kind=public_kind(exc), text=str(exc), rank=rank)
    say(f"ddpkit: {group_of()}error: {where}{exc}")


def outside_group_bug(exc: BaseException) -> None:
    """A bug raised outside the process group: its traceback, printed by the rank that hit it, and filed."""
    if getattr(exc, "reported", False):
        return
    traceback.print_exc()
    sys.stderr.flush()
    write_error_file(f"rank {env.env_rank()} raised {type(exc).__name__}: {exc}", False, 1, traceback_printed=True)


# ---------------------------------------------------------------------- in the launcher
def worker_reports(failures: dict) -> list[dict]:
    """What the workers of this node said about their failure: their error files, found beside those
    of the failures the agent observed (``{global rank: ProcessFailure}``, a ``ChildFailedError``'s
    ``failures``; it observes the first and stops the rest)."""
    dirs = {
        Path(f.error_file).parent.parent
        for f in failures.values()
        if isinstance(f.error_file, str) and Path(f.error_file).is_file()
    }
    reports = []
    for folder in dirs:
        for path in sorted(folder.glob("*/error.json")):
            try:
                data = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if isinstance(data.get("ddpkit"), dict) and isinstance(data.get("message"), str):
                reports.append({"message": data["message"], **data["ddpkit"]})
    return reports


def launch_failure(failures: dict, timeout_s: float, device_type: str = "cuda") -> Exception:
    """A failed job (torch's ``ChildFailedError.failures``: ``{global rank: ProcessFailure}``) as one
    error, of the class the worker raised. The cause, in order: a worker's own error (its line or
    traceback is printed); a worker that died of a signal (said here, from the agent's record of its
    exit code); the others' timeout or "lost a peer" lines (said here): a timeout first, then the earliest."""
    reports = [r for r in worker_reports(failures) if not r["quiet"]]
    causes = [r for r in reports if not r.get("consequence")]
    if causes:
        # One a rank printed already, if any: the others met the same error and left it unsaid (_first_to_say)
        cause = next((r for r in causes if r.get("printed")), causes[0])
        if cause.get("traceback", cause["exit_code"] == 1):  # a bug: its rank printed the traceback, not a line
            return WorkersFailed(f"{cause['message']} (its traceback is above)", False, 1)
        return _from_report(cause)
    codes = {rank: f.exitcode for rank, f in failures.items()}
    killed = signal_failure(codes, timeout_s, device_type)
    if killed is not None:
        return killed
    if reports:
        # A timeout first, then the earliest: in a hang one rank's collective times out and gloo closes its
        # connections, which breaks the peer's collective at once ("Connection closed by peer"); the peer's line
        # can be written first (the timed-out rank writes the hang report before its own), and is not the cause
        return _from_report(
            min(reports, key=lambda r: (r.get("kind") != CollectiveTimeout.__name__, r.get("at", float("inf"))))
        )
    said = [r for r in worker_reports(failures) if r["quiet"] and not r.get("consequence")]
    if said:  # said elsewhere, met alike (another replica group's, which says it): its status, and no line here
        return WorkersFailed(said[0]["message"], True, said[0]["exit_code"])
    return silent_exit(codes)


def silent_exit(codes: dict[int, int]) -> WorkersFailed:
    """Ranks that exited without a word (no error file: ``os._exit(N)``, a library ending the process): which,
    with which code, and what the code means where ddpkit knows. Their codes once passed for "reported"
    (2, 3, 4 and 143 are ddpkit's own), and the job ended with no message at all."""
    said = ", ".join(f"rank {rank} exited with code {code}{exit_meaning(code)}" for rank, code in codes.items())
    first = next(iter(codes.values()))
    it, its = ("it", "its") if len(codes) == 1 else ("they", "their")
    return WorkersFailed(
        f"{said} and left no message: {it} did not end through ddpkit (an os._exit() in your code, or a library "
        f"that ends the process); {its} own output, if any, is above",
        False,
        first if 0 < first < 256 else 1,
    )


def exit_meaning(code: int) -> str:
    """`` (what it means)`` for an exit code ddpkit knows, else ""."""
    if 128 < code < 128 + 65:
        try:
            name = signal.Signals(code - 128).name
        except ValueError:
            return ""
        return f" (128 + {name}, as a process ends that exits on {name})"
    kinds = {c.exit_code: c.__name__ for c in (CollectiveTimeout, PeerLost)}
    if code in kinds:
        return f" (ddpkit's code for {kinds[code]}, which that rank did not report)"
    if code == DdpkitError.exit_code:
        return " (ddpkit's code for bad input, which that rank did not report)"
    return ""


def _from_report(report: dict) -> Exception:
    """A worker's error file as the error the launcher raises."""
    if "kind" not in report:  # written by something else than report_failure: its line as it is
        return WorkersFailed(report["message"], report.get("printed", True), report["exit_code"])
    return rebuilt(report["kind"], report["text"], report["exit_code"], report["printed"], report["rank"])


def restart_note(
    failures: dict, timeout_s: float, restart: int, max_restarts: int, device_type: str = "cuda"
) -> str | None:
    """What the launcher says when the agent restarts the workers after ``failures``: the cause, in
    :func:`launch_failure`'s terms, unless a worker printed it already; None then."""
    cause = launch_failure(failures, timeout_s, device_type)
    if getattr(cause, "reported", False):
        return None
    rank = getattr(cause, "rank", None)
    said = f"{'' if rank is None else f'rank {rank}: '}{cause}"
    again = f"the agent restarts the workers (restart {restart} of --max-restarts {max_restarts})"
    return f"ddpkit: {group_of()}{said}; {again}"


def signal_failure(codes: dict[int, int], timeout_s: float, device_type: str = "cuda") -> DdpkitError | None:
    """Workers ended by a signal (negative exit codes), said in the user's terms; None otherwise.

    On GPUs, NCCL's watchdog aborts its process (SIGABRT) when a collective times out or a peer's
    connection breaks, instead of raising in Python as gloo does; so a SIGABRT there is most
    often that. NCCL's own lines above the error name which (``NCCL_DEBUG=WARN`` for more). On CPU
    (``device_type`` "cpu": gloo) there is no watchdog and no timeout behind an abort: it is native
    code ending the process, most often gloo's own check on collectives that do not match across
    ranks (``EnforceNotMet``), so naming NCCL and the timeout there sent the reader the wrong way.
    """
    signalled = {rank: -code for rank, code in codes.items() if code < 0}
    if not signalled:
        return None
    rank, signum = min(signalled.items())
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    if signum == signal.SIGABRT and device_type != "cuda":
        return PeerLost(
            f"rank {rank} was aborted (SIGABRT) in native code. On CPU this is most often gloo finding that the "
            f"ranks' collectives do not match (one rank ran a collective the others did not, such as a forward "
            f"on one rank only, or ran them in another order): its own lines above (gloo's EnforceNotMet, "
            f"'terminate called') say where; make every rank run the same collectives in the same order"
        )
    if signum == signal.SIGABRT:
        return CollectiveTimeout(
            f"rank {rank} was aborted (SIGABRT). On GPUs this is NCCL's watchdog: "
            + timeout_message(timeout_s)
            + " A peer that died first is named by its own "
            "error above; NCCL_DEBUG=WARN shows NCCL's reason."
        )
    if signum == signal.SIGKILL:
        return PeerLost(
            f"rank {rank} was killed (SIGKILL): most often by the kernel's out-of-memory killer "
            f"(see `dmesg`; a smaller batch per rank, ddpkit train's --batch-size or your script's own, or fewer "
            f"processes, --nproc), or from outside the job"
        )
    return PeerLost(
        f"rank {rank} died of {name}; if nothing above explains it, it is a crash in native code "
        f"(set TORCH_SHOW_CPP_STACKTRACES=1 and rerun to see where)"
    )


def interrupted(sig: signal.Signals, resumable: bool, run_end: dict | None = None) -> WorkersFailed:
    """The launcher was sent ``sig`` (Ctrl-C, SIGTERM) and stopped the workers. ``run_end``: global rank 0's
    note that the run had finished before (ranks/endnotes.py), when the workers were stopped after that, in a
    script's code after its loop or in the teardown."""
    if run_end is not None:
        return WorkersFailed(
            f"interrupted: the launcher received {sig.name} after the run in {run_end['run_dir']} finished at step "
            f"{run_end['step']} (epoch {run_end['epoch']}), and stopped the workers in what followed it (the "
            f"script's code after its loop, or the teardown): the run is whole on disk; {run_end['rerun']}",
            False,
            128 + sig.value,
        )
    after = (
        (
            " before they saved a snapshot on the way out (none reached a safe point within the agent's grace "
            "period, or none had started training); run the same command again to resume from the run dir's "
            "newest snapshot, if it has one"
        )
        if resumable
        else ""
    )
    return WorkersFailed(
        f"interrupted: the launcher received {sig.name} and stopped the workers{after}", False, 128 + sig.value
    )


def returned_failure(result: Failure) -> Exception:
    """Rank 0's returned :class:`Failure` (an error every rank met) as the launcher's error, of the
    class the workers raised, printed once."""
    return rebuilt(result.kind, result.message, result.exit_code, result.printed)


def as_returned(exc: DdpkitError, rank: int) -> Failure:
    """A worker's all-ranks error as what it returns (exit 0 keeps the agent from restarting into it
    again). A stop is printed by rank 0 here: a launcher that is itself shutting down never reads
    return values."""
    printed = (isinstance(exc, Stopped) and rank == 0) or isinstance(exc, AlreadyReported)
    if printed and not isinstance(exc, AlreadyReported):
        say(f"ddpkit: {group_of()}{exc}")
        # for a launcher that is itself shutting down, and so reads no return value (stopped_report)
        write_error_file(str(exc), False, exc.exit_code, kind=public_kind(exc), text=str(exc), printed=True)
    return Failure(str(exc), exc.exit_code, printed, public_kind(exc))


def stopped_report(log_dir: str) -> Exception | None:
    """The stop rank 0 said (and left in its error file, :func:`as_returned`), read by a launcher whose
    agent was interrupted and stopped the workers: the job stopped cleanly, said once, with the stop's exit
    status; None when no rank stopped (none reached a safe point before the agent's grace period ended)."""
    for path in sorted(Path(log_dir).glob("**/error.json")):
        try:
            report = json.loads(path.read_text()).get("ddpkit") or {}
        except (OSError, ValueError, AttributeError):
            continue
        if report.get("kind") == Stopped.__name__:
            return rebuilt(Stopped.__name__, report["text"], report["exit_code"], report.get("printed", True))
    return None


# ---------------------------------------------------------------------- in the CLI
def exit_status(exc: DdpkitError | WorkersFailed | KeyboardInterrupt) -> int:
    """Print a user error, a failed job or an interrupt as the CLI's one line (unless it was printed
    already), and return the exit status."""
    if isinstance(exc, DdpkitError):
        if not getattr(exc, "reported", False):  # else its rank printed it already (report_failure)
            return _report_once(exc)
        return exc.exit_code
    if isinstance(exc, WorkersFailed) and exc.results is not None:  # stopped in the teardown, the work done
        say(f"ddpkit: {group_of()}{exc}; the job ends as finished")
        return 0
    if isinstance(exc, WorkersFailed):
        if not exc.reported:
            say(f"ddpkit: {group_of()}error: {exc}" + ("" if "above" in str(exc) else "; their output is above"))
        return exc.exit_code
    say("ddpkit: interrupted")  # KeyboardInterrupt
    return 130


def stop_exits_with_its_status() -> None:
    """From now on, a ddpkit error that reaches the top of the user's script uncaught ends it as the CLI
    does: its one line, once, and its exit status (a :class:`Stopped`: 143, 138 for SIGUSR1, 130 for Ctrl-C;
    a bad config: 2; a failed job, :class:`WorkersFailed`, whose rank printed its traceback: that rank's
    status), not a traceback and status 1. Any other exception, and any in an interactive session (which a
    stop must not end), goes to the hook that was there. Installed once per process, at ``import ddpkit``
    (``Trainer()``, ``Loop`` and ``launch()`` rely on it): a stop is how a preempted job is meant to end, and
    schedulers read its status; from Python the error is raised as it is, for a caller to catch."""
    if _STOP_HOOK[0]:
        return
    previous = sys.excepthook

    def hook(kind, exc, tb):
        # (WorkersFailed: a worker's own bug, its traceback printed by its rank; a second one, the launcher's, hid it)
        if isinstance(exc, (DdpkitError, WorkersFailed)) and not (hasattr(sys, "ps1") or sys.flags.interactive):
            # torch's init_process_group wraps the hook it finds and points sys.stderr at a buffer it prints
            # after the hook returns, which an exit never does: the line goes to the real stderr
            with contextlib.redirect_stderr(sys.__stderr__):
                if isinstance(exc, WorkersFailed) and exc.results is not None:
                    # Stopped in the workers' teardown, their work done: finished for the CLI (exit_status), but
                    # the script's own code after launch() never ran, so its status is the stop's, not 0 (a review
                    # finding: a scheduler would not requeue it)
                    say(f"ddpkit: {group_of()}{exc}")
                    code = exc.exit_code
                else:
                    code = exit_status(exc)
            sys.exit(code)
        previous(kind, exc, tb)

    sys.excepthook = hook
    _STOP_HOOK[0] = True


_STOP_HOOK = [False]  # installed in this process


def filed_for_launcher(exc: DdpkitError) -> bool:
    """In a rank of ddpkit's own launcher that ends through :func:`exit_status` (a ``ddpkit run`` script's:
    its Loop's stop or error, or an error it left uncaught): leave ``exc`` unprinted in the agent's error file,
    for the launcher, which reads every rank's and says the job's cause once. False anywhere else."""
    if not (os.environ.get(env.LAUNCHER_PID) and os.environ.get(env.ERROR_FILE) and env.under_launcher()):
        return False
    rank = None if exc.all_ranks else env.env_rank()  # every rank met it alike: said without one
    exc.filed_for_launcher = True  # the group's teardown, after, leaves this file as it is (report_failure)
    write_error_file(
        str(exc) if rank is None else f"rank {rank}: {exc}",
        # said elsewhere (another replica group's, met alike), or by the attempt that met it (a restart's note of it)
        bool(getattr(exc, "quiet", False)) or isinstance(exc, AlreadyReported),
        exc.exit_code,
        kind=public_kind(exc),
        text=str(exc),
        rank=rank,
        consequence=isinstance(exc, CONSEQUENCES),
        printed=False,
    )
    return True


def _report_once(exc: DdpkitError) -> int:
    """Print ``exc`` once for the job. Under torchrun every rank gets here.

    An error every rank meets alike in training is printed by global rank 0 alone. One met
    before training (a bad flag, missing data) is usually met by every rank too, but not always
    (data missing on one node). So the other ranks first leave rank 0 time to print it: torchrun
    stops a node's ranks when one of them exits, and without the wait a rank that exited first
    had a slower rank 0 stopped before it printed, and the error was not reported at all. A
    rank still alive afterwards may have met it alone, and says so: on rank 0's node every rank,
    on another node its local rank 0 only (those nodes' agents may learn of rank 0's exit too
    late, so an error met everywhere is printed once per node there).
    """
    if filed_for_launcher(exc):
        return exc.exit_code
    rank = os.environ.get(env.RANK, "0") if env.under_launcher() else "0"
    if not exc.all_ranks and _group_alive():
        # The script's process group is still up (a Loop.start()-ed script's, torn down at exit, after this): its
        # store counts who says what, so the first rank to meet an error says it and the rest stay quiet, with no
        # wait. Before, every rank other than 0 waited PEER_WAIT_S and said it again (the porter's item B).
        if not _first_to_say(exc):
            return exc.exit_code
    elif rank != "0":
        other_node = os.environ.get(env.GROUP_RANK, "0") != "0"
        if exc.all_ranks or (other_node and os.environ.get(env.LOCAL_RANK, "0") != "0"):
            return exc.exit_code
        try:
            time.sleep(PEER_WAIT_S)
        except KeyboardInterrupt:
            return 130
    where = f"rank {exc.rank}: " if exc.rank is not None else "" if rank == "0" else f"rank {rank}: "
    said = "" if isinstance(exc, Stopped) else "error: "  # a stop that saved its snapshot is no error
    say(f"ddpkit: {group_of()}{said}{where}{exc}")
    return exc.exit_code


def _group_alive() -> bool:
    """Whether this process is in a default process group now (never imports torch: the CLI's launcher has not)."""
    dist = sys.modules.get("torch.distributed")
    return bool(dist is not None and dist.is_available() and dist.is_initialized())


def group_of() -> str:
    """ "replica group G: " in a group of ``ddpkit train --replicas`` (its launcher's lines and its workers'), so
    that a line says which group it is of; "" elsewhere."""
    group = os.environ.get(env.REPLICA)
    return f"replica group {group}: " if group is not None else ""
