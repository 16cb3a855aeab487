"""Where a Pallas kernel is compiled: interpret, Triton or Mosaic, decided by the platform the
program is lowered for, not by the process's default backend.

Each Pallas form wraps its kernels in `jax.lax.platform_dependent`: the `cpu` branch runs the
kernel in Pallas interpret mode (XLA ops, the CPU tests), the `cuda` / `rocm` branch lowers it
through Triton (`pallas-gpu`), the `tpu` branch through Mosaic TPU (`pallas-tpu`). All branches
are traced; lowering keeps the one of the devices the program is compiled for. So a CPU process
with `LOOPRL_KERNELS=pallas-gpu` runs the interpreted kernels when it executes on the CPU, and
compiles the Triton kernels when it lowers for a compile-only H100 (`looprl.aot`: arguments
sharded on the target's devices); no flag says which. A program lowered for a platform the
form has no branch for (a `pallas-tpu` program on a GPU) fails at lowering with jax's error
naming the platform. `target_name` gives the kernel version's target suffix.
"""
from __future__ import annotations

import functools

import jax
from jax.experimental.pallas import triton as pltriton
from jax.experimental.pallas import tpu as pltpu

PLATFORMS = {"gpu": ("cuda", "rocm"), "tpu": ("tpu",)}


def compiler_params(backend: str, interpret: bool, gpu: dict | None = None, **tpu):
    """The `pallas_call` compiler parameters: Triton's (`gpu`, e.g. `num_stages`) on a compiled
    GPU kernel (jax's default GPU lowering is Mosaic GPU, which stages whole blocks in shared
    memory), Mosaic TPU's (`tpu`, e.g. `dimension_semantics`) on a compiled TPU kernel, none
    interpreted."""
    if interpret:
        return None
    if backend == "gpu":
        return pltriton.CompilerParams(**(gpu or {}))
    return pltpu.CompilerParams(**tpu) if tpu else None


def lowered(build, backend: str, *args):
    """`build(interpret)(*args)` with `interpret` True where the program is lowered for the
    CPU and False where it is lowered for `backend`'s platforms (module doc). Raises
    ValueError for an unknown backend."""
    if backend not in PLATFORMS:
        raise ValueError(f"Pallas backend {backend!r}: expected one of {', '.join(PLATFORMS)}")
    compiled = build(False)
    return jax.lax.platform_dependent(*args, cpu=build(True),
                                      **{p: compiled for p in PLATFORMS[backend]})


@functools.cache
def target_name(backend: str) -> str:
    """The device a `backend` form runs on, as the kernel version names it: `sm90` (a CUDA
    GPU's compute capability), `v5e` / `v5p` / `v6e` / ... (a TPU's device kind), else
    `interpret` (this process's devices are not `backend`'s: the kernels are interpreted)."""
    devices = jax.devices()
    if backend == "gpu" and devices[0].platform == "gpu":
        cc = getattr(devices[0], "compute_capability", "") or ""
        return "sm" + cc.replace(".", "") if cc else "gpu"
    if backend == "tpu" and devices[0].platform == "tpu":
        kind = devices[0].device_kind.lower().replace("tpu", "").strip()  # "v5 lite" -> v5e
        return kind.replace(" lite", "e").replace(" ", "")
    return "interpret"


def fence(interpret: bool, *xs):
    """`xs` behind `jax.lax.optimization_barrier` when the kernel is interpreted, else as they
    are. Interpreted, a kernel body is XLA ops inside the caller's program, and XLA CPU
    compiles the same elementwise ops (exp, the online softmax's updates) into different code
    depending on what it fuses them with: a block loaded from an operand whose length is the
    call's (the cache, the batch), or a result stored into one. The barrier keeps each body's
    code the same in every program; the compiled kernels need none."""
    if interpret:
        xs = jax.lax.optimization_barrier(xs)
    return xs if len(xs) != 1 else xs[0]
