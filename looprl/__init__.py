"""looprl: bit-exact RL (GRPO) for looped language models (Ouro and its kind)."""
__version__ = "0.2.0"

import sys as _sys  # noqa: E402

from looprl.compat import UnsupportedJaxError as _UnsupportedJaxError  # noqa: E402
from looprl.determinism import configure_xla as _configure_xla  # noqa: E402


def _run_as_cli() -> bool:
    """Whether this process is the `looprl` command (the script or `python -m looprl.cli`)."""
    script = _sys.argv[0].rsplit("/", 1)[-1] if _sys.argv else ""
    return script == "looprl" or "looprl.cli" in getattr(_sys, "orig_argv", [])


try:
    _configure_xla()  # before jax creates its backend: see looprl/determinism.py
except _UnsupportedJaxError as _e:
    if _run_as_cli():  # the command says it in one line; a library user gets the exception
        raise SystemExit(f"looprl: {_e}") from None
    raise

from looprl.errors import (  # noqa: E402
    CheckpointError,
    ConfigError,
    LooprlError,
    SamplingError,
    ScheduleError,
    TaskError,
)


def load_hf(path, dtype="float32", **kw):
    """Load an HF-format Ouro directory (`config.json` + safetensors) as a `LoopedLM`.

    Parameters are held in fp32 when dtype is float32, and compute runs in `dtype`
    (`float32` or `bfloat16`). See `looprl.io.hf.load_hf`. Imported lazily, so that
    `import looprl` stays light and sets XLA's flags before jax starts."""
    from looprl.io.hf import load_hf as _load_hf
    return _load_hf(path, dtype=dtype, **kw)


def version_lines() -> list[str]:
    """What `looprl --version` prints: looprl's version and the git commit it runs from (with
    `dirty` when tracked files differ), jax/jaxlib, and the kernel version the sampler records
    with the backend and CPU ISA (`looprl.kernels.kernel_version`). Imports jax."""
    import jax
    import jaxlib

    from looprl.determinism import cpu_isa, git_commit
    from looprl.kernels import kernel_version
    git = git_commit()
    commit = git["git_commit"] or "no git checkout"
    dirty = ", dirty" if git["git_dirty"] else ""
    return [f"looprl {__version__} (commit {commit}{dirty})",
            f"jax {jax.__version__}, jaxlib {jaxlib.__version__}",
            f"kernel version {kernel_version()} (backend {jax.default_backend()}, CPU ISA "
            f"{cpu_isa()})"]


__all__ = ["load_hf", "version_lines", "LooprlError", "ConfigError", "CheckpointError",
           "ScheduleError", "SamplingError", "TaskError"]
