"""Replica groups (``ddpkit train --replicas R``): one group's side of torchft's quorum, for the engine's step.

Each group is a launch of its own (one process here, under its own elastic agent: ``ranks/replicas.py``); the
groups meet through torchft's lighthouse, and torchft's ``Manager`` runs each step's quorum, its all-reduces
over the groups present, the commit that only a step whose every all-reduce succeeded passes, and the heal of a
group that is behind (it receives a live group's state and loads it at the step's start). ddpkit adds what
torchft leaves out, the global batch kept whole: the data are read as by ``R`` ranks of one DDP run (group
``g`` takes rank ``g``'s batches, ``epoch_order``), and while a group is gone the groups present compute its
batches too (:func:`shares`), each batch's loss scaled by ``1 / R``, so that the all-reduced SUM is the mean
gradient of the whole global batch, as in an uninterrupted run, to float rounding. A step that does not commit
(a group left in the middle of it) is computed again, over the groups then present, on the same batches: no
sample is dropped and none is used twice.

    place = replica_place(cfg)                  # None unless this process is one group of --replicas
    group = Replicas(place, engine.heal_state, engine.load_heal, timeout_s, log.log)
    computed, measures = group.step(model, at, compute, healed)   # one step's gradient, committed:
    optimizer.step()                            # (the loop's own batches and loss are ``compute(share)``)

(a Loop's step is not a function: its ``loop.steps()`` calls :meth:`Replicas.open` before the body, and its
``loop.shares(loader)`` yields each share's batch from :meth:`Replicas.shares_of`), where a step is, attempt after
attempt until one commits::

    present = group.begin(step)                 # the quorum (a heal loads the state), the groups present
    ...compute(g) for g in shares(present, place.count, place.index): forwards, backwards, each loss / R...
    group.reduce(grads)                         # one SUM all-reduce over the groups present
    group.reduce(buffers, torch.float64)        # share 0's BatchNorm statistics, from the group that computed it
    if group.commit(): break                    # else: the same step again, on the same batches
    group.committed(step, present, attempts, seconds)   # its records: a step redone, the groups present

torchft (the ``ddpkit[ft]`` extra) is imported only when a group starts.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from ..config import TrainConfig
from ..errors import CollectiveTimeout, ConfigError
from ..ranks import env
from ..ranks.context import DistContext
from ..ranks.failures import group_of, public_kind, write_error_file
from ..ranks.replicas import NEEDS_FT, here_key, quorum_key


@dataclass(frozen=True)
class Place:
    """This group's place among the replica groups."""

    index: int  # 0..count-1: which rank's share of each global batch is this group's own
    count: int  # R, the groups of the run (present or not): the global batch is R shares
    lighthouse: str  # torchft's lighthouse (http://HOST:PORT), started by ddpkit's launcher
    store: str  # HOST:PORT of the launcher's store, where the groups meet before their first step


def replica_place(cfg: TrainConfig) -> Place | None:
    """This process's group, when ``cfg`` asks for replica groups and ddpkit's launcher started it as one;
    None for any other run. ``--replicas`` from Python (no launcher) is refused: the groups are launched by
    ``ddpkit train``."""
    if cfg.replicas <= 1:
        return None
    found = env.replica_group()
    if found is None:
        raise ConfigError(
            f"--replicas {cfg.replicas}: replica groups are started by the command line, each under its own agent: "
            f"run `ddpkit train --replicas {cfg.replicas} ...` (from Python, leave replicas at 1)"
        )
    index, lighthouse, store = found
    if index >= cfg.replicas:
        raise ConfigError(f"{env.REPLICA}={index} is not below --replicas {cfg.replicas}: it is ddpkit's own, unset it")
    return Place(index, cfg.replicas, lighthouse, store)


def script_place() -> Place | None:
    """This process's group when ``ddpkit run --replicas R`` started it (a script's ``ddpkit.Loop``); None
    elsewhere."""
    found = env.replica_group()
    if found is None:
        return None
    index, lighthouse, store = found
    return Place(index, env.replica_count(), lighthouse, store)


