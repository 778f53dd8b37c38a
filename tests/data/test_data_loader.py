"""Sharding semantics, path equivalence and batched augmentation (all on CPU tensors)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DistributedSampler

from ddpkit.data import ImageData, Meta
from ddpkit.data.augment import crop_flip, epoch_params
from ddpkit.data.loader import LoaderSource, ResidentSource, epoch_order
from ddpkit.ranks.context import DistContext

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
    assert host.path == "host-staged" and device.path == "in-memory"  # on the CPU: "device-resident" on a GPU
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


@pytest.mark.parametrize("drop_last", [True, False])
def test_shuffle_block_reorders_each_whole_block_among_its_own_samples(drop_last):
    """shuffle_in_batch (ddpkit check's noise run): every global batch of B keeps its samples, never
    in its own order; the epoch's permutation, the ranks' interleaving and a partial tail stay."""
    n, b = 103, 12

    def samples(shards, positions: slice) -> set[int]:  # what the ranks take at these positions, together
        return set(torch.cat([s[positions] for s in shards]).tolist())

    for world in (1, 2, 3):
        for epoch in (0, 1):
            plain = [epoch_order(n, world, r, 5, epoch, drop_last) for r in range(world)]
            moved = [epoch_order(n, world, r, 5, epoch, drop_last, shuffle_block=b) for r in range(world)]
            per_rank = b // world
            assert [len(m) for m in moved] == [len(p) for p in plain]
            whole = min(len(p) for p in plain) // per_rank
            for k in range(whole):
                step = slice(k * per_rank, (k + 1) * per_rank)
                assert samples(moved, step) == samples(plain, step)
            tail = slice(whole * per_rank, None)
            assert samples(moved, tail) == samples(plain, tail)
    one, shuffled = epoch_order(n, 1, 0, 5, 0), epoch_order(n, 1, 0, 5, 0, shuffle_block=b)
    blocks = n // b
    assert all(not torch.equal(one[k * b : (k + 1) * b], shuffled[k * b : (k + 1) * b]) for k in range(blocks))
    assert torch.equal(one[blocks * b :], shuffled[blocks * b :])
    for seed in range(20):  # a block of 2 has one other order: a drawn identity is reversed, never kept
        assert not torch.equal(epoch_order(2, 1, 0, seed, 0, shuffle_block=2), epoch_order(2, 1, 0, seed, 0))


@pytest.mark.parametrize("world,rank", [(1, 0), (2, 1)])
@pytest.mark.parametrize("kind", ["resident", "tensor", "loader"])
def test_shuffle_in_batch_gives_each_step_its_samples_in_another_order_on_every_path(kind, world, rank):
    """Each source with shuffle_in_batch: every step the same samples as without it (their crops and
    flips too, drawn per sample), in another order; the order it says it feeds (epoch_indices, what
    ddpkit check counts) is the one it feeds."""
    from ddpkit.data.loader import TensorSource
    from ddpkit.data.types import TensorData

    d = data()
    d = ImageData(d.images, torch.arange(103))  # label = index

    def make(on: bool):
        flags = cfg(shuffle_in_batch=on)
        if kind == "resident":
            return ResidentSource(d, META, flags, ctx(rank, world), per_rank_batch=8, on_device=True)
        if kind == "loader":
            return LoaderSource(d, META, flags, ctx(rank, world), per_rank_batch=8)
        return TensorSource(TensorData([d.images.float(), d.labels]), flags, ctx(rank, world), per_rank_batch=8)

    plain, shuffled = make(False), make(True)
    assert shuffled.shuffle_block == 8 * world and plain.shuffle_block == 0
    for epoch, start in ((0, 0), (1, 2)):
        pairs = list(zip(plain.batches(epoch, start), shuffled.batches(epoch, start)))
        assert len(pairs) == plain.steps_per_epoch - start > 0
        fed = torch.cat([y for _, (_, y) in pairs])
        assert torch.equal(fed, shuffled.epoch_indices(epoch)[start * 8 :])
        reordered = 0
        for (xa, ya), (xb, yb) in pairs:
            if world == 1:  # the whole global batch is this rank's: the same samples
                assert sorted(ya.tolist()) == sorted(yb.tolist())
            reordered += not torch.equal(ya, yb)
            for i, label in enumerate(yb.tolist()):  # each sample as it is without the shuffle
                if label in ya.tolist():
                    assert torch.equal(xb[i], xa[ya.tolist().index(label)])
        assert reordered == len(pairs) if world == 1 else reordered > 0


def test_eval_batches_index_where_the_data_lives_and_are_unchanged():
    """The eval index is made once on the data's device (a host index into device-resident data is a
    synchronous host-to-device copy per batch); the batches are this rank's every world-th sample."""
    from ddpkit.data import TensorData
    from ddpkit.data.loader import EvalSource, Preprocess

    d = data(103)
    pre = Preprocess(META, torch.device("cpu"), False)
    for rank, world, batch in ((0, 1, 16), (1, 2, 16), (2, 4, 7), (3, 4, 256)):
        src = EvalSource(d, pre, cfg(), ctx(rank, world), batch)
        assert src.index.device == d.images.device and src.index.dtype == torch.long
        own = list(range(rank, 103, world))
        chunks = [own[i : i + batch] for i in range(0, len(own), batch)]
        got = list(src.batches())
        assert len(got) == len(chunks)
        for (x, y), idx in zip(got, chunks):
            assert torch.equal(x, pre.eval(d.images[idx])) and torch.equal(y, d.labels[idx])

        tensors = TensorData({"x": d.images.float(), "y": d.labels})
        src = EvalSource(tensors, Preprocess(None, torch.device("cpu"), False), cfg(), ctx(rank, world), batch)
        assert src.index.device == d.images.device
        got = list(src.batches())
        assert len(got) == len(chunks)
        for b, idx in zip(got, chunks):
            assert torch.equal(b["x"], d.images[idx].float()) and torch.equal(b["y"], d.labels[idx])


