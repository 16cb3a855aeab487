"""Test setup: pin XLA's CPU threading so bit-level results are reproducible.

Bits depend on the thread count (DESIGN.md §5), so the suite runs XLA CPU with Eigen's
multi-threading off (one intra-op thread) unless LOOPRL_TEST_XLA_FLAGS says otherwise. The flag
must be set before jax initialises its backend, hence here at import time.
"""
import os

os.environ.setdefault("XLA_FLAGS", os.environ.get("LOOPRL_TEST_XLA_FLAGS",
                                                  "--xla_cpu_multi_thread_eigen=false"))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
