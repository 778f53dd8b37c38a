"""The CPU flags tests see: in-process tests run as on an AVX2-only machine (conftest pins them)."""

from pathlib import Path

from ddpkit import recipes

# The flags of the AVX2-only machines (no native bf16): what in-process tests see.
AVX2_ONLY = frozenset({"sse4_2", "avx", "avx2", "fma"})
host_cpu_flags = recipes.cpu_flags  # the real one, captured before conftest pins it, for the test of it


def cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id (AuthenticAMD, GenuineIntel), or "" where there is none: the bitwise goldens
    differ between vendors even with the kernels pinned to AVX2 (tests/golden/default_task.py)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    return next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("vendor_id")), "")
