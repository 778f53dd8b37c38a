"""When a job hangs, say which rank is behind and where: a watch thread on every rank.

    watch = HangWatch(ctx.rank, ctx.world_size, timeout_s, store)   # started by ranks.context.distributed
    with watch.collective("all_reduce", tensor): dist.all_reduce(tensor)   # DistContext's collectives
    watch.progress(step)                                             # the engine, every step (two stores)

A collective that never completes is most often a rank that never called it (pytorch#118369):
one rank still in its own code, or one that called another collective. gloo and NCCL then wait
until ``--timeout-s`` and say only that they timed out. Here, when a rank has waited in a
collective for ``TRIGGER_FRACTION`` of the timeout, or the training loop has made no step for that
long, it raises a flag in the job's c10d store (a clone of the group's store: its own connection,
so a main thread waiting on the store does not hold the watch up). Every rank's watch sees it and answers with what
its main thread is doing: its Python stack (``sys._current_frames``), the collective it waits in
and ddpkit's record of the last ones it issued (sequence numbers, op, shape, the line that called
it), its step and the time since. The watch of the rank that noticed (its main thread waits, so
its watch is free) gathers the answers while every rank can still give them, and keeps them in the
store. They become a report only when the wait ends in the collective's timeout: the rank whose
collective timed out (:meth:`HangWatch.publish`, called by the group's error path before the timeout's
own line) writes it, once for the job (JSON, beside the run: ``RUN_DIR/hang-report.json``, or in the
temp folder for ``ddpkit.launch``), and prints one line, e.g.

    ddpkit: hang: rank 1 is behind: in `slow_loss` at train.py:42 (step 1207, 31 s since its last
    step); rank 0 waits in all_reduce #8812 (at engine.py:530). Every rank's stack: RUN/hang-report.json

A rank late by less than the timeout (rank 0's own logging between steps) is no hang, however late:
the job tolerates it, and a run that completes never reports one. On NCCL, whose watchdog ends the
process at the timeout without returning to Python, the waiting rank's watch writes the report
instead when its wait is ``lead_s`` short of the timeout.

DDP's own gradient all-reduces run in C++ and are not in ddpkit's record: a rank blocked there shows it
in its stack (``loss.backward()``), and the step heartbeat is what raises the flag. On NCCL, torch's
Flight Recorder (``TORCH_NCCL_TRACE_BUFFER_SIZE``) records every collective, DDP's included; where it
is on, its dump is added to the rank's answer.

A raised flag is a question, not yet a report: the answers are a round, and the gatherer judges them
(:func:`verdict`). Not a hang, and the watch looks again ``RECHECK_FRACTION`` of the threshold later:

- a rank busy in ddpkit's own work between steps (``with busy("saving snapshot-...pt")``: a snapshot,
  the records and loggers, any ``on_rank0`` write), which the others wait for in a collective;
- no rank waiting in a collective: every rank in its own compute (a step slower than the threshold
  everywhere), or every rank in the backward of the same step.

A hang is confirmed only when a second round, ``RECHECK_FRACTION`` of the threshold after the first,
finds the same state with nothing moved (no rank's step, heartbeat or collective count changed): one
sample can catch a rank a moment before the others join it. A confirmed hang is looked at again while it
lasts (its answers kept fresh for the report); one that moves is dropped. ``stop()`` (the group's
teardown) abandons a report not yet printed.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections import deque
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from . import env

TRIGGER_FRACTION = 0.5  # of --timeout-s: the answers are gathered while every rank can still give them
# of the threshold: how soon a cleared round is looked at again, and the gap between the two rounds that
# confirm a hang (confirmed at 0.625 of --timeout-s, plus the gathering; reported at the timeout)
RECHECK_FRACTION = 0.25
RECENT = 8  # collectives kept per rank
PREFIX = "ddpkit/hang"
_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # src/ddpkit: not the user's code


class HangWatch:
    """This rank's record of its collectives and steps, and the thread that asks every rank what it does
    when one is late; the hang it confirms is reported once, when the wait times out (:meth:`publish`)."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        timeout_s: float,
        store,
        attempt: str = "0",
        main_store=None,
        abrupt: bool = False,
    ):
        self.rank, self.world_size, self.timeout_s, self.store = rank, world_size, timeout_s, store
        # The backend ends the process at the timeout without returning to Python (NCCL's watchdog): the
        # report cannot wait for the timeout's error, and is written lead_s before it
        self.abrupt = abrupt
        # The store the main thread announces its busy work in (the group's own, not the watch's clone): a
        # torch.save of a large snapshot holds the GIL for seconds (1 s per 200 MB here), and this rank's
        # watch cannot answer meanwhile; the announcement answers for it.
        self.main_store = main_store
        self.prefix = f"{PREFIX}/{attempt}"  # a restarted group must not read the last attempt's answers
        self.trigger_s = timeout_s * TRIGGER_FRACTION
        self.poll_s = min(2.0, max(0.1, timeout_s / 40))
        self.recheck_s = max(self.poll_s, self.trigger_s * RECHECK_FRACTION)
        self.lead_s = max(3 * self.poll_s, min(10.0, timeout_s * 0.05))  # 3 polls: the watch sees it in time
        self.recent: deque = deque(maxlen=RECENT)
        self.current: dict | None = None  # the collective this rank is in now
        self.seq = 0
        self.step: int | None = None
        self.phase = ""
        self.last_progress = time.monotonic()
        self.busy: tuple[str, float] | None = None  # (what, since): ddpkit's own work between steps
        self.busy_ended = 0.0  # when the last busy work ended: the heartbeat resumes from there
        self.run_dir: str | None = None
        self.report_path: Path | None = None  # where this rank wrote it
        self.round = 0  # the round of questions this rank is in (see _poll)
        self.last_clear = -float("inf")  # when this rank last saw a round end without a report
        self._main = threading.main_thread().ident
        self._done = threading.Event()
        self._lock = threading.Lock()  # a report is printed whole before stop() returns, or never
        self._answered = False
        self._thread = threading.Thread(target=self._run, name="ddpkit-hangwatch", daemon=True)

    # ------------------------------------------------------------------ what the main thread calls
    def start(self) -> HangWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Before the group's teardown: no report after this returns (one being gathered is abandoned)."""
        locked = self._lock.acquire(timeout=5.0)  # a report being written to a stuck disk must not hold teardown
        self._done.set()
        if locked:
            self._lock.release()
        self._thread.join(timeout=2 * self.poll_s + 1)

    @contextmanager
    def collective(self, op: str, tensor=None) -> Iterator[dict]:
        """Around one collective of ddpkit's: recorded with its sequence number and caller. The caller
        puts the collective's ``work`` in the entry: on NCCL the host returns once it is queued, and
        the entry stays pending until the work completes (``is_completed``, asked by the watch thread)."""
        self.seq += 1
        entry = {
            "seq": self.seq,
            "op": op,
            "shape": list(tensor.shape) if tensor is not None else None,
            "called_at": _caller(),
            "started": time.monotonic(),
        }
        self.current = entry
        try:
            yield entry
        finally:
            entry["took_s"] = round(time.monotonic() - entry["started"], 4)
            self.current = None
            self.recent.append(entry)

    def progress(self, step: int, phase: str = "train") -> None:
        """A heartbeat: the training loop made a step (or an eval batch). Two assignments, no sync."""
        self.step, self.phase, self.last_progress = step, phase, time.monotonic()

    def idle(self) -> None:
        """The loop has stopped stepping on purpose (training done): no heartbeat is expected."""
        self.phase = ""

    @contextmanager
    def busy_with(self, what: str, announce: bool = False) -> Iterator[None]:
        """Around this rank's own work of ddpkit's between steps (rank 0 writing a snapshot): the heartbeat
        is kept, and a rank waiting for this one meanwhile is no hang. ``announce``: also said in the store,
        for work that may hold the GIL (serialising a snapshot), two store writes."""
        if self.busy is not None:  # nested: the outer work names it
            yield
            return
        self.busy = (what, time.monotonic())
        key = f"{self.prefix}/busy/rank{self.rank}"
        if announce:
            self._announce(key, what)
        try:
            yield
        finally:
            if announce:
                self._announce(key, "")
            self.busy, self.busy_ended = None, time.monotonic()

    def _announce(self, key: str, what: str) -> None:
        if self.main_store is None:
            return
        try:
            self.main_store.set(key, what)
        except Exception:  # noqa: BLE001 - a store gone with the job: the watch is all this helps
            self.main_store = None

    # ------------------------------------------------------------------ the watch thread
    def _waiting_in(self) -> dict | None:
        """The collective this rank waits in: the one its host is in, else the oldest queued one (NCCL)
        that has not completed."""
        current = self.current
        if current is not None:
            return current
        for entry in list(self.recent):  # a copy: the main thread appends meanwhile
            work = entry.get("work")
            if work is not None and not work.is_completed():
                return entry
        return None

    def _late(self) -> str:
        now = time.monotonic()
        if now - self.last_clear < self.recheck_s:  # a round just ended without a report: not again at once
            return ""
        current = self._waiting_in()
        if current is not None and now - current["started"] > self.trigger_s:
            return f"rank {self.rank} waited {now - current['started']:.0f} s in {current['op']} #{current['seq']}"
        quiet = now - max(self.last_progress, self.busy_ended)
        if self.phase and self.busy is None and quiet > self.trigger_s:
            return f"rank {self.rank} made no {self.phase} step for {now - self.last_progress:.0f} s"
        return ""

    def _due(self) -> bool:
        """Where the backend ends the process at the timeout (``abrupt``): this rank's wait is within
        ``lead_s`` of it, so the report must be written now or never."""
        if not self.abrupt:
            return False
        current = self._waiting_in()
        if current is not None:
            since = current["started"]
        elif self.phase and self.busy is None:  # a wait in DDP's backward, told by the heartbeat
            since = max(self.last_progress, self.busy_ended)
        else:
            return False
        return time.monotonic() - since > self.timeout_s - self.lead_s

    def _run(self) -> None:
        while not self._done.wait(self.poll_s):
            try:
                if self._poll() or (self._due() and self._publish(self.store)):
                    return
            except Exception:  # noqa: BLE001 - a store gone with the job, a dying process: never fail the run
                return

    def _key(self, n: int, name: str) -> str:
        return f"{self.prefix}/{n}/{name}"

    def _poll(self) -> bool:
        """One look, in rounds: a rank that is late raises round n's flag (the first to notice gathers:
        its main thread waits, so its watch is free; rank 0 may be the one stuck), every rank answers,
        and the gatherer writes round n's verdict; after it every rank goes on to round n + 1.
        True when the watch is done (stopped while gathering)."""
        n = self.round
        if self._answered:  # this round's verdict, from whichever rank gathers
            if not self.store.check([self._key(n, "verdict")]):
                return False
            self._next_round()
            return False
        flag = self._key(n, "flag")
        why = self._late()
        gatherer = False
        if why and not self.store.check([flag]):
            mine = f"{why} [{self.rank}]"  # compare_set makes one of two at once the first
            gatherer = self.store.compare_set(flag, "", mine).decode() == mine
        if not self.store.check([flag]):
            return False
        self.store.set(self._key(n, f"rank{self.rank}"), json.dumps(self.answer()))
        self._answered = True
        if not gatherer:
            return False
        word = self._gather(n, self.store.get(flag).decode().rsplit(" [", 1)[0])
        if word is None:  # stopped: the run ended while the answers came in
            return True
        self.store.set(self._key(n, "verdict"), word)
        self._next_round()
        return False

    def _next_round(self) -> None:
        self.round += 1
        self._answered = False
        self.last_clear = time.monotonic()

    def answer(self) -> dict:
        """What this rank's main thread is doing now."""
        frames = sys._current_frames().get(self._main)
        stack = traceback.extract_stack(frames) if frames is not None else []
        current, now, busy = self._waiting_in(), time.monotonic(), self.busy
        out: dict[str, Any] = {
            "rank": self.rank,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "step": self.step,
            "phase": self.phase or None,
            "since_progress_s": round(now - self.last_progress, 1),
            "since_collective_s": round(now - self.recent[-1]["started"] - self.recent[-1]["took_s"], 1)
            if self.recent
            else None,
            "busy": {"what": busy[0], "for_s": round(now - busy[1], 1)} if busy else None,
            "collective": _public(current, now) if current else None,
            "recent": [_public(c, now) for c in list(self.recent)],  # a copy: the main thread appends
            "where": _user_frame(stack),
            "stack": [f"{_shown(f.filename)}:{f.lineno} in {f.name}" for f in stack[-40:]],
            # what moved, to compare two rounds by: this rank's own clock, its collectives issued
            "moved": [self.last_progress, self.busy_ended, self.seq],
        }
        trace = _flight_recorder()
        if trace:
            out["flight_recorder"] = trace
        return out

    def _gather(self, n: int, why: str) -> str | None:
        """The rank that noticed: wait for every rank's answer (a dead or stuck one does not answer), judge
        them, and keep a hang the round before found too as the job's pending report (:meth:`publish`). The
        round's verdict: "ok", "again <state>" (a hang seen once), "hang <state>" (seen twice, pending);
        None when the watch was stopped meanwhile."""
        before = self._key(n - 1, "verdict")
        previous = self.store.get(before).decode() if n and self.store.check([before]) else ""
        seen = previous.split(" ", 1)[1] if previous.startswith(("again ", "hang ")) else None
        # A watch answers within a poll (0.15 s at --timeout-s 6); the wait is for one the GIL holds up. In
        # a confirming round, not again for the ranks silent in the last: the report must beat the timeout.
        expected = range(self.world_size)
        if seen is not None:
            expected = [rank for rank, _, _ in json.loads(seen)]
        deadline = time.monotonic() + min(30.0, max(1.0, self.timeout_s * 0.2))
        keys = [self._key(n, f"rank{r}") for r in range(self.world_size)]
        while time.monotonic() < deadline and not self.store.check([keys[r] for r in expected]):
            if self._done.wait(self.poll_s):
                return None
        answers = [json.loads(self.store.get(k)) for k in keys if self.store.check([k])]
        answered = {a["rank"] for a in answers}
        announced = {}
        for r in sorted(set(range(self.world_size)) - answered):  # silent: busy where the GIL is held?
            key = f"{self.prefix}/busy/rank{r}"
            if self.store.check([key]) and self.store.get(key):
                announced[r] = self.store.get(key).decode()
        if len(answered) == self.world_size and n:  # every rank has left round n - 1: its keys can go
            for name in ["flag", "verdict", *(f"rank{r}" for r in range(self.world_size))]:
                self.store.delete_key(self._key(n - 1, name))
        line = verdict(answers, self.world_size, announced)
        pending = f"{self.prefix}/pending"
        state = json.dumps(sorted([a["rank"], a["step"], a["moved"]] for a in answers))
        if line is None or seen != state:
            self.store.delete_key(pending)  # a hang kept from an earlier round has moved on
            # seen once: look again, RECHECK_FRACTION of the threshold later
            return "ok" if line is None else "again " + state
        report = {"why": why, "summary": line, "timeout_s": self.timeout_s, "ranks": answers}
        self.store.set(pending, json.dumps(report))  # the freshest answers of a hang that lasts
        return "hang " + state

    def publish(self) -> None:
        """This rank's collective timed out (the group's error path, on the main thread, before the timeout's
        own line): write the report of the hang the rounds confirmed, once for the job. Nothing when none was
        confirmed, or when it was of an earlier wait of this rank's that has since ended."""
        try:
            self._publish(self.main_store if self.main_store is not None else self.store)
        except Exception:  # noqa: BLE001 - a store gone with the job: the timeout's own line remains
            pass

    def _publish(self, store) -> bool:
        """True when the job's report is written, by this rank or another."""
        key = f"{self.prefix}/pending"
        if not store.check([key]):
            return False
        report = json.loads(store.get(key))
        mine = [a["moved"] for a in report["ranks"] if a["rank"] == self.rank]
        if mine and mine[0] != [self.last_progress, self.busy_ended, self.seq]:
            return False  # this rank has moved since: the hang kept there is not the wait that timed out
        if store.compare_set(f"{self.prefix}/published", "", str(self.rank)).decode() == str(self.rank):
            self._write(report)
        return True

    def _write(self, report: dict) -> None:
        line = report["summary"]
        path = Path(self.run_dir) / "hang-report.json" if self.run_dir else _temp_report()
        with self._lock:
            if self._done.is_set():
                return  # the run ended (its teardown stopped the watch): a finished run reports no hang
            try:
                path.parent.mkdir(parents=True, exist_ok=True)  # a Loop's run dir appears with its first file
                path.write_text(json.dumps(report, indent=1) + "\n")
                where = f"every rank's stack and last collectives: {path}"
                self.report_path = path
            except OSError as exc:
                where = f"(the report could not be written to {path}: {exc.strerror})"
            print(f"ddpkit: hang: {line}. {where[0].upper()}{where[1:]}", file=sys.stderr, flush=True)


