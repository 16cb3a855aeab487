"""The policy losses of `grpo.loss` (looprl.rl.losses): hand-computed values, gradients against
independent formulas and finite differences, and their composition with the aggregation modes
and TIS."""
import dataclasses
import math
import typing

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from looprl.config import sections
from looprl.rl import grpo, losses
from looprl.rl.losses import LOSSES, LossSettings, policy_token_loss

F32 = np.float32


def _total(loss, lp, old, adv, mask, agg="seq-mean-token-mean", **kw):
    """The aggregated scalar loss and its gradient with respect to `lp`."""
    norm = grpo.loss_normalizer(mask, agg, max_new_tokens=mask.shape[1])

    def f(x):
        per_token, stats = policy_token_loss(loss, x, old, adv, mask, **kw)
        return grpo.aggregate_loss(per_token, mask, agg, norm), stats
    (value, stats), g = jax.value_and_grad(f, has_aux=True)(lp)
    return float(value), np.asarray(g, np.float64), stats


def test_cispo_hand_computed_value_weight_truncation_and_gradient():
    # ratios pi/pi_old: 0.5/0.25 = 2 and 0.2/0.4 = 0.5; weight truncated at 1.5 -> [1.5, 0.5]
    lp = jnp.log(jnp.array([[0.5, 0.2]], jnp.float32))
    old = jnp.log(jnp.array([[0.25, 0.4]], jnp.float32))
    adv, mask = jnp.array([2.0]), jnp.ones((1, 2), bool)
    per_token, stats = policy_token_loss("cispo", lp, old, adv, mask, cispo_clip_high=1.5)
    # -w A log pi: -1.5 * 2 * log 0.5 = 3 log 2; -0.5 * 2 * log 0.2 = log 5
    np.testing.assert_allclose(per_token, [[3 * math.log(2), math.log(5)]], rtol=1e-6)
    assert float(stats["clip_frac_high"]) == 0.5 and float(stats["clip_frac_low"]) == 0.0
    assert float(stats["ratio_max"]) == pytest.approx(2.0, rel=1e-6)
    # token-mean over 2 tokens: d/d log pi_t = -w_t A / 2 = [-1.5, -0.5]; the weight is constant
    value, g, _ = _total("cispo", lp, old, adv, mask, agg="token-mean", cispo_clip_high=1.5)
    assert value == pytest.approx((3 * math.log(2) + math.log(5)) / 2, rel=1e-6)
    np.testing.assert_allclose(g, [[-1.5, -0.5]], rtol=1e-6)
    # a low bound of 0.8 lifts the second weight: its gradient becomes -0.8 * 2 / 2
    _, g, stats = _total("cispo", lp, old, adv, mask, agg="token-mean", cispo_clip_low=0.8,
                         cispo_clip_high=1.5)
    np.testing.assert_allclose(g, [[-1.5, -0.8]], rtol=1e-6)
    assert float(stats["clip_frac"]) == 1.0


def test_gspo_hand_computed_sequence_ratio_clip_and_gradient():
    # token log-ratios 0.2 and 0.0: s = exp(0.1) on both tokens
    old = jnp.zeros((1, 2), jnp.float32) - 1.0
    lp = old + jnp.array([[0.2, 0.0]], jnp.float32)
    mask = jnp.ones((1, 2), bool)
    s = math.exp(0.1)
    # A = +1, eps_high 0.05: clipped at 1.05, loss -1.05, no gradient
    per_token, stats = policy_token_loss("gspo", lp, old, jnp.array([1.0]), mask, eps_low=0.05,
                                         eps_high=0.05)
    np.testing.assert_allclose(per_token, [[-1.05, -1.05]], rtol=1e-6)
    assert float(stats["ratio_mean"]) == pytest.approx(s, rel=1e-6)
    assert float(stats["clip_frac_high"]) == 1.0
    _, g, _ = _total("gspo", lp, old, jnp.array([1.0]), mask, eps_low=0.05, eps_high=0.05)
    np.testing.assert_array_equal(g, np.zeros((1, 2)))
    # A = -1: min(-s, -1.05) = -s, loss s; d/d log pi_t = -A s / n = s / 2 on each token
    value, g, _ = _total("gspo", lp, old, jnp.array([-1.0]), mask, eps_low=0.05, eps_high=0.05)
    assert value == pytest.approx(s, rel=1e-6)
    np.testing.assert_allclose(g, [[s / 2, s / 2]], rtol=1e-6)


