"""The one teacher-forced loop (`looprl.model.looped.teacher_forced_loops`) and its helpers:
each claim checks a hand-computed value or raw-bit equality with the loop written out."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from looprl.model import looped
from looprl.model.config import preset
from looprl.model.layers import stack_pass

CFG = preset("tiny", vocab_size=32, hidden_size=64, intermediate_size=128, num_heads=2,
             num_kv_heads=1, head_dim=32, num_layers=1)
TOKENS = jnp.asarray([[5, 9, 3, 7, 11, 4], [0, 0, 4, 6, 8, 2]], jnp.int32)
PAD = jnp.asarray([0, 2], jnp.int32)


@pytest.fixture(scope="module")
def w():
    return looped.cast_weights(looped.init_params(CFG, 3), "float32")


def test_next_token_targets_shift_left_and_end_in_zero():
    t = jnp.asarray([[5, 6, 7], [8, 9, 10]], jnp.int32)
    got = np.asarray(looped.next_token_targets(t))
    np.testing.assert_array_equal(got, [[6, 7, 0], [9, 10, 0]])
    assert got.dtype == np.int32


def test_gate_logits_is_h_dot_kernel_plus_bias():
    w = {"early_exit_gate": {"kernel": jnp.asarray([[0.5], [0.25]]), "bias": jnp.asarray([0.125])}}
    h = jnp.asarray([[[1.0, 2.0], [-4.0, 8.0]]])  # [B=1, S=2, D=2]
    np.testing.assert_array_equal(np.asarray(looped.gate_logits(w, h)), [[1.125, 0.125]])


def _written_out(w, tokens, pad, kv_depth=None):
    """The T loops as a plain Python loop over `stack_pass` (every loop's h)."""
    B, S = tokens.shape
    shape = (CFG.num_layers, B, S, CFG.num_kv_heads, CFG.head_dim)
    positions = looped.Layout(pad).positions(S)
    h = looped.embed(w, tokens)
    k = v = jnp.zeros(shape, jnp.float32)
    hs = []
    for d in range(1, CFG.total_ut_steps + 1):
        if kv_depth is None:
            write, k_in, v_in = jnp.ones((B, S), bool), jnp.zeros(shape), jnp.zeros(shape)
        else:
            write, k_in, v_in = d <= kv_depth, k, v
        h, k, v = stack_pass(CFG, w, h, positions, jnp.arange(S), pad, k_in, v_in, write, 0)
        hs.append(h)
    return jnp.stack(hs)


@pytest.mark.parametrize("copy", [pytest.param(False, marks=pytest.mark.slow), True])
def test_unrolled_loop_is_stack_pass_applied_T_times_bit_for_bit(w, copy):
    kv_depth = jnp.asarray([[1, 2, 3, 4, 1, 2], [4, 4, 1, 3, 2, 1]], jnp.int32) if copy else None
    got = jax.jit(lambda w: looped.teacher_forced_loops(
        CFG, w, TOKENS, PAD, readout=lambda h, d: h, kv_depth_BxS=kv_depth, unroll=True))(w)
    ref = jax.jit(lambda w: _written_out(w, TOKENS, PAD, kv_depth))(w)
    assert got.shape == (CFG.total_ut_steps, 2, 6, CFG.hidden_size)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint32), np.asarray(ref).view(np.uint32))


def test_scan_and_unrolled_forms_agree_and_fold_sees_every_loop_in_order(w):
    ref = np.asarray(jax.jit(lambda w: _written_out(w, TOKENS, PAD))(w))
    scanned = jax.jit(lambda w: looped.teacher_forced_loops(
        CFG, w, TOKENS, PAD, readout=lambda h, d: h, unroll=False))(w)
    np.testing.assert_allclose(np.asarray(scanned), ref, rtol=0, atol=1e-5)
    # fold: the loop indices d = 1..T arrive in order; the carry starts from init(h0)
    for unroll in (False, True):
        total = looped.teacher_forced_loops(
            CFG, w, TOKENS, PAD, fold=lambda c, h, y, d: c * 10 + d,
            init=lambda h0: jnp.zeros((), jnp.int32), unroll=unroll)
        assert int(total) == 1234


def test_readouts_are_stacked_as_a_pytree_and_none_without_one(w):
    lam, n = looped.teacher_forced_loops(
        CFG, w, TOKENS, PAD, unroll=True,
        readout=lambda h, d: (looped.exit_lambda(w, h), jnp.asarray(d, jnp.int32)))
    assert lam.shape == (CFG.total_ut_steps, 2, 6)
    np.testing.assert_array_equal(np.asarray(n), [1, 2, 3, 4])
    assert looped.teacher_forced_loops(CFG, w, TOKENS, PAD, unroll=True) is None
