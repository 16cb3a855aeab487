"""Compile-only accelerator targets: an H100 (sm_90), a TPU v5e and a TPU v6e, from a CPU process.

`jax.experimental.topologies` describes a device that is not present: the CUDA plugin from a
GpuTargetConfigProto (`h100_sxm.txtpb`, package data), libtpu from a topology name. A jitted
function lowered with ShapeDtypeStructs sharded on that description's device runs the target's
whole XLA pipeline (Triton on the GPU, Mosaic on the TPU) and returns a `jax.stages.Compiled`
whose `.as_text()` is the optimized program; nothing runs. Lowering with
`lowering_platforms=` instead compiles for the CPU. The GPU target compiles with looprl's GPU
pins (`determinism.ACCELERATOR_FLAGS`) as per-compile options, so a CPU process's XLA_FLAGS stay
the CPU's. Needs `pip install -e '.[aot]'` (the CUDA plugin and libtpu; `missing` names what is
absent); the compile-only GPU pipeline runs with no `ptxas` found, so no CUDA toolkit.
Peaks are published figures (NVIDIA H100 SXM datasheet; Google Cloud TPU v5e, v6e pages).
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
from pathlib import Path
from typing import Any, Callable

from looprl.determinism import ACCELERATOR_FLAGS

H100_CONFIG = Path(__file__).with_name("h100_sxm.txtpb")


@dataclasses.dataclass(frozen=True)
class Target:
    """One compile-only device and its published peaks.

    peak_flops: FLOP/s by operand dtype name (`bfloat16`: the tensor cores / MXU with fp32
    accumulation; `float32`: without TF32, on a TPU the MXU's multi-pass fp32 at HIGHEST);
    hbm_bytes_per_s: memory bandwidth, bytes/s; launch_s: a fixed cost per kernel launch, s."""
    name: str
    platform: str  # jax's platform name for the topology: `cuda` or `tpu`
    device_kind: str
    peak_flops: dict[str, float]
    hbm_bytes_per_s: float
    launch_s: float
    topology: str

    @property
    def backend(self) -> str:
        """The kernel backend name looprl's forms use: `gpu` or `tpu`."""
        return "gpu" if self.platform == "cuda" else "tpu"


TARGETS = {t.name: t for t in (
    Target("h100", "cuda", "NVIDIA H100 80GB HBM3",
           {"bfloat16": 989.4e12, "float32": 66.9e12}, 3.35e12, 3e-6, "1x1x1"),
    Target("v5e", "tpu", "TPU v5 lite", {"bfloat16": 197e12, "float32": 197e12 / 6},
           819e9, 1e-6, "v5e:1x1"),
    Target("v6e", "tpu", "TPU v6 lite", {"bfloat16": 918e12, "float32": 918e12 / 6},
           1640e9, 1e-6, "v6e:1x1"),
)}
# the packages each platform's compile-only device needs (the `aot` extra installs them)
NEEDS = {"cuda": ("jax_cuda12_plugin", "jax_plugins.xla_cuda12"), "tpu": ("libtpu",)}


def target(name: str) -> Target:
    """The target named `name` (`h100`, `v5e`, `v6e`). Raises KeyError naming the choices."""
    if name not in TARGETS:
        raise KeyError(f"unknown compile-only target {name!r}; known: {sorted(TARGETS)}")
    return TARGETS[name]


def missing(name: str) -> str | None:
    """Why target `name` cannot be compiled for in this environment (a sentence naming the
    missing package and how to install it), or None when it can."""
    t = target(name)
    for module in NEEDS[t.platform]:
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            return (f"compile-only {name} needs the Python module {module!r} "
                    "(pip install -e '.[aot]')")
    return None


@functools.cache
def devices(name: str) -> tuple:
    """The compile-only devices of target `name` (one device). Sets TPU_SKIP_MDS_QUERY for a
    TPU target (libtpu otherwise asks a cloud metadata server for the host's TPU) and
    ALLOW_MULTIPLE_LIBTPU_LOAD (libtpu otherwise takes a lockfile, and a second process
    compiling for a TPU at the same time, a test worker, fails to load it). Raises
    RuntimeError with `missing`'s reason when the target's packages are absent."""
    reason = missing(name)
    if reason:
        raise RuntimeError(reason)
    from jax.experimental import topologies  # jax starts after looprl's flags are set
    t = target(name)
    if t.platform == "cuda":
        topo = topologies.get_topology_desc(platform="cuda", topology=t.topology,
                                            target_config=H100_CONFIG.read_text())
    else:
        os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # no device: nothing shared
        topo = topologies.get_topology_desc(topology_name=t.topology, platform="tpu",
                                            chips_per_host_bounds=[1, 1, 1])
    return tuple(topo.devices)


def sharding(name: str):
    """A NamedSharding that places an array whole on target `name`'s device."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec
    mesh = jax.sharding.Mesh(list(devices(name)), ("d",))
    return NamedSharding(mesh, PartitionSpec())


def abstract(tree: Any, name: str):
    """`tree`'s arrays (or ShapeDtypeStructs) as ShapeDtypeStructs placed on target `name`."""
    import jax
    s = sharding(name)
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree)


def compiler_options(name: str) -> dict[str, Any]:
    """The per-compile XLA options for target `name`: on the GPU looprl's pins
    (`determinism.ACCELERATOR_FLAGS`, deterministic ops, autotuning off, no Triton GEMM, loops
    kept), as debug options; none on a TPU."""
    if target(name).platform != "cuda":
        return {}
    options = {}
    for flag in ACCELERATOR_FLAGS:
        key, value = flag.removeprefix("--").split("=", 1)
        options[key] = {"true": True, "false": False}.get(value, value)
        if value.isdigit():
            options[key] = int(value)
    return options


def compile_for(name: str, fn: Callable, *args, static: dict | None = None,
                dump_dir: str | os.PathLike | None = None, pinned: bool = True,
                donate: tuple[int, ...] = ()):
    """Lower and compile `jax.jit(fn)` for target `name`'s device with no device present.

    Args:
      fn: a function of arrays; `static` keyword arguments are bound first (not traced).
      args: arrays or ShapeDtypeStructs (any pytree), placed on the target (`abstract`).
      dump_dir: where XLA writes its dumps of this compile (on the GPU the `.ptx` per module,
        which `looprl.aot.inspect.ptx_kernels` reads); default none.
      pinned: compile with `compiler_options(name)` (the GPU pins); False gives stock XLA.
      donate: the indices of `args` whose buffers the program may update in place.
    Returns: the `jax.stages.Compiled` (`.as_text()`, `.memory_analysis()`; `.cost_analysis()` on
      a TPU, `inspect.cost` everywhere).
    Raises: RuntimeError when the target's packages are missing (`missing`).
    """
    import jax
    f = functools.partial(fn, **(static or {}))
    options = dict(compiler_options(name) if pinned else {})
    if dump_dir is not None:
        options.update(xla_dump_to=str(dump_dir), xla_dump_hlo_as_text=True)
    lowered = jax.jit(f, donate_argnums=donate).lower(*abstract(args, name))
    return lowered.compile(compiler_options=options or None)