@pytest.mark.parametrize("world,rank", [(1, 0), (2, 1)])
def test_a_collate_fn_makes_every_batch_of_data_held_in_memory(world, rank):
    """Regression: tensors in memory (a TensorData, an ImageData) were batched by indexing, and the user's
    collate_fn never ran. With one given, train and eval batches are the collate's over the same samples."""
    from torch.utils.data import default_collate

    from ddpkit.data import DataSplits, TensorData
    from ddpkit.data.loader import EvalSource, Preprocess, TensorSource, make_train_source

    gen = torch.Generator().manual_seed(0)
    tensors = TensorData([torch.randn(103, 4, generator=gen), torch.randint(0, 5, (103,), generator=gen)])

    def times50(items):
        x, y = default_collate(items)
        return x * 50, y

    flags = cfg(**vars(path_cfg()))
    plain = TensorSource(tensors, flags, ctx(rank, world), per_rank_batch=8)
    src = make_train_source(DataSplits(tensors, tensors, None, times50), flags, ctx(rank, world), per_rank_batch=8)
    assert isinstance(src, LoaderSource) and src.path == "dataloader"
    pairs = list(zip(plain.batches(1), src.batches(1)))
    assert len(pairs) == plain.steps_per_epoch > 0
    for (x, y), (x50, y50) in pairs:
        assert torch.equal(x50, x * 50) and torch.equal(y50, y)

    pre = Preprocess(None, torch.device("cpu"), False)
    ours = list(EvalSource(tensors, pre, flags, ctx(rank, world), 16, collate_fn=times50).batches())
    indexed = list(EvalSource(tensors, pre, flags, ctx(rank, world), 16).batches())
    assert len(ours) == len(indexed) > 0
    for (x50, y50), (x, y) in zip(ours, indexed):
        assert torch.equal(x50, x * 50) and torch.equal(y50, y)

    images = data()  # an ImageData with a collate: the DataLoader path, its augmentation still the engine's
    src = make_train_source(DataSplits(images, images, META, default_collate), flags, ctx(rank, world), 8)
    assert isinstance(src, LoaderSource)


# ---------------------------------------------------------------- the data path, the same on every rank
def path_cfg(**kw):
    return SimpleNamespace(**{**dict(join=False, data_path="auto", device_data_fraction=0.25, dataset="x"), **kw})