def test_gspo_token_has_gspo_value_and_per_token_gradient():
    """GSPO-token's ratio has the value of GSPO's; with one advantage per sequence its gradient
    equals GSPO's (arXiv 2507.18071, eq. 15) under seq-mean-token-mean."""
    rng = np.random.default_rng(0)
    old = jnp.asarray(rng.normal(-2, 0.5, (3, 5)), jnp.float32)
    lp = old + jnp.asarray(rng.normal(0, 0.05, (3, 5)), jnp.float32)
    mask = jnp.asarray([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 1, 1, 0, 0]], bool)
    adv = jnp.array([1.0, -0.5, 2.0])
    tok, st_tok = policy_token_loss("gspo-token", lp, old, adv, mask, eps_low=0.2, eps_high=0.2)
    seq, st_seq = policy_token_loss("gspo", lp, old, adv, mask, eps_low=0.2, eps_high=0.2)
    np.testing.assert_allclose(tok, seq, rtol=1e-6)
    assert float(st_tok["ratio_mean"]) == pytest.approx(float(st_seq["ratio_mean"]), rel=1e-6)
    _, g_tok, _ = _total("gspo-token", lp, old, adv, mask, eps_low=0.2, eps_high=0.2)
    _, g_seq, _ = _total("gspo", lp, old, adv, mask, eps_low=0.2, eps_high=0.2)
    np.testing.assert_allclose(g_tok, g_seq, rtol=1e-5, atol=1e-7)
    assert np.abs(g_tok).max() > 0.01


def _reference_grad(loss, lp, old, adv, mask, eps, w_high):
    """Each loss's gradient by its formula, float64, under seq-mean-token-mean, away from clip
    boundaries (independent of jax)."""
    lp, old, adv, m = (np.asarray(x, np.float64) for x in (lp, old, adv, mask))
    n = m.sum(1, keepdims=True)
    nseq = float((n > 0).sum())
    a = adv[:, None]
    if loss == "ppo-clip":
        r = np.exp(lp - old)
        active = ~(((a > 0) & (r > 1 + eps)) | ((a < 0) & (r < 1 - eps)))
        return np.where(m > 0, -a * r * active / n / nseq, 0.0)
    if loss == "cispo":
        w = np.minimum(np.exp(lp - old), w_high)
        return np.where(m > 0, -w * a / n / nseq, 0.0)
    s = np.exp(((lp - old) * m).sum(1, keepdims=True) / n)
    active = ~(((a > 0) & (s > 1 + eps)) | ((a < 0) & (s < 1 - eps)))
    return np.where(m > 0, -a * s * active / n / nseq, 0.0)


