"""GRPO math against hand-computed values (looprl.rl.grpo)."""
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from looprl.rl import grpo, losses

F32 = np.float32


# --- advantages -----------------------------------------------------------------------------------

def test_all_equal_group_gives_zero_advantages_and_is_counted():
    rewards = jnp.array([[1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    out = grpo.group_advantages(rewards)
    np.testing.assert_array_equal(out.advantages_NxG[:2], np.zeros((2, 4), F32))
    np.testing.assert_array_equal(out.degenerate_N, [True, True, False])
    assert int(out.num_degenerate) == 2


def test_seven_rewards_of_035_give_exactly_zero_advantages():
    rewards = jnp.full((1, 7), 0.35, jnp.float32)
    # fp32 round-off: the mean computed as sum / 7 is not 0.35, so r - mean is not 0.
    assert float(rewards.sum() / 7) != float(F32(0.35))
    out = jax.jit(grpo.group_advantages)(rewards)
    np.testing.assert_array_equal(out.advantages_NxG, np.zeros((1, 7), F32))
    assert int(out.num_degenerate) == 1
    # Also with Dr.GRPO (no std division), where r - mean alone would be round-off noise.
    out = grpo.group_advantages(rewards, scale_by_std=False)
    np.testing.assert_array_equal(out.advantages_NxG, np.zeros((1, 7), F32))


def test_std_floor_zeroes_a_group_that_differs_only_by_round_off():
    """0.35 reached by different float paths differs in the last bit: std ~1e-8, which the
    floor treats as 0 (without it the advantages would be +-1-sized noise)."""
    r = np.full((1, 7), F32(0.35))
    r[0, 3] = np.nextafter(F32(0.35), F32(1.0))
    no_floor = grpo.group_advantages(jnp.asarray(r), std_floor=0.0).advantages_NxG
    assert float(jnp.max(jnp.abs(no_floor))) > 0.3
    out = grpo.group_advantages(jnp.asarray(r))
    np.testing.assert_array_equal(out.advantages_NxG, np.zeros((1, 7), F32))
    assert bool(out.degenerate_N[0])


def test_group_of_one_gives_zero_not_nan():
    out = grpo.group_advantages(jnp.array([[0.7], [0.0]]))
    np.testing.assert_array_equal(out.advantages_NxG, np.zeros((2, 1), F32))
    assert int(out.num_degenerate) == 2
    out = grpo.group_advantages(jnp.array([[0.7]]), scale_by_std=False)
    np.testing.assert_array_equal(out.advantages_NxG, np.zeros((1, 1), F32))


def test_normal_group_hand_values_ddof1_ddof0_and_dr_grpo():
    r = jnp.array([[1.0, 0.0, 0.0, 0.0]])
    # mean 0.25; centred [0.75, -0.25, -0.25, -0.25]; sum of squares 0.75.
    # ddof=1 (default): var 0.75 / 3 = 0.25, std 0.5 -> [1.5, -0.5, -0.5, -0.5] (exact in fp32).
    np.testing.assert_array_equal(grpo.group_advantages(r).advantages_NxG,
                                  [[1.5, -0.5, -0.5, -0.5]])
    # ddof=0: var 0.1875, std sqrt(3)/4 -> [sqrt(3), -1/sqrt(3), ...].
    s3 = math.sqrt(3.0)
    np.testing.assert_allclose(grpo.group_advantages(r, ddof=0).advantages_NxG,
                               [[s3, -1 / s3, -1 / s3, -1 / s3]], rtol=1e-6)
    # Dr.GRPO: no std division.
    np.testing.assert_array_equal(grpo.group_advantages(r, scale_by_std=False).advantages_NxG,
                                  [[0.75, -0.25, -0.25, -0.25]])


# --- aggregation ------------------------------------------------------------------------------------

def _ten_and_hundred():
    loss = np.zeros((2, 100), F32)
    mask = np.zeros((2, 100), F32)
    loss[0, :10] = 1.0
    mask[0, :10] = 1.0
    mask[1, :] = 1.0
    loss[0, 10:] = np.nan                            # padding garbage must not leak
    return jnp.asarray(loss), jnp.asarray(mask)


@pytest.mark.parametrize("mode,expected", [
    ("token-mean", F32(10) / F32(110)),              # 10 tokens of loss 1 over 110 tokens
    ("seq-mean-token-mean", F32(0.5)),               # (1 + 0) / 2 sequences
    ("dr-grpo", F32(10) / F32(200)),                 # 10 / (max_new_tokens 100 * 2 sequences)
])
@pytest.mark.parametrize("split", [[[0, 1]], [[0], [1]], [[1], [0]], [[1, 0]]])
def test_aggregation_is_independent_of_the_microbatch_split(mode, expected, split):
    loss, mask = _ten_and_hundred()
    norm = grpo.loss_normalizer(mask, mode, max_new_tokens=100)
    total = F32(0)
    for rows in split:
        rows = np.array(rows)
        total = total + grpo.aggregate_loss(loss[rows], mask[rows], mode, norm)
    assert float(total) == float(expected)


@pytest.mark.parametrize("mode", grpo.AGG_MODES)
def test_microbatch_gradients_add_up_to_the_full_batch_gradient(mode):
    _, mask = _ten_and_hundred()
    lp = jnp.asarray(np.random.default_rng(0).normal(size=(2, 100)).astype(F32)) - 2.0
    adv = jnp.array([1.0, -0.5])
    norm = grpo.loss_normalizer(mask, mode, max_new_tokens=100)

    def f(lp, adv, mask):
        loss, _ = losses.ppo_clip_loss(lp, jax.lax.stop_gradient(lp), adv, mask)
        return grpo.aggregate_loss(loss, mask, mode, norm)

    full = jax.grad(f)(lp, adv, mask)
    parts = jnp.concatenate([jax.grad(f)(lp[i:i + 1], adv[i:i + 1], mask[i:i + 1])
                             for i in range(2)])
    np.testing.assert_array_equal(full, parts)


def test_unknown_aggregation_mode_and_dr_grpo_without_length_raise():
    _, mask = _ten_and_hundred()
    with pytest.raises(ValueError, match="unknown mode"):
        grpo.loss_normalizer(mask, "sum")
    with pytest.raises(ValueError, match="max_new_tokens"):
        grpo.loss_normalizer(mask, "dr-grpo")


# --- KL ---------------------------------------------------------------------------------------------

def test_k3_kl_hand_values_and_gradient():
    cur = jnp.array([[math.log(0.5), math.log(0.5), -1.0, jnp.nan]])
    ref = jnp.array([[math.log(0.25), math.log(1.0), -1.0, 0.0]])
    mask = jnp.array([[1.0, 1.0, 1.0, 0.0]])
    kl = grpo.k3_kl(cur, ref, mask)
    # x = ref - cur: log 0.5 -> 0.5 - log 0.5 - 1 = 0.19314718; log 2 -> 2 - log 2 - 1 = 0.30685282.
    np.testing.assert_allclose(kl, [[0.5 + math.log(2) - 1, 1 - math.log(2), 0.0, 0.0]], rtol=1e-6)
    assert kl.dtype == jnp.float32
    g = jax.grad(lambda c: jnp.sum(grpo.k3_kl(c, ref, mask)))(jnp.where(mask > 0, cur, 0.0))
    np.testing.assert_allclose(g, [[0.5, -1.0, 0.0, 0.0]], rtol=1e-6)  # 1 - exp(ref - cur)


# --- loop credit ------------------------------------------------------------------------------------

EXITS = jnp.array([[0, 1, 2, 3, 4]])


def test_loop_credit_uniform_and_none():
    w = grpo.loop_credit_weights(EXITS, 4, "uniform")
    chex.assert_shape(w, (4, 1, 5))
    expected = np.array([[0, 0, 0, 0], [1, 0, 0, 0], [.5, .5, 0, 0], [1 / 3, 1 / 3, 1 / 3, 0],
                         [.25, .25, .25, .25]], F32).T[:, None, :]
    np.testing.assert_allclose(w, expected, rtol=1e-6)
    np.testing.assert_allclose(jnp.sum(w, 0), [[0, 1, 1, 1, 1]], rtol=1e-6)
    none = grpo.loop_credit_weights(EXITS, 4, "none")
    np.testing.assert_array_equal(none[:, 0, :], np.eye(5, dtype=F32)[1:, :])


def test_loop_credit_progressive():
    w = grpo.loop_credit_weights(EXITS, 4, "progressive", alpha=1.0)
    np.testing.assert_allclose(w[:, 0, 2], [1 / 3, 2 / 3, 0, 0], rtol=1e-6)
    np.testing.assert_allclose(w[:, 0, 4], [0.1, 0.2, 0.3, 0.4], rtol=1e-6)
    w2 = grpo.loop_credit_weights(EXITS, 4, "progressive", alpha=2.0)
    np.testing.assert_allclose(w2[:, 0, 3], [1 / 14, 4 / 14, 9 / 14, 0], rtol=1e-6)


def test_loop_credit_exit_dist_renormalises_stops_gradient_and_falls_back():
    p = jnp.broadcast_to(jnp.array([0.1, 0.3, 0.2, 0.4])[:, None, None], (4, 1, 5))
    w = grpo.loop_credit_weights(EXITS, 4, "exit_dist", exit_probs_TxBxS=p)
    np.testing.assert_allclose(w[:, 0, 2], [0.25, 0.75, 0, 0], rtol=1e-6)
    np.testing.assert_allclose(w[:, 0, 4], [0.1, 0.3, 0.2, 0.4], rtol=1e-6)
    g = jax.grad(lambda p: jnp.sum(grpo.loop_credit_weights(EXITS, 4, "exit_dist",
                                                            exit_probs_TxBxS=p) ** 2))(p)
    np.testing.assert_array_equal(g, np.zeros_like(g))
    all_late = jnp.broadcast_to(jnp.array([0.0, 0.0, 0.0, 1.0])[:, None, None], (4, 1, 5))
    w = grpo.loop_credit_weights(EXITS, 4, "exit_dist", exit_probs_TxBxS=all_late)
    np.testing.assert_array_equal(w[:, 0, 2], [0, 1, 0, 0])   # one-hot at the exit loop


def test_loop_credit_logprobs_ignore_uncomputed_loops():
    lp = jnp.array([-1.0, -2.0, -jnp.inf, jnp.nan])[:, None, None]
    w = grpo.loop_credit_weights(jnp.array([[2]]), 4, "uniform")
    out = grpo.loop_credit_logprobs(lp, w)
    chex.assert_shape(out, (1, 1))
    np.testing.assert_allclose(out, [[-1.5]])


# --- Ouro warm-start losses -------------------------------------------------------------------------

def _sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


def test_gate_stage2_loss_hand_value():
    # T=3, one valid position and one masked (NaN) position.
    ce = jnp.array([[[2.0, jnp.nan]], [[1.0, jnp.nan]], [[1.0, jnp.nan]]])
    z = jnp.array([[[5.0, 0.0]], [[0.0, 0.0]], [[math.log(3.0), 0.0]]])
    mask = jnp.array([[1.0, 0.0]])
    # t=2: I = 1 -> w = sigmoid(49.75) = 1 in fp32; lambda 0.5: -log(1 - 0.5) = log 2.
    # t=3: I = 0 -> w = sigmoid(-0.25); lambda 0.75: -(w log 0.25 + (1 - w) log 0.75).
    w3 = _sigmoid(-0.25)
    t3 = -(w3 * math.log(0.25) + (1 - w3) * math.log(0.75))
    expected = (math.log(2.0) + t3) / 2
    got = grpo.gate_stage2_loss(ce, mask, gate_logits_TxBxS=z)
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    got_lam = grpo.gate_stage2_loss(ce, mask, exit_lambda_TxBxS=jax.nn.sigmoid(z))
    np.testing.assert_allclose(got_lam, expected, rtol=1e-5)
    # CE is detached: only the gate gets a gradient.
    g_ce = jax.grad(lambda c: grpo.gate_stage2_loss(c, mask, gate_logits_TxBxS=z))(
        jnp.nan_to_num(ce))
    np.testing.assert_array_equal(g_ce, np.zeros_like(g_ce))


def test_gate_stage2_loss_is_finite_for_saturated_logits():
    ce = jnp.array([[[1.0]], [[1.0]]])
    z = jnp.array([[[0.0]], [[40.0]]])     # lambda rounds to 1.0 in fp32
    loss, g = jax.value_and_grad(
        lambda z: grpo.gate_stage2_loss(ce, jnp.ones((1, 1)), gate_logits_TxBxS=z))(z)
    w = _sigmoid(-0.25)
    np.testing.assert_allclose(loss, w * 40.0 + (1 - w) * math.log1p(math.exp(-40.0)), rtol=1e-5)
    assert np.all(np.isfinite(g))


def test_exit_stage1_loss_hand_value():
    ce = jnp.array([[[2.0, 3.0]], [[1.0, 7.0]]])           # [T=2, B=1, S=2]
    p = jnp.array([[[0.25, 1.0]], [[0.75, 0.0]]])
    mask = jnp.ones((1, 2))
    # pos 0: 0.25*2 + 0.75*1 = 1.25; H = -(0.25 ln 0.25 + 0.75 ln 0.75). pos 1: 3, H = 0.
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    expected = ((1.25 - 0.1 * h) + 3.0) / 2
    got = grpo.exit_stage1_loss(ce, p, mask, entropy_beta=0.1)
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    g = jax.grad(lambda p: grpo.exit_stage1_loss(ce, p, mask, entropy_beta=0.1))(p)
    assert np.all(np.isfinite(g))


def test_every_configured_mode_is_implemented():
    """The config's choices (`grpo.loss_agg`, `grpo.loop_credit`) are the modes the math takes."""
    import typing

    from looprl import config
    assert typing.get_args(config.LossAgg) == grpo.AGG_MODES
    assert typing.get_args(config.LoopCredit) == grpo.LOOP_CREDIT_MODES
    mask = jnp.asarray([[1, 1, 0], [1, 0, 0]], jnp.float32)
    for mode in grpo.AGG_MODES:
        norm = grpo.loss_normalizer(mask, mode, max_new_tokens=3)
        assert np.isfinite(float(grpo.aggregate_loss(jnp.ones((2, 3)), mask, mode, norm)))
    exit_loop = jnp.asarray([[2, 1, 0]], jnp.int32)
    probs = jnp.full((3, 1, 3), 1 / 3, jnp.float32)
    for mode in grpo.LOOP_CREDIT_MODES:
        w = grpo.loop_credit_weights(exit_loop, 3, mode, exit_probs_TxBxS=probs)
        np.testing.assert_allclose(np.asarray(w).sum(axis=0), [[1, 1, 0]], rtol=1e-6)
