"""The cost model: the ring formula, a fit that recovers a link, and DDP's real bucket sizes."""

from __future__ import annotations

import math

import pytest
import torch.distributed as dist

from ddpkit.models import MLP, ResNet9
from ddpkit.tools.costmodel import LINKS, Link, allreduce_s, ddp_buckets, predict_step


def test_ring_allreduce_time():
    link = Link("x", busbw=100e9, latency_s=1e-6)
    assert allreduce_s(10**9, 1, link) == 0
    # 8 ranks: 2*7/8 of 1 GB at 100 GB/s, plus 14 latency hops
    assert math.isclose(allreduce_s(10**9, 8, link), 14e-6 + 1.75e9 / 100e9)


def test_fit_recovers_the_link_from_timings():
    true = Link("t", busbw=2e9, latency_s=30e-6)
    sizes = [1 << 20, 8 << 20, 25 << 20]
    fitted = Link.fit("fit", 2, sizes, [allreduce_s(s, 2, true) for s in sizes])
    assert math.isclose(fitted.busbw, true.busbw, rel_tol=1e-6)
    assert math.isclose(fitted.latency_s, true.latency_s, rel_tol=1e-6)


@pytest.mark.parametrize("make", [lambda: MLP(1, 28, 28, 10), lambda: ResNet9(3, 32, 32, 10)])
def test_buckets_are_the_ones_ddp_rebuilds_after_the_first_step(make):
    """After its first iteration DDP re-buckets the gradients in the order they became ready
    (reverse parameter order here) with torch's own assignment function, a 1 MiB first bucket
    and 25 MiB after (reducer.cpp, rebuild_buckets). The estimate must be that function's answer."""
    model = make()
    params = list(reversed(list(model.parameters())))
    buckets, _ = dist._compute_bucket_assignment_by_size(params, [1 << 20, 25 << 20], [False] * len(params))
    assert ddp_buckets(model) == [sum(params[i].numel() * 4 for i in b) for b in buckets]
    assert sum(ddp_buckets(model)) == sum(p.numel() * 4 for p in model.parameters())


def test_predictions_weak_and_strong():
    link, buckets = LINKS["h100-nvlink"], [1 << 20, 25 << 20]
    one = predict_step(0.01, buckets, 1, link, "cuda", 512)
    assert one.efficiency == pytest.approx(1.0) and one.comm_s == 0
    eight = predict_step(0.01, buckets, 8, link, "cuda", 512)
    assert 0.9 < eight.efficiency < 1.0  # 26 MiB over NVLink hides mostly behind a 10 ms backward
    strong = predict_step(0.01, buckets, 8, link, "cuda", 512, strong=True)
    assert strong.efficiency < eight.efficiency  # smaller per-rank work hides less comm
    # CPU: 2 ranks on 2 cores get one thread each: compute doubles before any comm
    cpu = predict_step(0.01, buckets, 2, Link("gloo", 1e9, 1e-5), "cpu", 64, cores=2)
    assert cpu.compute_s == pytest.approx(0.02) and cpu.exposed_comm_s == cpu.comm_s
    # 4 ranks on 2 cores: half a core each, so no more throughput than 1 rank on both
    over = predict_step(0.01, [], 4, Link("gloo", 1e9, 1e-5), "cpu", 64, cores=2)
    assert over.compute_s == pytest.approx(0.04) and over.speedup == pytest.approx(1.0)
