"""--replicas, the parts that need no launch: how a step's shares are dealt over the groups present, and what the
option is refused with (tests/system/test_replicas.py trains replica groups under torchft)."""

from __future__ import annotations

import itertools

import pytest

from ddpkit.config import TrainConfig
from ddpkit.errors import ConfigError
from ddpkit.ranks import env
from ddpkit.ranks.replicas import core_shares, gpu_shares
from ddpkit.train.replicas import replica_place, shares


@pytest.mark.parametrize("count", [1, 2, 3, 5])
def test_every_share_of_a_step_is_computed_once_whichever_groups_are_present(count):
    for size in range(1, count + 1):
        for present in itertools.combinations(range(count), size):
            dealt = [shares(list(present), count, g) for g in present]
            computed = sorted(g for mine in dealt for g in mine)
            assert computed == list(range(count)), (present, dealt)  # each group's share once: none lost, none twice
            assert all(mine[0] == g for mine, g in zip(dealt, present))  # a group's own share first
            # the missing groups' shares spread: no group computes more than one more than another
            sizes = [len(mine) for mine in dealt]
            assert max(sizes) - min(sizes) <= 1, (present, dealt)


@pytest.mark.parametrize(
    "option, named",
    [
        ({"nproc": "2"}, "--nproc 2"),
        ({"nnodes": 2}, "--nnodes 2"),
        ({"strategy": "fsdp2"}, "--strategy fsdp2"),
        ({"join": True}, "--join"),
        ({"data_path": "loader"}, "--data-path loader"),
        ({"compile": True}, "--compile"),
    ],
)
def test_what_replica_groups_cannot_be_combined_with_yet_is_refused_naming_it(option, named):
    with pytest.raises(ConfigError, match=f"--replicas 2 cannot be combined with {named}"):
        TrainConfig(dataset="mnist", replicas=2, **option).resolved()


def test_a_batch_the_groups_cannot_share_equally_is_refused_with_the_sizes_that_can():
    TrainConfig(dataset="mnist", replicas=3, batch_size=48, grad_accum=2).resolved()  # 16 a group, 8 a micro-batch
    with pytest.raises(ConfigError, match=r"--batch-size 50 \(global\) is not divisible by --replicas 3.* 48 or 51"):
        TrainConfig(dataset="mnist", replicas=3, batch_size=50).resolved()
    with pytest.raises(ConfigError, match="--grad-accum 3 does not divide a replica group's share of the batch, 16"):
        TrainConfig(dataset="mnist", replicas=3, batch_size=48, grad_accum=3).resolved()


def test_a_sample_log_without_replica_groups_is_refused_saying_what_it_needs():
    with pytest.raises(ConfigError, match=r"--sample-log .* needs --replicas R > 1"):
        TrainConfig(dataset="mnist", sample_log=True).resolved()


def test_replicas_below_one_is_refused():
    with pytest.raises(ConfigError, match="--replicas must be >= 1"):
        TrainConfig(dataset="mnist", replicas=0).resolved()


def test_replicas_from_python_without_the_launcher_is_refused_with_the_command_to_run(monkeypatch):
    monkeypatch.delenv(env.REPLICA, raising=False)
    assert replica_place(TrainConfig()) is None  # 1: no groups, nothing asked
    with pytest.raises(ConfigError, match="run `ddpkit train --replicas 3"):
        replica_place(TrainConfig(replicas=3))


def test_the_run_dir_of_a_replicas_run_is_named_apart_and_older_names_stay():
    # A run dir named by the config's hash: --replicas changes the data's layout (R shares of each global batch),
    # so its run is another; at 1 it is left out of the hash, and run dirs named before it existed keep their names
    assert TrainConfig(replicas=2).hash() != TrainConfig().hash()
    assert TrainConfig(replicas=1).hash() == TrainConfig().hash()


def test_each_group_gets_its_own_cores_and_gpu_dealt_in_turn_where_there_are_fewer():
    assert core_shares([0, 1, 2, 3], 2) == [[0, 1], [2, 3]]
    assert core_shares([0, 1], 3) == [[0], [1], [0]]
    assert gpu_shares(2, None, 4) == ["0", "1"]  # each group's cuda:0 is another GPU
    assert gpu_shares(3, "5, 7", 8) == ["5", "7", "5"]  # within the launcher's CUDA_VISIBLE_DEVICES
    assert gpu_shares(2, None, 0) == [None, None]  # a CPU node: left as it is


