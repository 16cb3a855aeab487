"""`looprl.determinism.environment`: the one environment record of every report; the CPU's
sgemm ISA and the kernels' row quantum."""
import os

import pytest

from looprl import determinism
from looprl import kernels as kn
from looprl.kernels import tiling

AVX512 = frozenset({"avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq"})
AVX2 = frozenset({"avx", "avx2", "fma"})

KEYS = {"jax", "jaxlib", "python", "backend", "device_kind", "device_count", "cpu_model",
        "cpu_count", "cpu_affinity", "xla_flags", "threads_pinned", "intra_op_threads",
        "platform", "git_commit", "git_dirty", "accelerator_pins", "accel_matmul", "cpu_isa",
        "cpu_row_quantum"}


def test_environment_record_holds_the_union_of_both_former_records(monkeypatch):
    # the flags in force plus the pin: this call may be the one that starts jax's CPU backend,
    # and a backend started without looprl's required flags breaks every later test's bits in
    # this worker (as XLA_FLAGS = the pin alone did: the device check's scan found rows differing)
    flags = os.environ.get("XLA_FLAGS", "")
    monkeypatch.setenv("XLA_FLAGS", f"{flags} --xla_cpu_multi_thread_eigen=false")
    env = determinism.environment()
    assert set(env) == KEYS
    assert env["backend"] == "cpu" and env["threads_pinned"] is True
    assert env["intra_op_threads"] == 1
    assert set(env["accelerator_pins"]) == {*determinism.ACCELERATOR_FLAGS,
                                            *determinism.ACCELERATOR_ENV}
    assert env["git_dirty"] in (True, False, None)
    assert env["git_commit"] is None or len(env["git_commit"]) == 40


@pytest.mark.parametrize("flags, cap, isa, quantum", [
    (AVX512, None, "avx512_core", 8),
    (AVX512 - {"avx512bw"}, None, "avx2", 24),  # oneDNN's avx512_core needs all four
    (AVX512, "AVX2", "avx2", 24),  # oneDNN capped below AVX-512 runs its AVX2 kernels
    (AVX512, "avx2_vnni", "avx2", 24),
    (AVX512, "AVX512_CORE_AMX", "avx512_core", 8),
    (AVX512, "AVX10_1_512", "avx512_core", 8),
    (AVX2, "AVX10_1_512", "avx2", 24),  # a cap never raises the hardware's level
    (AVX2, "AVX", "avx", 24),
    (AVX2, "SSE41", "sse41", 24),
    (AVX2, "NO_SUCH_ISA", "other", 24),
    (AVX2, None, "avx2", 24),
    (frozenset(), None, "other", 24),  # no /proc/cpuinfo flags (another OS or architecture)
])
def test_row_quantum_is_the_isas_register_block_or_24(monkeypatch, flags, cap, isa, quantum):
    monkeypatch.setattr(determinism, "cpu_flags", lambda: flags)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    if cap is None:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    else:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
    assert determinism.cpu_isa() == isa
    assert determinism.cpu_row_quantum() == quantum


def test_kernels_use_this_machines_quantum_and_record_it():
    env = determinism.environment()
    assert kn.ROW_QUANTUM == determinism.cpu_row_quantum() == env["cpu_row_quantum"]
    assert kn.row_tile() == kn.ROW_QUANTUM and kn.ROW_TILE_MAX % kn.ROW_QUANTUM == 0
    assert env["cpu_isa"] == determinism.cpu_isa()
    assert all(tiling.row_tile_for(m) % kn.ROW_QUANTUM == 0 for m in (1, 7, 300, 1000, 4096))