def verdict(answers: list[dict], world_size: int, announced: dict | None = None) -> str | None:
    """The report's line when the answers show a hang; None when they show ranks at work, which a slower
    step, snapshot or evaluation than half of --timeout-s is. ``announced``: silent ranks that said they
    are busy (:meth:`HangWatch.busy_with`)."""
    silent = set(range(world_size)) - {a["rank"] for a in answers}
    if any(a.get("busy") for a in answers) or set(announced or ()) & silent:
        return None  # alive in ddpkit's own work between steps: whoever waits, waits for it
    waiting = [a for a in answers if _waits(a)]
    if not waiting:
        return None  # no rank waits in a collective: every one in its own compute (or stuck without Python)
    if not silent and len(waiting) == len(answers) and all(a["collective"] is None for a in answers):
        if len({_what(a) for a in answers}) == 1:
            # every rank in the backward of the same step: a slow backward everywhere looks exactly like
            # this; DDP's all-reduce stuck in it is told by the collective timeout
            return None
    return summary(answers, world_size)


def summary(answers: list[dict], world_size: int) -> str:
    """One line: which rank is behind and where, and what the others wait in."""
    waiting = [a for a in answers if _waits(a)]
    busy = [a for a in answers if not _waits(a)]
    silent = sorted(set(range(world_size)) - {a["rank"] for a in answers})
    parts = []
    if busy and waiting:
        for a in busy:
            if a["step"] is not None:
                since = f"step {a['step']}, {a['since_progress_s']:.0f} s since its last step"
            elif a.get("since_collective_s") is not None:
                since = f"{a['since_collective_s']:.0f} s since its last collective"
            else:
                since = "no collective yet"
            parts.append(f"rank {a['rank']} is behind: in {_at(a['where'])} ({since})")
        parts.append(_waiting(waiting))
    elif waiting:
        groups: dict[tuple, list[dict]] = {}
        for a in waiting:
            groups.setdefault(_what(a), []).append(a)
        if len(groups) == 1:
            parts.append(_waiting(waiting) + " and none completes")
        else:
            ordered = sorted(groups.values(), key=len)
            odd, rest = ordered[0], [a for g in ordered[1:] for a in g]
            if len(odd) == len(ordered[-1]):  # no majority: say each
                parts.append("the ranks wait in different collectives: " + "; ".join(_waiting(g) for g in ordered))
            else:
                parts.append(f"{_waiting(odd)}, a collective the others did not call; {_waiting(rest)}")
    elif busy:
        parts.append(
            "no rank waits in a collective: " + "; ".join(f"rank {a['rank']} in {_at(a['where'])}" for a in busy)
        )
    if silent:
        parts.append(f"{_ranks(silent)} did not answer (dead, or stuck outside Python)")
    return "; ".join(parts)