@pytest.mark.parametrize(
    "kind, nbytes, free, flags, expected",
    [
        ("image", 100, 400, {}, "device"),  # a quarter of the free memory holds it
        ("image", 101, 400, {}, "host"),
        ("tensor", 101, 400, {}, "loader"),
        ("tensor", 100, 400, {}, "device"),
        ("image", 10**12, None, {}, "device"),  # off CUDA the data is in host memory either way
        ("tensor", 1, None, {"data_path": "host"}, "device"),  # a TensorData is indexed where it is
        ("image", 10**12, 1, {"data_path": "device"}, "device"),  # asked for: as asked
        ("image", 1, 10**12, {"data_path": "host"}, "host"),
        ("image", 1, 10**12, {"join": True}, "loader"),
        ("stream", 0, 10**12, {}, "loader"),
    ],
)
def test_the_data_path_is_decided_from_size_and_free_memory_alone(kind, nbytes, free, flags, expected):
    from ddpkit.data.loader import path_for

    assert path_for(kind, nbytes, free, path_cfg(**flags)) == expected


def test_a_streamed_dataset_asked_onto_the_device_is_refused():
    from ddpkit.data.loader import path_for
    from ddpkit.errors import ConfigError

    with pytest.raises(ConfigError, match="--data-path host needs an in-memory dataset; x streams"):
        path_for("stream", 0, None, path_cfg(data_path="host"))


def test_no_collective_at_world_1_or_off_cuda(monkeypatch):
    """Skipped alike on every rank: at world 1, and where no rank has a GPU."""
    from ddpkit.data.loader import choose_path, free_device_bytes, least_free_bytes

    monkeypatch.setattr(DistContext, "all_reduce", lambda *a, **kw: pytest.fail("a collective"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (400, 800))
    one_gpu = DistContext(0, 0, 1, 1, torch.device("cuda", 0), "nccl")
    assert free_device_bytes(one_gpu) == 400 and least_free_bytes(one_gpu, 400) == 400
    assert choose_path(data(), path_cfg(), one_gpu) == "host"  # 103 * 192 + 103 * 8 bytes > 400 / 4
    assert free_device_bytes(ctx(1, 2)) is None and least_free_bytes(ctx(1, 2), None) is None
    assert choose_path(data(), path_cfg(), ctx(1, 2)) == "device"


@pytest.mark.slow
@pytest.mark.multiprocess
def test_ranks_with_different_free_gpu_memory_choose_the_same_path():
    """Regression: each rank chose from its own free memory, so with another process on one GPU one rank
    held the train set on the device and another staged it from the host (other data code, and the
    test set moved to the device on one rank only). 1700 bytes: a quarter of 10000 holds it, of 2000 not."""
    from workers import data_path_on_a_busy_gpu

    from ddpkit.ranks.launcher import run_workers

    assert run_workers(data_path_on_a_busy_gpu, ((10_000, 2_000),), 2) == ["host", "host"]
    assert run_workers(data_path_on_a_busy_gpu, ((80 * 2**30, 10_000),), 2) == ["device", "device"]


@pytest.mark.multiprocess
def test_the_least_free_memory_is_agreed_in_one_collective_on_every_rank_whatever_the_flags():
    from workers import least_free_per_rank

    from ddpkit.ranks.launcher import run_workers

    ranks = run_workers(least_free_per_rank, ((80 * 2**30, 3 * 2**32 + 5),), 2)  # past 32 bits: int64
    for rank in ranks:
        assert rank["least"] == 3 * 2**32 + 5 and rank["cpu"] is None
        assert rank["reduces"] == 4  # one per choose_path, also where the flags decide alone
    assert ranks[0]["paths"] == ranks[1]["paths"] == ["loader", "host", "device", "device"]


def test_shuffle_in_batch_keeps_each_micro_batch_of_an_accumulated_step():
    """Review finding: with --grad-accum 2 the noise run reordered the whole accumulated step, moving samples
    between micro-batches, which changes what a batch-coupled model computes (not only the float order)."""
    d = data()
    d = ImageData(d.images, torch.arange(103))  # label = index
    plain, shuffled = (
        ResidentSource(d, META, cfg(shuffle_in_batch=on), ctx(0, 1), per_rank_batch=4, on_device=True, group=2)
        for on in (False, True)
    )
    assert shuffled.shuffle_block == 4
    pairs = list(zip(plain.batches(0, 0), shuffled.batches(0, 0)))
    assert len(pairs) == plain.steps_per_epoch > 0
    for (_, ya), (_, yb) in pairs:  # each micro-batch: the same samples, in another order
        assert sorted(ya.tolist()) == sorted(yb.tolist()) and not torch.equal(ya, yb)
