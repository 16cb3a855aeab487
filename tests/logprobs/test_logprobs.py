"""Learner log-probs (looprl.logprobs.methods) against the sampler, bit for bit
(docs/DESIGN.md §4-5).

Every claim compares raw fp32 bits (as uint32) of log-probs at sampled positions. Threads are
pinned by tests/conftest.py (XLA_FLAGS=--xla_cpu_multi_thread_eigen=false).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from looprl.logprobs import batch_logprobs, sequence_logprobs
from looprl.verify.matrix import compare_logprobs, updated_params
from looprl.model.config import preset
from looprl.model.looped import init_params
from looprl.sampling.sampler import SamplingConfig, generate

CFG = preset("tiny", vocab_size=32, hidden_size=64, intermediate_size=128, num_heads=2,
             num_kv_heads=2, head_dim=32)
PROMPTS = [[5, 9, 3, 7, 11], [4, 6, 8]]
T = CFG.total_ut_steps
Q = 0.6


@pytest.fixture(scope="module")
def params():
    p = init_params(CFG, 0)
    p["early_exit_gate"]["bias"] = jnp.array([-0.3])  # lambda ~ 0.4: most tokens exit early
    return jax.tree.map(np.asarray, p)


_ROLLOUTS = {}


def _rollout(params, dtype, policy):
    key = (dtype, policy)
    if key not in _ROLLOUTS:
        scfg = SamplingConfig(max_new_tokens=14, exit_threshold=Q, kv_policy=policy,
                              compute_dtype=dtype, deferred_max_pending=3)
        _ROLLOUTS[key] = generate(CFG, params, PROMPTS, scfg, group_size=2, seed=1)
    return _ROLLOUTS[key]


def _exact(lp, ref, mask):
    return compare_logprobs(lp, ref, mask)["exact_fraction"]


FAST = {("float32", "copy"), ("bfloat16", "deferred")}  # dense, early exits: test_small_dims_exact
CELLS = [pytest.param(d, p, marks=[] if (d, p) in FAST else [pytest.mark.slow])
         for d in ("float32", "bfloat16") for p in ("dense", "deferred", "copy")]


@pytest.mark.parametrize("dtype, policy", CELLS)
def test_replay_equals_sampler_bits_any_batching_and_at_updated_params(params, dtype, policy):
    rb = _rollout(params, dtype, policy)
    mask = rb.exit_loop_BxS > 0
    assert mask.sum() >= 40 and (rb.exit_loop_BxS[mask] < T).mean() >= 0.2
    ref = rb.logprob_BxS
    # the rollout's own batching
    lp, _ = batch_logprobs(CFG, params, rb, "replay")
    assert _exact(lp, ref, mask) == 1.0
    # another minibatch size (3 of 4 rows) in permuted order
    rows = np.array([3, 0, 2])
    lp, _ = batch_logprobs(CFG, params, rb, "replay", rows=rows)
    assert _exact(lp, ref[rows], mask[rows]) == 1.0
    # one optimizer step later: replay without stored log-probs vs the forced sampler
    params_u = updated_params(CFG, params, rb, 1e-3, seed=0)
    forced = generate(CFG, params_u, PROMPTS, SamplingConfig(
        max_new_tokens=14, exit_threshold=Q, kv_policy=policy, compute_dtype=dtype,
        deferred_max_pending=3), forced=rb)
    np.testing.assert_array_equal(forced.exit_loop_BxS, rb.exit_loop_BxS)
    assert _exact(forced.logprob_BxS, ref, mask) < 0.5  # the parameters really moved
    lp, _ = batch_logprobs(CFG, params_u, rb.without_logprobs(), "replay", rows=rows)
    assert _exact(lp, forced.logprob_BxS[rows], mask[rows]) == 1.0


def test_hybrid_value_is_replay_and_gradient_is_dense_bit_for_bit(params):
    rb = _rollout(params, "float32", "deferred")
    args = (jnp.asarray(rb.tokens_BxS), jnp.asarray(rb.pad_B), jnp.asarray(rb.exit_loop_BxS),
            jnp.asarray(rb.kv_depth_BxS()))
    adv = jnp.asarray([1.0, -1.0, 0.5, -0.25])

    def lp(p, method):
        return sequence_logprobs(CFG, p, *args, kv_policy="deferred", compute_dtype="float32",
                                 temperature=1.0, method=method)[0]

    def loss(p, method):
        return jnp.sum(lp(p, method) * adv[:, None])

    @jax.jit
    def both(p):
        return (lp(p, "hybrid"), lp(p, "replay"), jax.grad(loss)(p, "hybrid"),
                jax.grad(loss)(p, "dense"))

    hyb, rep, g_h, g_d = both(params)
    np.testing.assert_array_equal(_u32(hyb), _u32(rep))
    np.testing.assert_array_equal(_u32(hyb), _u32(rb.logprob_BxS))
    for a, b in zip(jax.tree.leaves(g_h), jax.tree.leaves(g_d)):
        np.testing.assert_array_equal(_u32(a), _u32(b))
    assert any(float(jnp.abs(a).max()) > 0 for a in jax.tree.leaves(g_h))


def _u32(x):
    return np.asarray(x, np.float32).view(np.uint32)


def test_dense_gradient_agrees_with_central_finite_difference(params):
    rb = _rollout(params, "float32", "copy")
    args = (jnp.asarray(rb.tokens_BxS), jnp.asarray(rb.pad_B), jnp.asarray(rb.exit_loop_BxS),
            jnp.asarray(rb.kv_depth_BxS()))

    @jax.jit
    def loss(p):
        lp = sequence_logprobs(CFG, p, *args, kv_policy="copy", compute_dtype="float32",
                               temperature=1.0, method="dense")[0]
        return jnp.sum(lp) / 10.0

    p32 = jax.tree.map(jnp.asarray, params)
    grads = jax.grad(loss)(p32)
    eps = 1e-2
    picks = [("lm_head", (3, 5)), ("layers", "q_proj", (0, 1, 2)), ("layers", "down_proj",
             (1, 7, 4)), ("embed_tokens", (int(rb.tokens_BxS[0, 2]), 0)),
             ("early_exit_gate", "kernel", (2, 0))]
    for path in picks:
        *keys, idx = path

        def shifted(delta):
            p = jax.tree.map(lambda a: a, p32)
            node = p
            for k in keys[:-1]:
                node = node[k]
            node[keys[-1]] = node[keys[-1]].at[idx].add(delta)
            return float(loss(p))

        fd = (shifted(eps) - shifted(-eps)) / (2 * eps)
        g = grads
        for k in keys:
            g = g[k]
        np.testing.assert_allclose(float(g[idx]), fd, rtol=0.05, atol=2e-4, err_msg=str(path))


@pytest.mark.parametrize("policy", [pytest.param("dense", marks=pytest.mark.slow), "copy"])
def test_stock_negative_control_mismatches_bits_but_within_1e4(params, policy):
    rb = _rollout(params, "float32", policy)
    mask = rb.exit_loop_BxS > 0
    assert (rb.exit_loop_BxS[mask] < T).mean() >= 0.2  # an early-exit schedule
    for rows in (None, np.array([2, 0, 3])):
        ref = rb.logprob_BxS if rows is None else rb.logprob_BxS[rows]
        m = mask if rows is None else mask[rows]
        lp, _ = batch_logprobs(CFG, params, rb, "stock", rows=rows)
        c = compare_logprobs(lp, ref, m)
        assert c["exact_fraction"] < 1.0
        assert c["max_abs_diff"] <= 1e-4


def test_stock_runs_on_the_given_seq_len_and_defaults_to_the_exact_live_prefix(params,
                                                                               monkeypatch):
    """The learner hands the stock control its bucketed live prefix (one compiled length per
    bucket, not one per longest completion); called alone it trims to the exact live prefix."""
    from looprl.logprobs import methods as lp_mod
    rb = _rollout(params, "float32", "copy")
    S, P = rb.schedule.seq_len, rb.schedule.prompt_len
    seen = []
    real = lp_mod._jit_logprobs

    def spy(params, tokens, *args, **kw):
        seen.append((kw["method"], tokens.shape[1]))
        return real(params, tokens, *args, **kw)

    monkeypatch.setattr(lp_mod, "_jit_logprobs", spy)
    for seq_len in (None, P + 2, S):
        lp, lpp = batch_logprobs(CFG, params, rb, "stock", seq_len=seq_len)
        assert lp.shape == lpp.shape == (len(rb.pad_B), S)
        if seq_len is not None and seq_len < S:  # padded back with zeros past the prefix
            assert not lp[:, seq_len:].any() and lp[:, :seq_len].any()
    assert seen == [("stock", lp_mod.live_seq_len(rb, 1)), ("stock", P + 2), ("stock", S)]
    batch_logprobs(CFG, params, rb, "dense")
    assert seen[-1] == ("dense", S)  # the other methods default to the whole layout


@pytest.mark.slow
def test_copy_fp32_replay_exact_at_verify_shapes():
    """Guards the XLA CPU fusion-emitter bug (looprl.determinism): the fp32 `copy` learner
    program differed from the sampler in low bits for ~30 % of tokens before the flag."""
    cfg = preset("tiny")
    p = jax.tree.map(np.asarray, init_params(cfg, 0))
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(3, 60, size=n)) for n in (5, 3, 9, 7)]
    rb = generate(cfg, p, prompts, SamplingConfig(max_new_tokens=24, exit_threshold=0.85,
                                                  kv_policy="copy"), group_size=2, seed=1)
    lp, _ = batch_logprobs(cfg, p, rb, "replay")
    assert _exact(lp, rb.logprob_BxS, rb.exit_loop_BxS > 0) == 1.0