def _waits(answer: dict) -> bool:
    """In one of ddpkit's collectives, or in a backward (DDP's gradient all-reduce)."""
    return answer["collective"] is not None or any(
        " in backward" in f or "run_backward" in f for f in answer["stack"][-4:]
    )


def _what(answer: dict) -> tuple:
    c = answer["collective"]
    return (c["op"], c["seq"]) if c else ("backward", answer["step"])


def _waiting(group: list[dict]) -> str:
    first = group[0]
    c = first["collective"]
    what = (
        f"{c['op']} #{c['seq']} (at {c['called_at']})"
        if c
        else f"DDP's gradient all-reduce in the backward (step {first['step']}, at {_at(first['where'])})"
    )
    verb = "waits" if len(group) == 1 else "wait"
    return f"{_ranks([a['rank'] for a in group])} {verb} in {what}"


def _ranks(ranks: list[int]) -> str:
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 2:
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))


def _at(where: dict | None) -> str:
    return f"`{where['function']}` at {where['file']}:{where['line']}" if where else "an unknown place"


def _public(entry: dict, now: float) -> dict:
    entry = dict(entry)  # a copy: the main thread may be finishing it
    work = entry.pop("work", None)
    out = {k: v for k, v in entry.items() if k != "started"}
    if "took_s" not in entry or (work is not None and not work.is_completed()):
        out["waited_s"] = round(now - entry["started"], 1)
    return out


