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
naming the platform. `target_name` gives the kernel version's target suffix; `opaque_on_cpu`
runs XLA code between the kernels as its own program on the CPU (no fusion with its callers).
"""
from __future__ import annotations

import functools

import jax
import numpy as np
from jax.experimental.pallas import triton as pltriton
from jax.experimental.pallas import tpu as pltpu

from looprl import compat

compat.quiet_triton_deprecation()  # Triton is the GPU path on purpose (looprl.compat)
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


def opaque_on_cpu(fn, backend: str, *args, device=None):
    """`device(*args)` (default `fn`) where the program is lowered for `backend`'s platforms;
    where it is lowered for the CPU, `fn` runs as its own compiled program behind a host
    callback, so no XLA CPU fusion joins it with the code around it (XLA CPU drops an
    `optimization_barrier` before fusing). One result array; not differentiable (give it a
    custom_vjp)."""
    jitted = _jitted(fn)

    def host(*arrays):
        return np.asarray(jitted(*arrays))

    def cpu(*xs):
        return jax.pure_callback(host, jax.eval_shape(fn, *xs), *xs, vmap_method="sequential")
    return jax.lax.platform_dependent(*args, cpu=cpu,
                                      **{p: device or fn for p in PLATFORMS[backend]})


@functools.cache
def _jitted(fn):
    return jax.jit(fn)


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
    are: an ordering hint inside an interpreted body. XLA CPU removes the barrier before it
    fuses, so it does not keep a body's code apart from the ops around it; code whose bits
    must not depend on its neighbours is `opaque_on_cpu`. The compiled kernels need none."""
    if interpret:
        xs = jax.lax.optimization_barrier(xs)
    return xs if len(xs) != 1 else xs[0]