@pytest.mark.parametrize("loss", LOSSES)
def test_gradient_matches_an_independent_formula_and_finite_differences(loss):
    rng = np.random.default_rng(1)
    old = rng.normal(-1.5, 0.5, (4, 6)).astype(F32)
    lp = (old + rng.choice([-0.6, -0.05, 0.04, 0.5], (4, 6))).astype(F32)  # clipped and not
    mask = (rng.random((4, 6)) < 0.8) | (np.arange(6) == 0)
    adv = np.array([1.3, -0.7, 0.4, -1.1], F32)
    kw = dict(eps_low=0.2, eps_high=0.2, cispo_clip_high=1.5)
    value, g, _ = _total(loss, jnp.asarray(lp), jnp.asarray(old), jnp.asarray(adv),
                         jnp.asarray(mask), **kw)
    ref = _reference_grad(loss, lp, old, adv, mask, 0.2, 1.5)
    np.testing.assert_allclose(g, ref, rtol=2e-5, atol=1e-7)
    assert np.count_nonzero(ref) >= 4
    if loss == "cispo":
        return  # CISPO's weight is a stop-gradient: its value is not the integral of its gradient
    h = 1e-2  # central differences of the loss itself, fp32, on three unclipped entries
    for b, t in [(b, t) for b in range(4) for t in range(6) if mask[b, t] and ref[b, t]][:3]:
        up, dn = lp.copy(), lp.copy()
        up[b, t] += h
        dn[b, t] -= h
        fd = (_total(loss, jnp.asarray(up), jnp.asarray(old), jnp.asarray(adv),
                     jnp.asarray(mask), **kw)[0]
              - _total(loss, jnp.asarray(dn), jnp.asarray(old), jnp.asarray(adv),
                       jnp.asarray(mask), **kw)[0]) / (2 * h)
        assert fd == pytest.approx(ref[b, t], rel=2e-2, abs=1e-4), (b, t)


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("agg", grpo.AGG_MODES)
def test_every_loss_composes_with_every_aggregation_mode_and_tis(loss, agg):
    """Masked positions hold exactly 0 whatever they hold (inf, NaN); TIS multiplies each
    token's loss by min(exp(old - sampler), cap); microbatch shares add up to the batch loss."""
    rng = np.random.default_rng(2)
    old = rng.normal(-1.0, 0.3, (4, 5)).astype(F32)
    lp = (old + rng.normal(0, 0.1, (4, 5))).astype(F32)
    mask = np.ones((4, 5), bool)
    mask[:, 3:] = False
    lp[:, 4] = np.nan
    old[:, 3] = -np.inf
    samp = (old + np.log(F32(2.0))).astype(F32)  # weight exp(-log 2) = 0.5, under the cap
    adv = np.array([1.0, -1.0, 0.5, 0.0], F32)
    args = [jnp.asarray(x) for x in (lp, old, adv, mask)]
    plain, _ = policy_token_loss(loss, *args)
    tis, stats = policy_token_loss(loss, *args, sampler_logprobs_BxS=jnp.asarray(samp),
                                   tis_cap=2.0)
    assert np.all(np.asarray(plain)[:, 3:] == 0) and np.all(np.isfinite(plain))
    np.testing.assert_allclose(tis, 0.5 * np.asarray(plain), rtol=1e-6)
    assert float(stats["tis_weight_mean"]) == pytest.approx(0.5, rel=1e-6)
    norm = grpo.loss_normalizer(jnp.asarray(mask), agg, max_new_tokens=5)
    whole = float(grpo.aggregate_loss(plain, jnp.asarray(mask), agg, norm))
    split = sum(float(grpo.aggregate_loss(policy_token_loss(loss, *(a[r] for a in args))[0],
                                          jnp.asarray(mask[r]), agg, norm))
                for r in (slice(0, 1), slice(1, 4)))
    assert split == pytest.approx(whole, rel=1e-6, abs=1e-7)
    assert whole != 0.0


def test_the_config_names_every_registered_loss_and_its_settings():
    """The `grpo.loss` values the config accepts are the registry's keys, and every setting a
    loss reads is a key of the `grpo` section (`LossSettings.from_section` reads it there)."""
    assert set(typing.get_args(sections.GRPOLoss)) == set(LOSSES)
    keys = {f.name for f in dataclasses.fields(sections.GRPOConfig)}
    assert {f.name for f in dataclasses.fields(LossSettings)} <= keys
    g = sections.GRPOConfig(loss="cispo", eps_low=0.1, cispo_clip_low=0.5, cispo_clip_high=2.0)
    assert LossSettings.from_section(g) == LossSettings(0.1, 0.28, 0.5, 2.0)


# --- PPO clip ---------------------------------------------------------------------------------------

def _clip_case():
    ratios = np.array([[1.5, 0.5, 1.0, 1.0], [1.5, 0.5, 1.0, 1.0]], np.float64)
    old = np.full((2, 4), -2.0, F32)
    new = (old + np.log(ratios)).astype(F32)
    new[:, 3] = np.nan                       # masked position holding garbage
    mask = np.array([[1, 1, 1, 0], [1, 1, 1, 0]], F32)
    adv = np.array([1.0, -1.0], F32)
    return jnp.asarray(new), jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask)


def test_ppo_clip_both_sides_hand_values():
    new, old, adv, mask = _clip_case()
    loss, stats = losses.ppo_clip_loss(new, old, adv, mask, eps_low=0.2, eps_high=0.28)
    # A=+1: rho 1.5 -> clipped to 1.28 -> -1.28; rho 0.5 -> unclipped -0.5; rho 1 -> -1.
    # A=-1: rho 1.5 -> unclipped +1.5; rho 0.5 -> clipped to 0.8 -> +0.8; rho 1 -> +1.
    np.testing.assert_allclose(loss, [[-1.28, -0.5, -1.0, 0.0], [1.5, 0.8, 1.0, 0.0]], rtol=1e-6)
    assert float(loss[0, 3]) == 0.0 and float(loss[1, 3]) == 0.0
    assert float(stats["tokens"]) == 6
    np.testing.assert_allclose(stats["clip_frac_high"], 1 / 6, rtol=1e-6)
    np.testing.assert_allclose(stats["clip_frac_low"], 1 / 6, rtol=1e-6)
    np.testing.assert_allclose(stats["clip_frac"], 2 / 6, rtol=1e-6)
    np.testing.assert_allclose(stats["ratio_mean"], 1.0, rtol=1e-6)
    np.testing.assert_allclose(stats["ratio_min"], 0.5, rtol=1e-6)
    np.testing.assert_allclose(stats["ratio_max"], 1.5, rtol=1e-6)
    # k3 of KL(old||new): mean of rho - 1 - log rho = (-log 1.5 - log 0.5) * 2 / 6 = -log(0.75)/3.
    np.testing.assert_allclose(stats["approx_kl"], -math.log(0.75) / 3, rtol=1e-5)