def _shown(path: str) -> str:
    """``path`` relative to the working directory when it is below it, else absolute."""
    rel = os.path.relpath(path)
    return os.path.abspath(path) if rel.startswith("..") else rel


def _caller() -> str:
    """file:line of the first frame outside ddpkit.ranks and the standard library (contextlib): the
    code that asked for the collective."""
    frame = sys._getframe(2)
    skip = (os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.__file__))
    while frame is not None and os.path.dirname(os.path.abspath(frame.f_code.co_filename)) in skip:
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{_shown(frame.f_code.co_filename)}:{frame.f_lineno}"


def _user_frame(stack: list) -> dict | None:
    """The innermost frame of the user's own code (not ddpkit, torch or the standard library); else
    the innermost of ddpkit's."""
    stdlib = os.path.dirname(os.__file__)
    ours = None
    for f in reversed(stack):
        path = os.path.abspath(f.filename)
        if path.startswith(_HERE):
            ours = ours or f
            continue
        if "site-packages" in path or path.startswith(stdlib) or f.filename.startswith("<"):
            continue
        return {"function": f.name, "file": _shown(f.filename), "line": f.lineno}
    if ours is not None:
        return {"function": ours.name, "file": _shown(ours.filename), "line": ours.lineno}
    return None


def _flight_recorder() -> Any:
    """torch's Flight Recorder dump for NCCL, where this torch has it and it is on; else None."""
    if not os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE", "").strip("0"):
        return None
    try:
        import pickle

        import torch

        dump = pickle.loads(torch._C._distributed_c10d._dump_nccl_trace())  # private: absent on some builds
        if isinstance(dump, dict) and isinstance(dump.get("entries"), list):
            dump["entries"] = dump["entries"][-20:]  # 2,000 entries with stacks per rank would swamp the store
        return json.loads(json.dumps(dump, default=str))
    except Exception:  # noqa: BLE001 - no NCCL, an older torch: the stack and ddpkit's record remain
        return None