def data_context(ctx: DistContext, place: Place, index: int) -> DistContext:
    """The context the data are read in for group ``index``: rank ``index`` of ``count``, as one DDP run of
    ``count`` ranks reads them (the epoch order, the augmentation draws), on this group's device."""
    return dataclasses.replace(ctx, rank=index, world_size=place.count)


def shares(present: list[int], count: int, me: int) -> list[int]:
    """The groups whose batches group ``me`` computes at a step where ``present`` (sorted) are present: its own,
    then every missing group's, dealt in turn to the groups present (the k-th missing to the (k mod P)-th
    present). Every group of ``range(count)`` is computed by exactly one present group."""
    missing = [g for g in range(count) if g not in present]
    return [me] + [g for k, g in enumerate(missing) if present[k % len(present)] == me]


class ShareSources:
    """The training data of every share of the global batch, share ``g`` read as rank ``g`` of a DDP run of R
    ranks reads it (:func:`data_context`): a group reads its own share at every step, and a missing group's at a
    step it computes that share too. ``make(data_ctx)``: the recipe's training source in that context."""

    def __init__(self, make: Callable[[DistContext], Any], ctx: DistContext, place: Place, accum: int):
        self.sources = [make(data_context(ctx, place, g)) for g in range(place.count)]
        path = self.sources[0].path
        if path not in ("in-memory", "device-resident", "host-staged"):
            raise ConfigError(
                f"--replicas reads the training data held in memory, and this run's path is {path}"
                f" (an IterableDataset, or data the DataLoader must read): not yet supported with --replicas"
            )
        self.own, self.accum = self.sources[place.index], accum
        self._kept: dict[int, tuple] = {}  # group -> (epoch, next micro-batch, its iterator)

    def batches(self, group: int, epoch: int, step_in_epoch: int) -> list:
        """The ``accum`` micro-batches of ``group``'s share of the step at this position: its iterator kept while
        the steps follow on, made again after a jump (a heal moves a group to another step or epoch)."""
        first = step_in_epoch * self.accum
        kept = self._kept.get(group)
        if kept is None or kept[:2] != (epoch, first):
            kept = (epoch, first, self.sources[group].batches(epoch, first))
        batches = [next(kept[2]) for _ in range(self.accum)]
        self._kept[group] = (epoch, first + self.accum, kept[2])
        return batches


class LoaderShares:
    """A Loop's ``data()`` loaders read a step at a time (``loop.shares``): each loader's pass in progress, read on
    from pass to pass (each pass is the next epoch's order); and, under ``--replicas``, the batch of a group that is
    gone, read as its rank reads it, from a loader of that rank's own (``make(ctx)``, the Loop's recipe for the
    loader, in the context of that rank of R: :func:`data_context`)."""

    def __init__(self, ctx: DistContext, place: Place | None):
        self.ctx, self.place = ctx, place
        self._feeds: dict[int, Iterator] = {}  # loader id -> its pass in progress
        self._makers: dict[int, Callable[[DistContext], Any]] = {}  # loader id -> the loader in another context
        self._others: dict[tuple[int, int], Any] = {}  # (loader id, share) -> that share's loader

    def context(self, share: int | None = None) -> DistContext:
        """The context a loader reads in: this rank's, or under --replicas rank ``share`` (default: this group's)
        of R."""
        if self.place is None:
            return self.ctx
        return data_context(self.ctx, self.place, self.place.index if share is None else share)

    def add(self, loader: Any, make: Callable[[DistContext], Any]) -> None:
        self._makers[id(loader)] = make

    def next(self, loader: Any) -> Any:
        """The next batch of ``loader``'s pass in progress, or of the next pass."""
        for _ in range(2):
            feed = self._feeds.get(id(loader)) or iter(loader)
            try:
                batch = next(feed)
            except StopIteration:
                self._feeds.pop(id(loader), None)
                continue
            self._feeds[id(loader)] = feed
            return batch
        raise ConfigError("loop.shares() got a loader with no batch to give (an empty dataset?)")

    def other(self, loader: Any, share: int, epoch: int, index: int) -> Any:
        """Batch ``index`` of ``epoch`` of share ``share`` (a group that is gone), as its rank reads it. Its
        sampler's order is that rank's; random draws of the dataset's own (``num_workers=0``) come from this
        group's generators, which no rank of a DDP run would use."""
        key = (id(loader), share)
        if key not in self._others:
            self._others[key] = self._makers[id(loader)](self.context(share))
        return self._others[key].batch_at(epoch, index)

    def restart(self) -> None:
        """After a heal moved the loaders' positions: each pass starts again from its loader's position."""
        self.close()

    def close(self) -> None:
        """End the passes in progress now (a generator left for the interpreter's exit is finalised after the
        modules it names are gone: a line of "Exception ignored" for each, the porter's finding)."""
        for feed in self._feeds.values():
            feed.close()
        self._feeds.clear()


