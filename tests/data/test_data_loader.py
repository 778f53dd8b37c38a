"""Sharding semantics, path equivalence and batched augmentation (all on CPU tensors)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DistributedSampler

from ddpkit.data import ImageData, Meta
from ddpkit.data.augment import crop_flip, epoch_params
from ddpkit.data.loader import LoaderSource, ResidentSource, epoch_order
from ddpkit.dist.context import DistContext

META = Meta(3, 8, 8, 10, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25), "crop-flip")


def ctx(rank=0, world=1):
    return DistContext(rank, rank, world, world, torch.device("cpu"), "gloo")


def cfg(**kw):
    return SimpleNamespace(**{**dict(seed=3, channels_last=False, num_workers=0), **kw})


def data(n=103):
    gen = torch.Generator().manual_seed(0)
    return ImageData(torch.randint(0, 256, (n, 3, 8, 8), dtype=torch.uint8, generator=gen), torch.arange(n) % 10)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_index_at_most_once_per_epoch(world):
    n = 103
    for epoch in range(3):
        shards = [epoch_order(n, world, r, seed=5, epoch=epoch) for r in range(world)]
        seen = torch.cat(shards)
        assert len(seen) == (n // world) * world and len(set(seen.tolist())) == len(seen)
        assert {len(s) for s in shards} == {n // world}  # equal work on every rank


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_order_is_torch_distributed_sampler(world):
    ds = list(range(103))
    for rank in range(world):
        sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=5, drop_last=True)
        for epoch in (0, 1):
            sampler.set_epoch(epoch)
            assert epoch_order(103, world, rank, 5, epoch).tolist() == list(sampler)


def test_new_order_each_epoch():
    assert epoch_order(100, 2, 0, 0, 0).tolist() != epoch_order(100, 2, 0, 0, 1).tolist()


@pytest.mark.parametrize("world,rank", [(1, 0), (2, 1), (3, 2)])
def test_resident_and_dataloader_paths_give_identical_batches(world, rank):
    d = data()
    resident = ResidentSource(d, META, cfg(), ctx(rank, world), per_rank_batch=8, on_device=True)
    loader = LoaderSource(d, META, cfg(), ctx(rank, world), per_rank_batch=8)
    assert resident.steps_per_epoch == loader.steps_per_epoch == (103 // world) // 8
    for epoch in (0, 1):
        pairs = list(zip(resident.batches(epoch), loader.batches(epoch)))
        assert len(pairs) == resident.steps_per_epoch
        for (xa, ya), (xb, yb) in pairs:
            assert torch.equal(ya, yb) and torch.equal(xa, xb)


def test_mid_epoch_start_matches_the_uninterrupted_tail():
    src = ResidentSource(data(), META, cfg(), ctx(), per_rank_batch=8, on_device=True)
    full = list(src.batches(2))
    tail = list(src.batches(2, start_step=5))
    assert len(tail) == len(full) - 5
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(full[5:], tail))


def test_each_sample_gets_its_own_crop_and_flip():
    offsets, flips = epoch_params(256, seed=0, epoch=0, augment="crop-flip")
    assert len(set(map(tuple, offsets.tolist()))) > 40  # 81 possible offsets
    assert 0.3 < flips.float().mean() < 0.7
    x = torch.full((256, 1, 8, 8), 7, dtype=torch.uint8)
    x[:, :, 0, 0] = 200
    out = crop_flip(x, offsets, flips, pad=4)
    assert len({tuple(o.flatten().tolist()) for o in out}) > 40  # different samples, different views
    next_epoch = epoch_params(256, seed=0, epoch=1, augment="crop-flip")[0]
    assert not torch.equal(offsets, next_epoch)


def test_a_samples_augmentation_is_the_same_whatever_the_world_size():
    """Regression: draws came from (seed, epoch, rank) by position, so 2 ranks augmented each sample
    differently from 1 rank, and `ddpkit check` failed every augmented dataset."""
    images = torch.arange(64, dtype=torch.uint8).view(64, 1, 1, 1).expand(64, 3, 8, 8).contiguous()
    data = ImageData(images, torch.arange(64))
    seen = {}
    for world in (1, 2):
        for rank in range(world):
            src = ResidentSource(data, META, cfg(), ctx(rank, world), per_rank_batch=32 // world, on_device=True)
            for x, y in src.batches(0):
                for img, label in zip(x, y):
                    seen.setdefault(int(label), []).append(img)
    assert len(seen) == 64 and all(len(v) == 2 and torch.equal(v[0], v[1]) for v in seen.values())


def test_crop_and_flip_on_a_hand_built_image():
    img = torch.arange(16, dtype=torch.uint8).view(1, 1, 4, 4) + 1  # values 1..16, no zeros
    # offset (pad, pad) is the identity crop; (0, 0) shifts the image down-right by pad
    same = crop_flip(img, torch.tensor([[1, 1]]), torch.tensor([False]), pad=1)
    assert torch.equal(same, img)
    shifted = crop_flip(img, torch.tensor([[0, 0]]), torch.tensor([False]), pad=1)
    assert shifted[0, 0, 0].tolist() == [0, 0, 0, 0] and shifted[0, 0, :, 0].tolist() == [0, 0, 0, 0]
    assert torch.equal(shifted[0, 0, 1:, 1:], img[0, 0, :3, :3])
    flipped = crop_flip(img, torch.tensor([[1, 1]]), torch.tensor([True]), pad=1)
    assert torch.equal(flipped, img.flip(3))
    both = crop_flip(img, torch.tensor([[2, 0]]), torch.tensor([True]), pad=1)  # up one row, then mirror
    expected = torch.nn.functional.pad(img, (1, 1, 1, 1))[0, 0, 2:6, 0:4].flip(1)
    assert torch.equal(both[0, 0], expected)


def test_normalisation_values():
    from ddpkit.data.augment import Normalize

    norm = Normalize((0.5,), (0.25,), torch.device("cpu"))
    out = norm(torch.tensor([0, 255, 128], dtype=torch.uint8).view(1, 1, 1, 3))
    assert torch.allclose(out.flatten(), torch.tensor([-2.0, 2.0, (128 / 255 - 0.5) / 0.25]), atol=1e-5)


def test_the_host_staged_path_gives_the_device_paths_batches_from_two_reused_buffers():
    d = data()
    images_ptr = d.images.data_ptr()
    device = ResidentSource(d, META, cfg(), ctx(1, 2), per_rank_batch=8, on_device=True)
    host = ResidentSource(d, META, cfg(), ctx(1, 2), per_rank_batch=8, on_device=False)
    assert host.path == "host-staged" and device.path == "device-resident"
    assert host.images.data_ptr() == images_ptr  # the train set is neither copied nor pinned
    buffers = [b.data_ptr() for pair in host.stager.buffers for b in pair]
    for epoch, start in ((0, 0), (1, 3)):
        pairs = list(zip(device.batches(epoch, start), host.batches(epoch, start)))
        assert len(pairs) == device.steps_per_epoch - start
        for (xa, ya), (xb, yb) in pairs:
            assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert [b.data_ptr() for pair in host.stager.buffers for b in pair] == buffers


@pytest.mark.parametrize("world,rank", [(1, 0), (2, 1), (3, 2)])
def test_a_user_dataset_held_in_memory_gives_the_dataloader_paths_batches(world, rank):
    """TensorSource (indexing tensors) against the DataLoader + DistributedSampler path, on a TensorDataset
    and on a user's own dataset read into memory: the same batches, mid-epoch starts included."""
    from torch.utils.data import TensorDataset

    from ddpkit.data import DataSplits
    from ddpkit.data.loader import TensorSource
    from ddpkit.data.materialize import materialize

    gen = torch.Generator().manual_seed(0)
    tensors = TensorDataset(torch.randn(103, 4, generator=gen), torch.randint(0, 5, (103,), generator=gen))

    class Own(torch.utils.data.Dataset):
        def __len__(self):
            return 103

        def __getitem__(self, i):
            return {"x": tensors.tensors[0][i], "y": int(tensors.tensors[1][i])}

    for dataset in (tensors, Own()):
        held = materialize(DataSplits(dataset, dataset, None), cfg(data_path="auto", dataset="custom:x")).train
        resident = TensorSource(held, cfg(), ctx(rank, world), per_rank_batch=8)
        loader = LoaderSource(dataset, None, cfg(), ctx(rank, world), per_rank_batch=8)
        for epoch, start in ((0, 0), (1, 2)):
            pairs = list(zip(resident.batches(epoch, start), loader.batches(epoch, start)))
            assert len(pairs) == resident.steps_per_epoch - start > 0
            for a, b in pairs:
                assert type(a) is type(b)
                leaves_a = list(a.values()) if isinstance(a, dict) else list(a)
                leaves_b = list(b.values()) if isinstance(b, dict) else list(b)
                assert all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(leaves_a, leaves_b))


@pytest.mark.parametrize(
    "source", [lambda *a, **kw: ResidentSource(*a, **kw, on_device=True), LoaderSource], ids=["resident", "loader"]
)
def test_a_global_batch_is_the_same_samples_at_every_world_size_from_any_step(source):
    """What a resume at another world size relies on (elastic resume): with the global batch fixed,
    step s takes the same samples whether 1, 2 or 4 ranks share it, from a mid-epoch start too."""
    d = ImageData(torch.zeros(103, 3, 8, 8, dtype=torch.uint8), torch.arange(103))  # label = index

    def global_batches(world: int, epoch: int, start: int) -> list[set[int]]:
        per_rank = [
            [
                set(y.tolist())
                for _, y in source(d, META, cfg(), ctx(r, world), per_rank_batch=24 // world).batches(epoch, start)
            ]
            for r in range(world)
        ]
        return [set().union(*step) for step in zip(*per_rank)]

    for epoch, start in ((0, 0), (1, 2)):
        one = global_batches(1, epoch, start)
        assert len(one) == 103 // 24 - start and all(len(b) == 24 for b in one)
        assert global_batches(2, epoch, start) == one and global_batches(4, epoch, start) == one