# torch's Flight Recorder for NCCL: a ring of the last collectives per rank, DDP's included, dumped on
# a timeout. Set before the NCCL group is made, only where the user has not set them (stated in
# README, "When it hangs"); the buffer is 2,000 entries of a few hundred bytes each.
FLIGHT_RECORDER = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}


def flight_recorder_defaults(environ=os.environ) -> None:
    for key, value in FLIGHT_RECORDER.items():
        environ.setdefault(key, value)


def flight_recorder_status(environ=os.environ) -> tuple[bool, str]:
    """(whether this torch has the NCCL Flight Recorder, how it is or will be configured)."""
    try:
        import torch

        available = torch.distributed.is_nccl_available() and hasattr(torch._C._distributed_c10d, "_dump_nccl_trace")
    except Exception:  # noqa: BLE001 - a torch without distributed
        available = False
    settings = ", ".join(
        f"{k}={environ.get(k, v)}{'' if k in environ else ' (ddpkit default)'}" for k, v in FLIGHT_RECORDER.items()
    )
    where = environ.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
    return (
        available,
        f"{settings}, dumps to {where or '/tmp/nccl_trace_rank_'}<rank>{'' if where else ' (torch default)'}",
    )


def _temp_report() -> Path:
    return Path(tempfile.gettempdir()) / f"ddpkit-hang-{os.environ.get(env.RUN_ID, os.getpid())}.json"


# One watch per process (one process group per process): DistContext's collectives and the engine
# reach it here; None outside a multi-rank group.
WATCH: HangWatch | None = None


@contextmanager
def watched(op: str, tensor=None) -> Iterator[dict]:
    """Around a collective of DistContext's; put its ``work`` in the entry it gives."""
    watch = WATCH
    if watch is None:
        yield {}
        return
    with watch.collective(op, tensor) as entry:
        yield entry


def progress(step: int, phase: str = "train") -> None:
    if WATCH is not None:
        WATCH.progress(step, phase)


@contextmanager
def busy(what: str, announce: bool = False) -> Iterator[None]:
    """Around ddpkit's own work on this rank between steps that the other ranks wait for (rank 0 writing a
    snapshot or the records): the heartbeat is kept and the waiting is no hang (:meth:`HangWatch.busy_with`)."""
    watch = WATCH
    if watch is None:
        yield
        return
    with watch.busy_with(what, announce):
        yield


def idle() -> None:
    """No step is due for a while (evaluation, the end of training): only collectives are watched."""
    if WATCH is not None:
        WATCH.idle()


def report_to(run_dir: str) -> None:
    """Where rank 0 writes the report: the run directory."""
    if WATCH is not None:
        WATCH.run_dir = run_dir