def _group(index: int, timeout_s: float, manager=None):
    """Replica group ``index`` of 3 with its torchft side replaced (no lighthouse), and a real store for the meeting:
    the launcher's, where the groups say where each is with the quorums."""
    from torch.distributed import TCPStore

    from ddpkit.train.replicas import Place, Replicas

    group = object.__new__(Replicas)
    group.place, group.timeout_s, group.manager = Place(index, 3, "", ""), timeout_s, manager
    group._meeting = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    group._next, group._in_quorum, group._closed, group._started = None, False, False, 0.0
    return group


def _said(store, group: int, word: str, step: int, ago_s: float) -> None:
    import time

    from ddpkit.ranks.replicas import quorum_key

    store.set(quorum_key(group), f"{word} {step} {time.time() - ago_s:.3f}")


def test_a_quorum_that_does_not_form_is_one_line_naming_the_step_and_where_the_others_are():
    from ddpkit.errors import CollectiveTimeout
    from ddpkit.ranks.replicas import quorum_key

    class Stuck:  # torchft's Manager whose quorum timed out: its Rust client raises TimeoutError
        def start_quorum(self):
            raise TimeoutError('status: Cancelled, message: "Timeout expired"')

    group = _group(1, 8.0, Stuck())
    _said(group._meeting, 0, "formed", 11, 30)  # group 0: its quorum of step 11 formed 30 s ago, none asked since
    _said(group._meeting, 2, "starting", -1, 4)
    with pytest.raises(CollectiveTimeout) as said:
        group.begin(12)
    assert str(said.value).startswith("the quorum of step 12 did not form within 2 x --timeout-s (16 s)"), said.value
    assert (
        "(replica group 0 outside its step since step 11's quorum formed, 30 s ago; replica group 2 starting "
        in str(said.value)
    ), said.value
    assert group._meeting.get(quorum_key(1)).decode().startswith("asked 12 ") and not group._in_quorum


def test_a_group_outside_its_step_ends_once_another_has_waited_the_timeout_for_a_quorum_it_has_not_asked_for():
    group = _group(1, 8.0)
    store = group._meeting
    assert group._waited_for(store) is None  # still at the meeting, which has its own timeout
    group._next = 32  # its quorum of step 31 formed
    _said(store, 0, "asked", 32, 3)
    assert group._waited_for(store) is None  # group 0 has waited 3 s: a lag a DDP run waits out too
    _said(store, 0, "asked", 31, 60)
    assert group._waited_for(store) is None  # behind this group: it waits for no one here
    _said(store, 0, "formed", 32, 60)
    assert group._waited_for(store) is None  # ahead, but its quorum formed (R >= 3: the others went on)
    _said(store, 0, "starting", -1, 60)
    assert group._waited_for(store) is None  # restarting: its last attempt's word is gone
    _said(store, 2, "asked", 32, 9)
    assert group._waited_for(store) == (2, 32)
    group._in_quorum = True
    assert group._waited_for(store) is None  # asking itself (a heal that takes long included)
    group._in_quorum = False
    ended = _group(2, 8.0, type("Done", (), {"shutdown": lambda self, wait: None})())
    ended._meeting = store
    ended.close()  # group 2 has finished the run: it waits for no one
    assert group._waited_for(store) is None


def test_a_group_stuck_in_its_start_up_ends_once_another_has_waited_the_timeout_since_it_started():
    """A review found a restarted group stuck before its first quorum (its heartbeats on from its Manager's start, an
    evaluation of a cut-short epoch, say) never ended. The others' wait counts from its start at the earliest: they
    went on without it while it was gone, and began to wait for it only once its heartbeats came."""
    import time

    class Fresh:  # torchft's Manager, as set_step finds it
        def load_state_dict(self, state):
            pass

    group = _group(1, 8.0, Fresh())
    group.set_step(40)
    _said(group._meeting, 0, "asked", 40, 60)  # group 0 asked for step 40's quorum a minute ago
    group._started = time.time() - 3
    assert group._waited_for(group._meeting) is None  # it started 3 s ago: group 0 has waited for it 3 s
    group._started = time.time() - 9
    assert group._waited_for(group._meeting) == (0, 40)
