"""--nproc resolution and the CPU thread budget."""

import pytest
import torch

from ddpkit import dist, launch
from ddpkit.errors import ConfigError


def test_auto_is_one_process_on_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert launch.resolve_nproc("auto", "auto") == 1
    assert launch.resolve_nproc("3", "cpu") == 3


def test_more_processes_than_gpus_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert launch.resolve_nproc("auto", "auto") == 2
    with pytest.raises(ConfigError, match=r"--nproc 4 asks for more processes than the 2 visible GPU\(s\)"):
        launch.resolve_nproc("4", "cuda")


def test_threads_never_oversubscribe(monkeypatch):
    monkeypatch.setattr(dist, "cpu_cores", lambda: 2)
    assert [dist.cpu_threads(n) for n in (1, 2, 3)] == [2, 1, 1]


def test_under_torchrun_nothing_is_relaunched(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert launch.resolve_nproc("auto", "cpu") == 2 and launch.world_size(2) == 4
    assert launch.launch(lambda x: x + 1, (1,), nproc=2) == 2  # ran here, in this process
