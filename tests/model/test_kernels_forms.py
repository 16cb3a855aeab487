"""The kernel-form resolver (`looprl.kernels.forms`): `LOOPRL_KERNELS` names the form, the
platform gives the default, the older variables map onto forms, and an unknown value is a
ConfigError naming the variable, the value and the choices."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from looprl import kernels as kn
from looprl.errors import ConfigError
from looprl.kernels import forms
from looprl.kernels.tiling import CPU_ISA


@pytest.mark.parametrize("platform, env, name", [
    ("cpu", {}, "cpu-ordered"),
    ("cpu", {"LOOPRL_CPU_MATMUL": "xla"}, "cpu-xla"),
    ("cpu", {"LOOPRL_KERNELS": "pallas-tpu"}, "pallas-tpu"),  # traced for a TPU from a CPU
    ("cpu", {"LOOPRL_KERNELS": "cpu-ordered", "LOOPRL_CPU_MATMUL": "xla"}, "cpu-ordered"),
    ("gpu", {}, "pallas-gpu"),
    ("tpu", {}, "pallas-tpu"),
    ("gpu", {"LOOPRL_ACCEL_MATMUL": "pallas"}, "pallas-gpu"),
    ("tpu", {"LOOPRL_ACCEL_MATMUL": "pallas"}, "pallas-tpu"),
    ("gpu", {"LOOPRL_KERNELS": "stock"}, "stock"),
])
def test_the_form_comes_from_the_environment_or_the_platform(platform, env, name):
    assert forms.resolve(platform, env).name == name


def test_the_accelerator_forms_of_a_platform():
    assert forms.accelerator_forms("gpu") == ("pallas-gpu",)
    assert forms.accelerator_forms("tpu") == ("pallas-tpu",)
    assert forms.accelerator_forms("cpu") == ("pallas-gpu",)  # interpreted on a CPU


def test_an_unknown_form_names_the_variable_the_value_and_the_choices():
    with pytest.raises(ConfigError, match="LOOPRL_KERNELS='cuda': expected one of cpu-ordered, "
                                          "cpu-xla, pallas-gpu, pallas-tpu, stock"):
        forms.resolve("cpu", {"LOOPRL_KERNELS": "cuda"})
    with pytest.raises(ConfigError, match="LOOPRL_KERNELS='cpu-ordered' runs on XLA CPU only"):
        forms.resolve("gpu", {"LOOPRL_KERNELS": "cpu-ordered"})


def test_kernel_versions_are_the_recorded_ones():
    """Committed rollouts verify against these strings: they must not change."""
    isa = "" if CPU_ISA == "avx512_core" else f"/{CPU_ISA}"
    versions = {n: f.kernel_version() for n, f in kn.FORMS.items()}
    assert versions == {"cpu-ordered": "2026-12-03-ordered" + isa, "cpu-xla": "2026-12-03" + isa,
                        "pallas-gpu": "2026-12-05-accel/pallas-gpu-interpret",
                        "pallas-tpu": "2026-12-05-accel/pallas-tpu-interpret", "stock": "stock"}


def test_use_form_selects_a_form_for_its_scope_only():
    before = kn.current_form().name
    with kn.use_form("pallas-gpu") as form:
        assert kn.current_form() is form and kn.row_tile() == kn.ROW_TILE
        assert not kn.reads_layers_in_place()
    assert kn.current_form().name == before
    with pytest.raises(ConfigError, match="form='gpu'"):
        with kn.use_form("gpu"):
            pass


def test_the_stock_form_is_the_plain_product():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((5, 300)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((300, 40)), jnp.float32)
    with kn.use_form("stock"):
        jax.clear_caches()
        got = kn.matmul(x, w)
        assert kn.kernel_version() == "stock" and kn.row_tile() == 1
    jax.clear_caches()
    want = jnp.einsum("mk,kn->mn", x, w, preferred_element_type=jnp.float32)
    assert np.array_equal(np.asarray(got).view(np.uint32), np.asarray(want).view(np.uint32))
