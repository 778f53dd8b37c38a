"""The CPU flags tests see: in-process tests run as on an AVX2-only machine (conftest pins them)."""

from ddpkit import recipes

# The flags of the AVX2-only machines (no native bf16): what in-process tests see.
AVX2_ONLY = frozenset({"sse4_2", "avx", "avx2", "fma"})
host_cpu_flags = recipes.cpu_flags  # the real one, captured before conftest pins it, for the test of it
