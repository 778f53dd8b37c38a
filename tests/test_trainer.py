"""The Python API with the user's own model, at world size 2."""

import torch

from ddpkit import TrainConfig, Trainer
from ddpkit.models import ConvNet


def test_each_rank_trains_its_own_copy_of_a_passed_model(tmp_path):
    """Regression: spawned workers got the model's tensors in shared memory, so both ranks
    stepped the same storage (BN counted ~1.5 forwards per step, and runs were not repeatable)."""
    torch.manual_seed(0)
    cfg = TrainConfig(dataset="mnist", limit_train=800, limit_test=200, batch_size=100, lr=0.05, epochs=1,
                      progress=False, device="cpu", nproc="2", run_dir=str(tmp_path / "run"))
    summary = Trainer(cfg, model=ConvNet()).fit()
    state = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    assert summary["steps"] == 8 and summary["world_size"] == 2
    assert state["layer1.1.num_batches_tracked"].item() == 8
    assert state["layer2.1.num_batches_tracked"].item() == 8


def test_a_model_on_a_gpu_is_moved_to_the_cpu_before_workers_are_spawned():
    """Spawned workers would rebuild CUDA tensors on the parent's GPU 0 via CUDA IPC."""
    from ddpkit.trainer import move_to_cpu

    class OnGPU(torch.nn.Module):  # reports a CUDA parameter; records where it is moved
        def __init__(self):
            super().__init__()
            self.moves = []
            self.fake = torch.nn.Parameter(torch.zeros(1))

        def parameters(self, recurse=True):
            yield type("P", (), {"device": torch.device("cuda", 3)})()

        def to(self, *args, **kwargs):
            self.moves.append(args)
            return self

    model = OnGPU()
    assert move_to_cpu(model) == torch.device("cuda", 3) and model.moves == [("cpu",)]
    assert move_to_cpu(ConvNet()) is None