class ShareChecks:
    """What a step must do with the batches ``loop.shares()`` gives under ``--replicas``, checked as it runs: a
    backward on each before the next is asked for (the gradient is summed over the groups after the last), and no
    optimizer step while they are given (it would step on this group's own gradient alone). ``refuse(what)``: the
    error to raise."""

    def __init__(self, params: list[torch.Tensor], optimizers: list, refuse: Callable[[str], Exception]):
        self.backwards = 0  # gradients accumulated into a trained parameter, ever
        self.reading = False  # between the first batch and the commit
        self.refuse = refuse
        self.handles = [p.register_post_accumulate_grad_hook(self._count) for p in params]
        self.handles += [opt.register_step_pre_hook(self._no_step) for opt in optimizers]

    def remove(self) -> None:
        """The hooks off the user's parameters and optimizers, which outlive the Loop."""
        for handle in self.handles:
            handle.remove()

    def _count(self, _param: torch.Tensor) -> None:
        self.backwards += 1

    def _no_step(self, _opt, _args, _kwargs) -> None:
        if self.reading:
            raise self.refuse(
                "an optimizer stepped inside 'for batch in loop.shares(loader)': step after that loop ends, where "
                "the step's gradient is summed over the groups"
            )

    def backward_since(self, count: int) -> None:
        """After a batch was given at ``count`` backwards: refuse unless a backward reached a trained parameter."""
        if self.backwards == count:
            raise self.refuse(
                "a batch that loop.shares() gave had no backward before the next was asked for: run each batch's "
                "forward and backward inside the loop (the gradient is summed over the groups after the last)"
            )


# How many times --timeout-s a group waits at a quorum for a group that has not asked for it: that group ends itself
# once the wait has lasted --timeout-s (Replicas._watch), and the lighthouse then forms the quorum without it
QUORUM_WAIT = 2


def _quiet_torchft(manager) -> None:
    """torchft's two lines at each heal, which ddpkit's ``healed`` record says: the serving group's HTTP server
    logs each request (``"GET /checkpoint/11/full HTTP/1.1" 200``; its errors are still logged), and its
    process group calls torch's ``_set_sequence_number_for_group``, which in torch 2.14 (the version ddpkit pins, where
    it was checked) does nothing but warn in C++, once per process (``setSequenceNumberForGroup() is deprecated and
    is now a no-op``): there, in a replica group's process only, it is made a no-op that says nothing. An older torch,
    where it may still do its work, keeps it and its line."""
    from torch.distributed import ProcessGroupGloo
    from torch.torch_version import TorchVersion

    if TorchVersion(torch.__version__) >= "2.14":
        ProcessGroupGloo._set_sequence_number_for_group = lambda self: None
    server = getattr(getattr(manager, "_checkpoint_transport", None), "_server", None)
    if server is not None:  # torchft's HTTPTransport: its handler class is its own, made per transport
        server.RequestHandlerClass.log_request = lambda self, code="-", size="-": None


