"""looprl.compat: the jax lines looprl supports, decided from a version string (0.11 by
injection, since only 0.10.2 installs here), and each shim on the jax installed here."""
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import pytest

from looprl import compat, determinism

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("version,line", [("0.10.2", "0.10"), ("0.10.7", "0.10"),
                                          ("0.11.0", "0.11"), ("0.11.2", "0.11"),
                                          ("0.11.3.dev20260801", "0.11"), ("0.11.1rc1", "0.11")])
def test_each_supported_version_has_its_line(version, line):
    assert compat.check_jaxlib(version) == line


@pytest.mark.parametrize("version", ["0.10.1", "0.9.2", "0.12.0", "1.0.0", "", "nightly"])
def test_an_unknown_jaxlib_is_an_error_naming_the_range(version):
    with pytest.raises(compat.UnsupportedJaxError) as e:
        compat.check_jaxlib(version)
    msg = str(e.value)
    assert "jaxlib >= 0.10.2, < 0.12" in msg and "LOOPRL_XLA_FLAGS=0" in msg
    assert (f"jaxlib {version}" if version else "no jaxlib") in msg


def test_the_installed_jaxlib_is_read_without_importing_it():
    assert compat.jaxlib_version() == jax.__version__ == "0.10.2"
    assert compat.check_jaxlib() == "0.10" and compat.line() == compat.LINES["0.10"]


@pytest.mark.parametrize("version", ["0.10.2", "0.11.2"])
def test_the_gpu_pins_apply_on_every_supported_line(monkeypatch, version):
    monkeypatch.setenv("XLA_FLAGS", "")
    monkeypatch.setenv("NVIDIA_TF32_OVERRIDE", "1")
    monkeypatch.delenv("LOOPRL_XLA_FLAGS", raising=False)
    determinism.configure_xla(accelerator=True, jaxlib=version)
    flags = determinism.os.environ["XLA_FLAGS"].split()
    for f in determinism.ACCELERATOR_FLAGS + determinism.REQUIRED_CPU_FLAGS:
        assert f in flags, (version, f)
    assert determinism.os.environ["NVIDIA_TF32_OVERRIDE"] == "1"  # the user's setting wins


def test_configure_xla_refuses_an_unknown_jaxlib_unless_turned_off(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "")
    monkeypatch.delenv("LOOPRL_XLA_FLAGS", raising=False)
    with pytest.raises(compat.UnsupportedJaxError, match="found jaxlib 0.12.0"):
        determinism.configure_xla(accelerator=True, jaxlib="0.12.0")
    assert determinism.os.environ["XLA_FLAGS"] == ""  # nothing half-applied
    monkeypatch.setenv("LOOPRL_XLA_FLAGS", "0")
    determinism.configure_xla(accelerator=True, jaxlib="0.12.0")
    assert determinism.os.environ["XLA_FLAGS"] == ""


def test_python_and_plugin_per_line():
    assert compat.python_supported("0.10", (3, 11)) and not compat.python_supported("0.11", (3, 11))
    assert compat.python_supported("0.11", (3, 12))
    assert compat.LINES["0.11"].cuda_plugin == "jax_cuda13_plugin"
    assert {"jax_cuda12_plugin", "jax_cuda13_plugin"} <= set(compat.GPU_PLUGINS)


def _triton_warning_shown(jax_line):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        added = compat.quiet_triton_deprecation(jax_line)
        warnings.warn(compat.TRITON_DEPRECATION + " and will be removed", DeprecationWarning)
        warnings.warn("another deprecation", DeprecationWarning)
    return added, [str(w.message) for w in seen]


def test_the_triton_deprecation_is_quiet_on_0_11_only():
    added, seen = _triton_warning_shown("0.11")
    assert added and seen == ["another deprecation"]
    added, seen = _triton_warning_shown("0.10")
    assert not added and len(seen) == 2


def test_the_triton_lowering_still_takes_triton_params_here():
    from jax.experimental.pallas import triton as pltriton

    from looprl.kernels.pallas import target as pallas_target
    params = pallas_target.compiler_params("gpu", False, gpu=dict(num_stages=1))
    assert isinstance(params, pltriton.CompilerParams) and params.num_stages == 1


def test_backends_started_after_a_computation():
    jax.numpy.zeros(1).block_until_ready()
    assert compat.backends_started() and determinism.backend_initialized()
    code = "import looprl.compat as c; print(c.backends_started())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, check=True).stdout
    assert out.strip() == "False"  # a fresh process before jax starts


def test_looprl_calls_no_uninitialized_empty():
    """jnp.empty is uninitialized from jax 0.11: no looprl module calls it."""
    hits = [str(p) for p in (ROOT / "looprl").rglob("*.py")
            if re.search(r"jnp\.empty(_like)?\(", p.read_text())]
    assert hits == []


def _import_with_jaxlib(version: str, argv0: str) -> subprocess.CompletedProcess:
    """`import looprl` in a fresh process whose jaxlib reports `version`, as `argv0`."""
    code = ("import importlib.metadata as m, sys\n"
            "real = m.version\n"
            f"m.version = lambda name: {version!r} if name == 'jaxlib' else real(name)\n"
            f"sys.argv = [{argv0!r}]\n"
            "import looprl\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "LOOPRL_XLA_FLAGS": "1"}, timeout=120)


def test_an_unsupported_jaxlib_is_one_line_for_the_command():
    out = _import_with_jaxlib("0.9.1", "/usr/bin/looprl")
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1].startswith("looprl: looprl supports jaxlib")
    assert "Traceback" not in out.stderr


def test_an_unsupported_jaxlib_is_an_exception_for_a_library_user():
    out = _import_with_jaxlib("0.12.0", "script.py")
    assert out.returncode == 1
    assert "Traceback" in out.stderr and "UnsupportedJaxError" in out.stderr
    assert "found jaxlib 0.12.0" in out.stderr
