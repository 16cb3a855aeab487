"""The jax builds looprl runs on, and every difference between them, in one place.

looprl supports the jaxlib lines of `LINES`: 0.10 (from 0.10.2: CI and the CPU bits) and 0.11
(the GPU image's 0.11.2 with the CUDA 13 plugin). `check_jaxlib` decides a version's line; a
jaxlib outside `SUPPORTED_RANGE` is an `UnsupportedJaxError` naming the range, never a silent
skip. A leaf that imports no jax at module top: `looprl.determinism` reads it before jax starts.

What differs between the lines, read from jax's sources at the release tags (jax-v0.10.2,
jax-v0.11.0), `CHANGELOG.md` and `docs/pallas/CHANGELOG.md`, and where looprl handles it:
- Python and numpy: jax 0.11 needs Python >= 3.12 and numpy >= 2.1 (`setup.py`:
  `python_requires`, `install_requires`; CHANGELOG "JAX 0.11.0": support for Python 3.11 and
  NumPy 2.0 dropped). `Line.python`: the carry's wheels are for that Python.
- The GPU plugin: 0.10's `jax[cuda12]` installs `jax_cuda12_plugin`; the GPU image's 0.11.2 has
  `jax_cuda13_plugin` (`setup.py` extras `cuda12`, `cuda13`). `GPU_PLUGINS` names both.
- Pallas on Triton: 0.11 deprecates the Triton backend. Lowering a `pallas_call` with
  `pltriton.CompilerParams` warns `DeprecationWarning` (id `jax-pallas-triton`,
  `jax/_src/pallas/pallas_call.py` `gpu_lowering`; docs/pallas/CHANGELOG.md "Released with JAX
  0.11.0", Triton). The call and its parameters (`num_warps`, `num_stages`) are unchanged, and
  Triton stays the path whenever the parameters are Triton's. `quiet_triton_deprecation`.
- `jax.numpy.empty` returns uninitialized memory from 0.11 (CHANGELOG "JAX 0.11.0"): looprl
  calls `zeros`, never `empty` (`tests/test_compat.py` keeps it so).
- Private APIs: `jax._src.xla_bridge._backends` (whether jax started its backends) is the same
  in both lines; `backends_started` is its one reader.

The same in both lines (read, nothing to handle): the XLA flag names of
`looprl.determinism` (the XLA each pins knows them; a flag XLA does not know aborts at start,
loudly), `pallas_call`'s signature, `pl.BlockSpec`, `pl.ds`, `pl.ANY`, `pltriton.load` /
`store`, `pltpu.CompilerParams(dimension_semantics=)`, `PrefetchScalarGridSpec`, `VMEM`,
`SMEM`, `sync_copy`, `roll`, `jax.ffi` (`include_dir`, `register_ffi_target`, `pycapsule`,
`ffi_call`; 0.11 adds `abstract_token`), `jax.custom_vjp`, `jax.lax.platform_dependent`,
`jax.experimental.topologies.get_topology_desc`, `multihost_utils`.
"""
from __future__ import annotations

import dataclasses
import re
import sys
import warnings
from importlib import metadata

from looprl.errors import LooprlError

SUPPORTED_RANGE = "jaxlib >= 0.10.2, < 0.12"
MINIMUM = (0, 10, 2)


@dataclasses.dataclass(frozen=True)
class Line:
    """One supported jaxlib line: the least Python its wheels exist for, the CUDA plugin its GPU
    install brings, and whether lowering Pallas through Triton warns."""
    python: tuple[int, int]
    cuda_plugin: str
    triton_deprecated: bool


LINES = {"0.10": Line((3, 11), "jax_cuda12_plugin", False),
         "0.11": Line((3, 12), "jax_cuda13_plugin", True)}
GPU_PLUGINS = (*(ln.cuda_plugin for ln in LINES.values()), "jax_rocm60_plugin", "jax_rocm7_plugin")
TRITON_DEPRECATION = "The Pallas Triton backend is deprecated"


class UnsupportedJaxError(LooprlError, RuntimeError):
    """The installed jaxlib is outside `SUPPORTED_RANGE` (the message names both)."""


def jaxlib_version() -> str | None:
    """The installed jaxlib's version string, read without importing it; None when absent."""
    try:
        return metadata.version("jaxlib")
    except metadata.PackageNotFoundError:
        return None


def _release(version: str) -> tuple[int, ...]:
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    if not m:
        return ()
    return tuple(int(p) for p in m.groups(default="0"))


def check_jaxlib(version: str | None = None) -> str:
    """The line (`"0.10"`, `"0.11"`) of jaxlib `version` (default: the installed one; a
    `.devN` or `rcN` suffix counts as its release). Raises UnsupportedJaxError naming
    SUPPORTED_RANGE for any other version, and for none installed."""
    version = jaxlib_version() if version is None else version
    release = _release(version or "")
    line = ".".join(map(str, release[:2]))
    if line not in LINES or release < MINIMUM:
        found = f"jaxlib {version}" if version else "no jaxlib"
        raise UnsupportedJaxError(
            f"looprl supports {SUPPORTED_RANGE} and found {found}: install a supported jax "
            "(`pip install -c constraints.txt -e .`), or set LOOPRL_XLA_FLAGS=0 to run "
            "without looprl's XLA flags (no bit-exactness claim holds then)")
    return line


def line() -> Line:
    """The installed jaxlib's `Line` (raises UnsupportedJaxError as `check_jaxlib`)."""
    return LINES[check_jaxlib()]


def python_supported(jax_line: str, python: tuple[int, int] | None = None) -> bool:
    """Whether jax line `jax_line`'s wheels exist for `python` (default: this interpreter)."""
    return (python or sys.version_info[:2]) >= LINES[jax_line].python


def quiet_triton_deprecation(jax_line: str | None = None) -> bool:
    """On a line whose Triton lowering warns (`Line.triton_deprecated`), ignore that one
    DeprecationWarning (by its message, in this process): looprl's GPU kernels lower through
    Triton on purpose, and a warning per compiled kernel buries the check's output. Returns
    whether the filter was added. `jax_line` defaults to the installed line."""
    if not LINES[jax_line or check_jaxlib()].triton_deprecated:
        return False
    warnings.filterwarnings("ignore", message=TRITON_DEPRECATION, category=DeprecationWarning)
    return True


def backends_started() -> bool:
    """True if jax already created its backends (then XLA_FLAGS changes have no effect)."""
    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge  # no public query exists; jax starts after the flags
        return bool(xla_bridge._backends)  # noqa: SLF001
    except Exception:  # pragma: no cover - a layout neither supported line has
        return False