class Replicas:
    """One group's torchft ``Manager`` (a process group of its own over gloo, its store, the lighthouse's client)
    and the step's protocol; ``state`` and ``load``: the state a healing group receives and how it loads it;
    ``record(event, **fields)``: where a heal, a step computed again and a change of the groups present are said
    (the engine's ``MetricLogger.log``: this group's ``metrics.jsonl`` and, for group 0, the console)."""

    def __init__(
        self,
        place: Place,
        state: Callable[[], dict],
        load: Callable[[dict], None],
        timeout_s: float,
        record: Callable[..., None],
        first: Callable[[], None] = lambda: None,
    ):
        try:
            from torchft import Manager
            from torchft.process_group import ProcessGroupGloo
        except ImportError:
            raise ConfigError(NEEDS_FT) from None
        from torch.distributed import TCPStore

        # torchft logs each failed all-reduce with its traceback (a lost group's every step): ddpkit says it in one
        # record per step computed again, and one per change of the groups present
        logging.getLogger("torchft").setLevel(logging.CRITICAL)
        # a heal's tensors are read from torchft's received bytes, and copied into the model as they load
        warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)
        self.place, self.record = place, record
        self._first = first  # called once, after the attempt's first quorum (a heal included): Session.first_quorum
        # The group's own store (one process: nothing else to meet); torchft keeps its manager's address there
        self._store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        limit = timedelta(seconds=timeout_s)
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=limit),
            min_replica_size=1,
            load_state_dict=load,
            state_dict=_serving(state),
            replica_id=f"ddpkit{place.index}",
            rank=0,
            world_size=1,
            store_addr="127.0.0.1",
            store_port=self._store.port,
            lighthouse_addr=place.lighthouse,
            use_async_quorum=False,  # the quorum (and a heal) before the step's forward, so its batches are known
            init_sync=False,  # every group starts from the same seeded weights (or its own snapshot, healed if behind)
            timeout=limit,
            # A group that lags the others by --timeout-s outside its step ends itself (_watch), and the lighthouse
            # forms the quorum without it a heartbeat timeout (1 s) later: the others wait up to twice as long
            quorum_timeout=QUORUM_WAIT * limit,
            connect_timeout=limit,
        )
        _quiet_torchft(self.manager)
        self.present: list[int] = []  # at the last step that committed
        self.healed = False  # at this step's quorum
        self.timeout_s = timeout_s
        self._own_since: float | None = None  # when this group's own work in a step began (own_work)
        # The step whose quorum this group asks for next (None until set_step: the meeting has its own timeout), and
        # when its attempt began (torchft's heartbeats with it): another group's wait counts from then at the earliest
        self._next: int | None = None
        self._started = time.time()
        self._in_quorum = False  # between asking for a quorum and its forming (a heal included)
        self._closed = False  # the group is done or failing: its watch ends nothing any more
        self._main = threading.main_thread()
        self._meeting = self._open_meeting()  # the launcher's store: the main thread's client
        self._meet(timeout_s)
        threading.Thread(target=self._watch, name="ddpkit-replica-watch", daemon=True).start()

    def _open_meeting(self):
        """A client of the launcher's store (where the groups meet, and say which quorum each asked for last)."""
        from torch.distributed import TCPStore

        host, _, port = self.place.store.rpartition(":")
        return TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=self.timeout_s))

    def _meet(self, timeout_s: float) -> None:
        """Say this group is here, and wait until every group is (or ``timeout_s`` has passed) before the first
        step, so that the groups start their first quorum together instead of the first up training alone and the
        others healing from it (a copy of the whole state each). Every attempt says it: a group whose first attempt
        failed before it got here is awaited by the others until its restart does. A group restarted once training
        has begun finds every group here already, and joins at once."""
        store = self._meeting
        self._say("starting", -1)  # an earlier attempt's word ("asked", its last) is not this attempt's
        store.set(here_key(self.place.index), str(env.restart_count()))
        try:
            store.wait([here_key(g) for g in range(self.place.count)])
        except Exception:  # noqa: BLE001 - a group slow to start, or failed: the others go on, and it heals or is said
            self.record("replicas", change="started", step=0, waited_s=timeout_s, note="not every group came")

    def set_step(self, step: int) -> None:
        """After a resume from this group's own snapshot: torchft's step count is the run's."""
        self.manager.load_state_dict({"step": step, "batches_committed": step * self.place.count})
        self._next = step  # from here a lag counts, start-up included (an evaluation of a cut-short epoch, say)

    def begin(self, step: int) -> list[int] | None:
        """The quorum of the step at ``step`` (a group behind the others heals here, loading a live group's state),
        then which groups are present: one all-reduce of a vector with this group's place set. None where that
        failed (a group left): the step cannot commit, and :meth:`commit` says so."""
        t0 = time.perf_counter()
        # Said before asking and once formed: a group that has not asked for a quorum at which another has waited
        # --timeout-s ends itself (_watch). Two store writes a step, beside torchft's own quorum call to the lighthouse
        self._in_quorum, self._next = True, step
        try:
            self._say("asked", step)
            self.manager.start_quorum()
            at = self.manager.current_step()  # a heal's step: where this group now is
            self._next = at + 1  # (a step that does not commit asks for the same quorum again, as every group does)
            self._say("formed", at)
        except TimeoutError:  # torchft's, from its Rust client: one line instead of its traceback
            raise CollectiveTimeout(
                f"the quorum of step {step} did not form within {QUORUM_WAIT} x --timeout-s "
                f"({QUORUM_WAIT * self.timeout_s:g} s): a group whose heartbeats go on has not asked for it "
                f"({self._where_others_are(step)}); rerun the same command to resume"
            ) from None
        finally:
            self._in_quorum = False
        self.healed = self._next != step + 1
        if self.healed:
            self.record(
                "replicas",
                change="healed",
                step=self.manager.current_step(),
                group=self.place.index,
                behind=self.manager.current_step() - step,
                seconds=round(time.perf_counter() - t0, 4),
                streams="reseeded",  # its random streams (dropout): from (seed, step, group), as at another world size
            )
        flags = torch.zeros(self.place.count, dtype=torch.float64)  # on the host: the shares are the host's to deal
        flags[self.place.index] = 1.0
        self.manager.allreduce(flags, reduce_op=_sum()).wait()
        if self.manager.errored() is not None:
            return None
        return [g for g, v in enumerate(flags.tolist()) if v > 0.5]

    @contextmanager
    def own_work(self) -> Iterator[None]:
        """This group's own part of a step (its batches, forwards and backwards: nothing that waits on another
        group), watched: stuck there for --timeout-s, the group ends itself (:meth:`_watch`)."""
        self._own_since = time.monotonic()
        try:
            yield
        finally:
            self._own_since = None

    def _watch(self) -> None:
        """A group stuck in its own code keeps its heartbeats going (torchft sends them from a thread of its own),
        so the lighthouse would wait for it for ever: with two groups the other may not form a quorum alone while
        it lives. So a group ends (a line says where) when its own part of a step has made no progress for
        --timeout-s, or, outside its steps (an evaluation, a snapshot, a log interval), when another group has
        waited --timeout-s at a quorum this one has not asked for: a lag a DDP run's collectives would not have
        waited out either. The others go on without it; its agent restarts it under --max-restarts, and it heals."""
        try:
            store = self._open_meeting()  # its own client: the main thread's is busy at each step
        except Exception:  # noqa: BLE001 - the launcher's store gone: the watch of its own work goes on
            store = None
        while not self._closed:
            time.sleep(min(1.0, self.timeout_s / 10))
            since = self._own_since
            if self._closed:
                return
            if since is not None and time.monotonic() - since >= self.timeout_s:
                self._end(f"no progress in its own part of a step for --timeout-s {self.timeout_s:g} s")
            waiting = self._waited_for(store) if since is None and store is not None else None
            if waiting is not None:
                g, at = waiting
                self._end(
                    f"outside its step, it has not asked for the quorum of step {at}, at which replica group {g} has "
                    f"waited --timeout-s {self.timeout_s:g} s"
                )

    def _waited_for(self, store) -> tuple[int, int] | None:
        """(a group, the step) where another group has waited --timeout-s or longer (counted from this group's start at
        the earliest) at the quorum this group asks for next, or a later one, while this group is outside its steps'
        quorums; None otherwise."""
        next_step, mine = self._next, time.time() - self._started
        if self._in_quorum or next_step is None:
            return None
        late = [
            (g, at)
            for g, word, at, since in self._words(store)
            if word == "asked" and at >= next_step and min(since, mine) >= self.timeout_s
        ]
        return late[0] if late else None

    def said_by_group_0(self, text: str, wait_s: float = 10.0) -> bool:
        """An error of the script's own (a misuse every group may meet at the same step): group 0 notes it in the
        launcher's store and says it (False); another group waits up to ``wait_s`` for group 0's note and is quiet
        (True) only where group 0 met the same one."""
        key = "ddpkit/replicas/said"
        try:
            if self.place.index == 0:
                self._meeting.set(key, text)
                return False
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline:
                if self._meeting.check([key]):
                    return self._meeting.get(key).decode() == text
                time.sleep(0.05)
        except Exception:  # noqa: BLE001 - the launcher's store gone: said here, as if alone
            pass
        return False

    def _say(self, word: str, step: int) -> None:
        """Where this group is with the quorums (``quorum_key``), in the launcher's store."""
        self._meeting.set(quorum_key(self.place.index), f"{word} {step} {time.time():.3f}")

    def _words(self, store) -> list[tuple[int, str, int, float]]:
        """What each other group last said of the quorums (``quorum_key``): (the group, its word, the step, the
        seconds since), read in the launcher's store through ``store`` (a client of the calling thread's). A key is
        never deleted, so a ``check`` then a ``get`` cannot wait. [] where the store cannot answer (its launcher
        gone): no one to name, and the quorum's own timeout stands."""
        found, now = [], time.time()
        try:
            for g in range(self.place.count):
                if g != self.place.index and store.check([quorum_key(g)]):
                    word, at, t = store.get(quorum_key(g)).decode().split(" ")
                    found.append((g, word, int(at), now - float(t)))
        except Exception:  # noqa: BLE001 - see the docstring
            return []
        return found

    def _where_others_are(self, step: int) -> str:
        """For a quorum of ``step`` that did not form: each other group that is not asking for it, and where it is."""
        said = {
            "asked": lambda at, s: f"asked for step {at}'s quorum {s:.0f} s ago",
            "formed": lambda at, s: f"outside its step since step {at}'s quorum formed, {s:.0f} s ago",
            "starting": lambda at, s: f"starting again, for {s:.0f} s",
            "done": lambda at, s: "finished the run",
        }
        others = [
            f"replica group {g} {said.get(word, lambda at, s: word)(at, since)}"
            for g, word, at, since in self._words(self._meeting)
            if not (word == "asked" and at == step)
        ]
        return "; ".join(others) or "no other group has said where it is"

    def _end(self, why: str) -> None:
        """End this group from its watch thread (its main thread is stuck: no way out through Python): ``why``,
        where the main thread is, and that the others go on, said once, by its agent (under one) or here."""
        frame = sys._current_frames().get(self._main.ident)
        where = traceback.extract_stack(frame)[-1] if frame is not None else None
        at = f" (in `{where.name}` at {Path(where.filename).name}:{where.lineno})" if where else ""
        exc = CollectiveTimeout(f"{why}{at}: it ends, so that the other groups train on without it")
        if os.environ.get(env.ERROR_FILE):  # its agent says it, and that it restarts the group
            write_error_file(str(exc), False, exc.exit_code, kind=public_kind(exc), text=str(exc), printed=False)
        else:
            print(f"ddpkit: {group_of()}error: {exc}", file=sys.stderr, flush=True)
        os._exit(exc.exit_code)

    def open(self, modules: list[torch.nn.Module], at: Callable[[], int], healed: Callable[[], None]) -> None:
        """The start of an optimizer step: its first quorum (a group that is behind heals there, and the state it
        loads is the step's; then ``healed()``). ``at()``: the step the run is at (a heal moves it). A Loop opens
        the step before its body runs (``loop.steps()``), so that the body reads the healed step; the shares then
        come from :meth:`shares_of`."""
        # The trained parameters: a frozen one gets no gradient, so no weight decay or momentum, as under DDP
        self._params = [p for m in modules for p in m.parameters() if p.requires_grad]
        self._buffers = [b for m in modules for b in m.buffers()]
        # the step's buffers: an attempt that did not commit moved them
        self._start = [b.detach().clone() for b in self._buffers]
        self._attempts, self._t0 = 0, time.perf_counter()
        self._attempt(at, healed)

    def _attempt(self, at: Callable[[], int], healed: Callable[[], None]) -> None:
        """One attempt's quorum, and which groups are present at it."""
        self._attempts += 1
        # The step's buffers back before the quorum, where this group may serve a heal: an attempt that did not
        # commit left another group's share 0 statistics, or zeros, in them
        for b, s0 in zip(self._buffers, self._start):
            b.copy_(s0)
        self._present = self.begin(at())
        if self.healed:  # the step's state is a live group's, just loaded
            self._start = [b.detach().clone() for b in self._buffers]
            healed()
        first, self._first = self._first, lambda: None
        first()

    def shares_of(
        self,
        at: Callable[[], int],
        healed: Callable[[], None],
        restart: Callable[[], None] = lambda: None,
        grad_scale: float = 1.0,
    ) -> Iterator[int]:
        """After :meth:`open`: each share this group computes at this attempt, its own first (the caller runs that
        share's forwards and backwards, its gradients added to the step's); once they are done, the gradient summed
        over the groups present, and again, on the same shares' batches over the groups then present, until every
        group's all-reduce succeeded (``restart()`` at each attempt's start: what the caller measured of an attempt
        that did not commit is dropped). ``grad_scale``: each gradient's factor before the all-reduce (``1 / R``
        where each share's loss is its own batch's mean, as DDP divides by its world size; 1 where the caller scaled
        its losses). Then :attr:`computed` is the committed attempt's shares (a step computed again counts once)."""
        params, buffers = self._params, self._buffers
        while True:
            restart()
            computed = [] if self._present is None else shares(self._present, self.place.count, self.place.index)
            for p in params:  # this attempt's gradients only (set_to_none would leave None to the all-reduce below)
                if p.grad is not None:
                    p.grad.zero_()
            kept = None
            if self._present is not None:
                with self.own_work():  # stuck here for --timeout-s, this group ends and the others go on
                    for g in computed:
                        if g == 0:  # share 0's forwards from the step's buffers, as rank 0's are in a DDP run
                            for b, s0 in zip(buffers, self._start):
                                b.copy_(s0)
                        yield g
                        if g == 0:
                            kept = [b.detach().clone() for b in buffers]
                for p in params:  # every group all-reduces every trained parameter's gradient
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    elif grad_scale != 1.0:
                        p.grad.mul_(grad_scale)
                self.reduce([p.grad for p in params])
                # The buffers (BatchNorm's running statistics) after share 0's forwards, as DDP keeps rank 0's: given
                # by the group that computed share 0, zeros by the others; in float64, where an int64 count is exact
                for b, given in zip(buffers, kept or [torch.zeros_like(b) for b in buffers]):
                    b.copy_(given)
                self.reduce(buffers, torch.float64)
            if self.commit():
                break
            self._attempt(at, healed)
        self.computed = computed
        self.committed(at(), self._present, self._attempts, time.perf_counter() - self._t0)

    def step(
        self,
        model: torch.nn.Module,
        at: Callable[[], int],
        compute: Callable[[int], list],
        healed: Callable[[], None],
    ) -> tuple[list[int], list]:
        """One optimizer step's gradient over the groups, up to (not including) ``optimizer.step()``
        (:meth:`open`, then :meth:`shares_of`), for a loop whose step is a function: ``compute(share)`` runs a
        share's micro-batches' forwards and backwards, each loss scaled by 1/R, and returns what they measured.
        Returns the shares the committed attempt computed and its measures. The loop's own part is the batches and
        the loss; this is the protocol, whoever's loop it is."""
        measures: list = []
        self.open([model], at, healed)
        for g in self.shares_of(at, healed, restart=measures.clear):
            measures += compute(g)
        return self.computed, measures

    def reduce(self, tensors: list[torch.Tensor], dtype: torch.dtype | None = None) -> None:
        """The SUM of every group's ``tensors`` over the groups present, in place: one all-reduce of their
        concatenation (in ``dtype``, else their own). The gradients: each group has scaled its losses by 1/R, so
        the sum is the global batch's mean gradient. The buffers: one group gives them, the others zeros."""
        if not tensors:
            return
        flat = torch.cat([t.reshape(-1).to(dtype or t.dtype) for t in tensors])
        self.manager.allreduce(flat, reduce_op=_sum()).wait()
        offset = 0
        for t in tensors:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()

    def commit(self) -> bool:
        """Whether the step's every all-reduce succeeded in every group present (torchft's ``should_commit``):
        only then may the optimizer step."""
        return self.manager.should_commit()

    def committed(self, step: int, present: list[int], attempts: int, seconds: float) -> None:
        """The records of a step that committed: computed again after a group left during it (``redone``, with the
        seconds from its first attempt to its commit), and the groups present when they changed (``groups``)."""
        if attempts > 1:
            self.record("replicas", change="redone", step=step, attempts=attempts, seconds=round(seconds, 4))
        if present != self.present:
            if self.present or len(present) < self.place.count:  # a change, or groups missing from the start
                before = self.present or list(range(self.place.count))  # (a group restarted alone: all were there)
                gone, back = sorted(set(before) - set(present)), sorted(set(present) - set(before))
                self.record(
                    "replicas",
                    change="groups",
                    step=step,
                    present=_listed(present),
                    gone=_listed(gone) or None,
                    back=_listed(back) or None,
                )
            self.present = present

    def close(self) -> None:
        """The end of this group, done or failing: its watch stops (an error being said is not overwritten by its
        line), and the others read that it waits for no one."""
        self._closed = True
        try:
            self._say("done", -1)
        except Exception:  # noqa: BLE001 - the launcher's store gone with it: nobody left to read it
            pass
        self.manager.shutdown(wait=False)


