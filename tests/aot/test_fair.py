"""The fair baselines (`looprl.aot.fair`) trace at a small config for both backends: each
program's outputs have the shapes and dtypes a caller relies on. Tracing lowers nothing, so
jax's GPU and TPU Pallas kernels need no device here."""
import jax
import pytest

from looprl.aot import fair
from looprl.aot.programs import Phase
from looprl.kernels import forms
from looprl.model.config import PRESETS

CFG = PRESETS["tiny"]


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_the_fair_learner_step_traces_to_a_loss_and_gradients(backend):
    fn, args, donate = fair.build(CFG, "bfloat16", Phase("learner_step", 2, 128, 128), backend)
    with forms.use_form("stock"):
        loss, grads = jax.eval_shape(fn, *args)
    assert loss.shape == () and donate == ()
    assert jax.tree.structure(grads) == jax.tree.structure(args[0])


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_the_fair_decode_returns_the_paged_cache_it_was_given(backend):
    fn, args, donate = fair.build(CFG, "bfloat16", Phase("decode", 2, 1, 512), backend)
    with forms.use_form("stock"):
        _, k_pages, v_pages = jax.eval_shape(fn, *args)
    assert donate == (2, 3)
    assert (k_pages.shape, k_pages.dtype) == (args[2].shape, args[2].dtype)
    assert (v_pages.shape, v_pages.dtype) == (args[3].shape, args[3].dtype)


def test_a_cache_off_the_page_is_refused():
    with pytest.raises(ValueError, match="not a multiple of 128"):
        fair.build(CFG, "bfloat16", Phase("decode", 2, 1, 200), "gpu")
