"""Test setup: pin XLA's CPU threading so bit-level results are reproducible.

Bits depend on the thread count (DESIGN.md §5), so the suite runs XLA CPU with Eigen's
multi-threading off (one intra-op thread) unless LOOPRL_TEST_XLA_FLAGS says otherwise. The flag
must be set before jax initialises its backend, hence here at import time.
"""
import os

os.environ.setdefault("XLA_FLAGS", os.environ.get("LOOPRL_TEST_XLA_FLAGS",
                                                  "--xla_cpu_multi_thread_eigen=false"))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# One persistent compilation cache per test run, shared by the two xdist workers and the
# `looprl` processes the tests start (they inherit the environment): the suite compiles the
# same tiny-model programs in many modules and processes (jax.clear_caches() below drops the
# in-memory ones after each module). The cache key holds the program, the XLA flags and the
# jax version, so a hit is the executable XLA would have built again. About a quarter off
# tests/sampling + tests/logprobs (407 s -> 295 s). LOOPRL_TEST_JAX_CACHE=0 turns it off.
if os.environ.get("LOOPRL_TEST_JAX_CACHE", "1") != "0":
    import tempfile
    _run = os.environ.get("PYTEST_XDIST_TESTRUNUID") or f"pid{os.getpid()}"
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                          os.path.join(tempfile.gettempdir(), f"looprl-test-jax-cache-{_run}"))
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")


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


def pytest_unconfigure(config):
    """The run's compilation cache goes with the run (the controller, after its workers)."""
    path = os.environ.get("JAX_COMPILATION_CACHE_DIR", "")
    if "looprl-test-jax-cache-" in path and not hasattr(config, "workerinput"):
        import shutil
        shutil.rmtree(path, ignore_errors=True)
