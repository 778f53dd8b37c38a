"""What data parallelism should cost: a ring all-reduce model of DDP's gradient sync.

    buckets = ddp_buckets(model)                        # gradient bytes per DDP bucket
    link = LINKS["h100-nvlink"]                         # or Link.fit(sizes, times) from a measurement
    p = predict_step(t1_s=0.020, buckets=buckets, world=8, link=link, device_type="cuda")
    p.step_s, p.comm_s, p.efficiency

A ring all-reduce of ``b`` bytes over ``N`` ranks sends ``2(N-1)/N * b`` bytes through the
slowest link in ``2(N-1)`` steps, each paying the link's latency; NCCL's "bus bandwidth"
is defined so that this time is ``2(N-1)/N * b / busbw``. DDP all-reduces one bucket at a
time (the first 1 MiB, then 25 MiB each, in reverse parameter order), and on a GPU it
overlaps them with the backward pass: what the step waits for is the comm that does not fit
behind the backward (about 2/3 of the step's compute), and at least the last bucket, which
starts only when the backward ends. On CPU, gloo's threads share the cores with the compute,
so nothing is hidden; and N processes on C cores get C/N threads each (a fraction of a core
past N = C), so each rank's compute slows by that ratio: the model says so, rather than
blaming the network.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from torch import nn

MIB = 1 << 20
FIRST_BUCKET_BYTES = 1 * MIB  # DDP's dist._DEFAULT_FIRST_BUCKET_BYTES
BUCKET_CAP_BYTES = 25 * MIB  # DDP's bucket_cap_mb default
BACKWARD_SHARE = 2 / 3  # of a step's compute: the backward, about twice the forward's work


@dataclass(frozen=True)
class Link:
    """An all-reduce fabric: bus bandwidth (bytes/s, NCCL's busbw definition) and per-hop latency (s)."""

    name: str
    busbw: float
    latency_s: float

    @classmethod
    def fit(cls, name: str, world: int, sizes: list[int], seconds: list[float]) -> "Link":
        """The link that explains measured all-reduce times of ``sizes`` bytes at ``world`` ranks:
        a least-squares line t = hops * latency + factor * bytes / busbw."""
        factor, hops = 2 * (world - 1) / world, 2 * (world - 1)
        xs = [factor * s for s in sizes]
        n, mx, my = len(xs), sum(xs) / len(xs), sum(seconds) / len(seconds)
        sxx = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, seconds)) / sxx if n > 1 and sxx > 0 else my / mx
        if slope <= 0:  # noise swamped the size dependence: charge everything to bandwidth, none to latency
            slope = max(seconds[i] / xs[i] for i in range(n))
        intercept = max(0.0, my - slope * mx)
        return cls(name, 1 / max(slope, 1e-15), intercept / hops)


# Defaults for GPUs this machine may not have; every one can be overridden (--busbw-gbs, --latency-us).
LINKS = {
    # H100 SXM, NVLink 4 through NVSwitch: nccl-tests all_reduce busbw ~370-480 GB/s at large sizes.
    "h100-nvlink": Link("h100-nvlink", 370e9, 5e-6),
    # one 400 Gb/s InfiniBand NDR port per GPU (multi-node): 50 GB/s line rate, ~45 GB/s busbw.
    "ib-400g": Link("ib-400g", 45e9, 10e-6),
}


def ddp_buckets(model: nn.Module, first: int = FIRST_BUCKET_BYTES, cap: int = BUCKET_CAP_BYTES) -> list[int]:
    """Gradient bytes per DDP bucket in steady state: after its first iteration DDP rebuilds its
    buckets in the order gradients became ready (about reverse parameter order), the first up
    to ``first`` bytes and the rest up to ``cap``, each closed once it reaches its limit
    (``dist._compute_bucket_assignment_by_size`` for one dtype on one device)."""
    sizes, current, limit = [], 0, first
    for p in reversed([p for p in model.parameters() if p.requires_grad]):
        current += p.numel() * p.element_size()
        if current >= limit:
            sizes.append(current)
            current, limit = 0, cap
    if current:
        sizes.append(current)
    return sizes


def allreduce_s(nbytes: int, world: int, link: Link) -> float:
    """One ring all-reduce of ``nbytes`` bytes over ``world`` ranks."""
    if world <= 1:
        return 0.0
    return 2 * (world - 1) * link.latency_s + 2 * (world - 1) / world * nbytes / link.busbw


@dataclass(frozen=True)
class Prediction:
    world: int
    compute_s: float  # one rank's forward + backward + step, without gradient sync
    comm_s: float  # all buckets' all-reduce time
    exposed_comm_s: float  # what the step waits for
    step_s: float
    samples_per_s: float
    speedup: float
    efficiency: float

    def to_dict(self) -> dict:
        return asdict(self)


def predict_step(
    t1_s: float,
    buckets: list[int],
    world: int,
    link: Link,
    device_type: str,
    batch_1: int,
    strong: bool = False,
    cores: int = 1,
    compute_measured: bool = False,
) -> Prediction:
    """Step time at ``world`` ranks from the measured world-1 step ``t1_s`` at batch ``batch_1``.

    Weak scaling keeps the per-rank batch (global batch grows with world); strong scaling keeps
    the global batch (each rank computes 1/world of it, assumed proportional in time). With
    ``compute_measured``, ``t1_s`` is already one rank's compute at ``world`` (timed without
    gradient sync), and only the communication is modelled; speedup is then left relative to it.
    """
    if compute_measured:
        compute = t1_s
    else:
        compute = t1_s / world if strong else t1_s
    if device_type == "cpu" and not compute_measured:
        # The ranks share the cores: cores // world threads each, and past one rank per core a
        # rank gets a fraction of one. (Assumes compute scales with threads: a bound, not a fit.)
        share = cores // world if world <= cores else cores / world
        compute *= max(1, cores) / share
    comm = sum(allreduce_s(b, world, link) for b in buckets)
    if device_type == "cpu" or world <= 1:
        exposed = comm
    else:
        last = allreduce_s(buckets[-1], world, link) if buckets else 0.0
        exposed = max(last, comm - BACKWARD_SHARE * compute)
    step = compute + exposed
    global_batch = batch_1 if strong else batch_1 * world
    rate = global_batch / step
    speedup = rate / (batch_1 / t1_s)
    return Prediction(world, compute, comm, exposed, step, rate, speedup, speedup / world)