class SampleLog:
    """``--sample-log``: RUN_DIR/samples.jsonl, one line for each share of each committed step this group computed,
    ``{"epoch", "step", "share", "samples"}``: the share's sample indices (rank ``share``'s of a run of R ranks),
    in the order its micro-batches take them. Read across the groups' run dirs, each step's every share appears,
    and each epoch's every sample once. A step computed again after a resume (the whole job rerun) appears again,
    with the same samples; a group killed between a step's commit and its line leaves that line out."""

    def __init__(self, run_dir: str | Path, sources: list, accum: int):
        self.sources, self.accum = sources, accum
        self.orders: dict[tuple[int, int], list[int]] = {}  # (share, epoch) -> its epoch's indices
        self.file = open(Path(run_dir) / "samples.jsonl", "a", buffering=1)  # a line a write: none half-kept

    def write(self, epoch: int, step_in_epoch: int, step: int, computed: list[int]) -> None:
        for g in computed:
            if (g, epoch) not in self.orders:
                self.orders = {k: v for k, v in self.orders.items() if k[1] == epoch}  # the epoch's only
                self.orders[g, epoch] = self.sources[g].epoch_indices(epoch).tolist()
            n = self.sources[g].batch * self.accum  # a step's samples of one share
            samples = self.orders[g, epoch][step_in_epoch * n : (step_in_epoch + 1) * n]
            self.file.write(json.dumps({"epoch": epoch, "step": step, "share": g, "samples": samples}) + "\n")

    def close(self) -> None:
        self.file.close()


# A test hook, for the test that kills the group serving a heal while it serves (tests/system/test_replicas.py), as
# run/checkpoint.py's DDPKIT_TEST_KILL_WRITE: DDPKIT_TEST_KILL_SERVING=FOLDER SIGKILLs the first group to serve a
# heal (FOLDER has no file "served" yet: it writes one first), once it has made the state it sends and before the
# healing group has read it.
_KILL_SERVING_ENV = "DDPKIT_TEST_KILL_SERVING"


def _serving(state: Callable[[], dict]) -> Callable[[], dict]:
    folder = os.environ.get(_KILL_SERVING_ENV)
    if not folder:
        return state

    def serve() -> dict:
        made = state()
        mark = Path(folder) / "served"
        if not mark.exists():
            mark.write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
        return made

    return serve


def _listed(groups: list[int]) -> str:
    """Groups as a record and the console show them: "0,2"."""
    return ",".join(str(g) for g in groups)


def _sum() -> Any:
    from torch.distributed import ReduceOp

    return ReduceOp.SUM