def test_ppo_clip_gradient_is_zero_exactly_on_clipped_tokens():
    new, old, adv, mask = _clip_case()
    new = jnp.where(mask > 0, new, 0.0)

    def f(lp):
        return jnp.sum(losses.ppo_clip_loss(lp, old, adv, mask, eps_low=0.2, eps_high=0.28)[0])

    g = jax.grad(f)(new)
    # d(-rho A)/d logprob = -rho A where unclipped, 0 where clipped or masked.
    np.testing.assert_allclose(g, [[0.0, -0.5, -1.0, 0.0], [1.5, 0.0, 1.0, 0.0]], rtol=1e-6)


def test_first_update_with_old_equal_stop_gradient_current_has_nonzero_gradient():
    lp = jnp.array([[-1.0, -2.0], [-0.5, -3.0]])
    adv = jnp.array([1.0, -1.0])
    mask = jnp.ones((2, 2))

    def f(lp):
        loss, _ = losses.ppo_clip_loss(lp, jax.lax.stop_gradient(lp), adv, mask)
        return grpo.aggregate_loss(loss, mask, "token-mean", grpo.loss_normalizer(mask, "token-mean"))

    value, g = jax.value_and_grad(f)(lp)
    assert float(value) == 0.0                      # ratio exactly 1, advantages cancel
    np.testing.assert_array_equal(g, [[-0.25, -0.25], [0.25, 0.25]])  # -A / 4 tokens


def test_truncated_importance_sampling_weight_caps_and_multiplies():
    lp = jnp.array([[-1.0, -1.0]])
    old = lp                                         # ratio 1 -> per-token loss -A = -1
    sampler = jnp.array([[-1.0 - math.log(3.0), -1.0 - math.log(0.5)]])  # old/sampler = 3, 0.5
    loss, stats = losses.ppo_clip_loss(lp, old, jnp.array([1.0]), jnp.ones((1, 2)),
                                       sampler_logprobs_BxS=sampler, tis_cap=2.0)
    np.testing.assert_allclose(loss, [[-2.0, -0.5]], rtol=1e-6)   # weights min(3, 2), 0.5
    np.testing.assert_allclose(stats["tis_capped_frac"], 0.5)
    np.testing.assert_allclose(stats["tis_weight_mean"], 1.25, rtol=1e-6)
    with pytest.raises(ValueError):
        losses.ppo_clip_loss(lp, old, jnp.array([1.0]), jnp.ones((1, 2)), tis_cap=2.0)


def test_ppo_clip_with_kl_and_tis_is_jit_friendly_and_equals_eager():
    new, old, adv, mask = _clip_case()

    def step(new, old, adv, mask):
        loss, stats = losses.ppo_clip_loss(new, old, adv, mask, eps_low=0.2, eps_high=0.28,
                                           sampler_logprobs_BxS=old, tis_cap=2.0)
        loss = loss + 0.1 * grpo.k3_kl(new, old, mask)
        norm = grpo.loss_normalizer(mask, "seq-mean-token-mean")
        return grpo.aggregate_loss(loss, mask, "seq-mean-token-mean", norm), stats

    eager = step(new, old, adv, mask)
    jitted = jax.jit(step)(new, old, adv, mask)
    chex.assert_trees_all_close(eager, jitted, rtol=1e-6)
    assert np.isfinite(float(jitted[0]))


def test_unknown_loss_and_half_tis_are_rejected():
    x = jnp.zeros((1, 2))
    with pytest.raises(ValueError, match="unknown loss 'ppo'"):
        policy_token_loss("ppo", x, x, jnp.zeros(1), x > -1)
    with pytest.raises(ValueError, match="both sampler_logprobs_BxS and tis_cap"):
        policy_token_loss("cispo", x, x, jnp.zeros(1), x > -1, tis_cap=2.0)
