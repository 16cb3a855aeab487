"""Test setup: pin XLA's CPU threading so bit-level results are reproducible.

Bits depend on the thread count (DESIGN.md §5), so the suite runs XLA CPU with Eigen's
multi-threading off (one intra-op thread) unless LOOPRL_TEST_XLA_FLAGS says otherwise. The flag
must be set before jax initialises its backend, hence here at import time.
"""
import os

os.environ.setdefault("XLA_FLAGS", os.environ.get("LOOPRL_TEST_XLA_FLAGS",
                                                  "--xla_cpu_multi_thread_eigen=false"))
os.environ.setdefault("JAX_PLATFORMS", "cpu")


import gc  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop jax's compiled programs after each test module. Every XLA CPU executable keeps
    memory mappings, and a process that compiled the whole suite's programs reached ~49,000 of
    the kernel's 65,530 (`vm.max_map_count`) and then segfaulted inside a compile."""
    yield
    import jax
    jax.clear_caches()
    gc.collect()
