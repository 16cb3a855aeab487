"""RLTT loop credit: `loop_credit_weights` / `loop_credit_logprobs` against hand-computed arrays
(the formulas of looprl/rl/grpo.py's docstrings), `loop_logprobs` against the dense learner pass
and the PyTorch reference, and the trainer's loop-credit branch of `policy_loss`.

Hand example, T = 4, one row of four positions with exit loops 2, 4, 0 (emits nothing), 2:
- uniform: 1/k on t <= k;  progressive: t^alpha / sum_{j<=k} j^alpha;
- exit_dist: p_t (from the gates) renormalised over t <= k, one-hot at k where those p are 0;
- every mode: all 0 where k = 0; loops t > k weigh 0 whatever their log-probs hold.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from looprl.io.hf import hf_state_from_params
from looprl.logprobs import loop_logprobs, sequence_logprobs
from looprl.model.config import preset
from looprl.model.looped import exit_distribution, init_params
from looprl.reference.torch_ouro import TorchOuro
from looprl.rl.grpo import loop_credit_logprobs, loop_credit_weights
from looprl.rl.losses import LossSettings
from looprl.rl.objective import LossSpec, policy_loss

EXIT = jnp.array([[2, 4, 0, 2]], jnp.int32)
# gates per position (columns): 0.5 everywhere -> p = 1/2, 1/4, 1/8, 1/8; (0.1, 2/9, 3/7) ->
# p = 0.1, 0.2, 0.3, 0.4; (0, 0, 0.5) -> p = 0, 0, 1/2, 1/2 (nothing on t <= 2: one-hot)
LAM = jnp.array([[0.5, 0.1, 0.3, 0.0], [0.5, 2 / 9, 0.3, 0.0], [0.5, 3 / 7, 0.3, 0.5],
                 [0.5, 0.9, 0.3, 0.7]], jnp.float32)[:, None, :]
nan, inf = np.nan, np.inf
LP = jnp.array([[-1.0, -2.0, nan, -0.5], [-3.0, -4.0, nan, -1.5], [-inf, -6.0, nan, nan],
                [nan, -8.0, nan, -inf]], jnp.float32)[:, None, :]
Z = [0, 0, 0, 0]
HAND = {  # mode: (weights as columns per position, credited log-prob per position)
    "none": ([[0, 1, 0, 0], [0, 0, 0, 1], Z, [0, 1, 0, 0]], [-3, -8, 0, -1.5]),
    "uniform": ([[.5, .5, 0, 0], [.25] * 4, Z, [.5, .5, 0, 0]], [-2, -5, 0, -1]),
    "progressive": ([[1 / 3, 2 / 3, 0, 0], [.1, .2, .3, .4], Z, [1 / 3, 2 / 3, 0, 0]],
                    [-7 / 3, -6, 0, -7 / 6]),
    "exit_dist": ([[2 / 3, 1 / 3, 0, 0], [.1, .2, .3, .4], Z, [0, 1, 0, 0]],
                  [-5 / 3, -6, 0, -1.5]),
}


@pytest.mark.parametrize("mode", list(HAND))
def test_loop_credit_weights_and_logprobs_equal_the_hand_computed_arrays(mode):
    probs = exit_distribution(LAM)
    np.testing.assert_allclose(probs[:, 0, 1], [0.1, 0.2, 0.3, 0.4], rtol=1e-6)
    w = loop_credit_weights(EXIT, 4, mode, exit_probs_TxBxS=probs)
    cols, credited = HAND[mode]
    np.testing.assert_allclose(np.asarray(w)[:, 0, :], np.array(cols).T, rtol=1e-6, atol=0)
    got = loop_credit_logprobs(LP, w)
    assert np.all(np.isfinite(got)) and float(got[0, 2]) == 0.0
    np.testing.assert_allclose(np.asarray(got)[0], credited, rtol=1e-6)


def test_progressive_alpha_two_squares_the_loop_index():
    w = np.asarray(loop_credit_weights(EXIT, 4, "progressive", alpha=2.0))[:, 0, :]
    np.testing.assert_allclose(w[:, 0], [1 / 5, 4 / 5, 0, 0], rtol=1e-6)
    np.testing.assert_allclose(w[:, 1], np.array([1, 4, 9, 16]) / 30, rtol=1e-6)


# the tiny preset at smaller widths (compiles faster), T = 4
CFG = preset("tiny", vocab_size=32, hidden_size=64, intermediate_size=128, num_heads=2,
             num_kv_heads=2, head_dim=32, num_layers=1)
TOKENS = np.array([[5, 9, 3, 7, 11, 12, 13, 14], [0, 0, 4, 6, 8, 10, 20, 30]], np.int32)
PAD = np.array([0, 2], np.int32)
EXITS = np.array([[0, 0, 0, 0, 2, 4, 1, 0], [0, 0, 0, 4, 2, 3, 4, 0]], np.int32)
KV_DEPTH = np.where(np.arange(8) < 4, 4, np.maximum(EXITS, 1)).astype(np.int32)


@pytest.fixture(scope="module")
def params():
    p = init_params(CFG, 0)
    p["lm_head"] = p["lm_head"] * 8.0
    return jax.tree.map(np.asarray, p)


@pytest.fixture(scope="module")
def loops(params):
    """loop_logprobs (lp_TxBxS, gate_z_TxBxS) as numpy, dense KV policy."""
    return tuple(map(np.asarray, jax.jit(lambda p: loop_logprobs(
        CFG, p, TOKENS, PAD, EXITS, KV_DEPTH, kv_policy="dense", compute_dtype="float32",
        temperature=0.8))(params)))


def test_loop_logprobs_at_the_exit_loop_agree_with_the_dense_learner_pass(params, loops):
    lp_T, _ = loops
    dense, _ = jax.jit(lambda p: sequence_logprobs(
        CFG, p, TOKENS, PAD, EXITS, KV_DEPTH, kv_policy="dense", compute_dtype="float32",
        temperature=0.8, method="dense"))(params)
    emit = EXITS > 0
    at_exit = np.take_along_axis(np.asarray(lp_T), np.maximum(EXITS, 1)[None] - 1, 0)[0]
    np.testing.assert_allclose(at_exit[emit], np.asarray(dense)[emit], rtol=0, atol=1e-6)
    assert np.all(np.asarray(lp_T)[:, ~emit] == 0.0)


def test_loop_logprobs_every_loop_equal_the_torch_reference(params, loops):
    lp_T, z_T = loops
    ref = TorchOuro(CFG, hf_state_from_params(params, CFG))
    for b in range(2):
        logits, gate = (x[:, 0].numpy().astype(np.float64)
                        for x in ref.forward(np.array(TOKENS[b:b + 1, PAD[b]:])))
        x = logits / 0.8
        lsm = x - np.logaddexp.reduce(x, axis=-1, keepdims=True)       # [T, S - pad, V]
        for i in np.nonzero(EXITS[b])[0]:
            want = lsm[:, i - PAD[b], TOKENS[b, i + 1]]
            np.testing.assert_allclose(lp_T[:, b, i], want, rtol=0, atol=1e-5)
            np.testing.assert_allclose(1 / (1 + np.exp(-z_T[:, b, i])), gate[:, i - PAD[b]],
                                       rtol=0, atol=1e-6)


def test_trainer_exit_dist_loop_credit_ratio_is_exp_of_minus_the_weighted_shift(params, loops):
    """`policy_loss` with `loop_credit=exit_dist` (the branch that also reads the old gates):
    old per-loop log-probs = current + 0.1 t at loop t, old gate logits 0 (lambda 1/2: p = 1/2,
    1/4, 1/8, 1/8), so a token's log-ratio is -sum_t w_t 0.1 t with its exit loop k's weights
    (p renormalised over t <= k; k = 1..4 all occur). uniform/progressive differ from it only in
    the weights, checked above."""
    log_ratio = {1: -0.1, 2: -(2 / 3 * .1 + 1 / 3 * .2),
                 3: -(4 / 7 * .1 + 2 / 7 * .2 + 1 / 7 * .3), 4: -0.1875}
    lp_T, _ = loops
    shift = 0.1 * jnp.arange(1, 5, dtype=jnp.float32)[:, None, None]
    mb = {"tokens": TOKENS, "pad": PAD, "exit_loop": EXITS, "kv_depth": KV_DEPTH,
          "adv": np.array([1.0, -1.0], np.float32), "old_lp": np.zeros((2, 8), np.float32),
          "old_lp_T": lp_T + shift, "old_gate_z": jnp.zeros((4, 2, 8), jnp.float32)}
    spec = LossSpec(cfg=CFG, kv_policy="dense", compute_dtype="float32", temperature=0.8,
                    top_k=0, top_p=1.0, method="hybrid",
                    settings=LossSettings(eps_low=0.2, eps_high=0.28),
                    loss_agg="token-mean", max_new_tokens=4, kl_beta=0.0, tis_cap=None,
                    loop_credit="exit_dist", loop_credit_alpha=1.0, train_gate=False,
                    gate_loss_coef=1.0)
    loss, st = jax.jit(policy_loss, static_argnums=4)(params, mb, 7.0, 1.0, spec)
    ks = EXITS[EXITS > 0]
    want = np.exp([log_ratio[int(k)] for k in ks])
    # ratios 0.83..0.91 lie inside the clip range [0.8, 1.28]: loss = sum -ratio A / 7 tokens
    adv = np.repeat([1.0, -1.0], (EXITS > 0).sum(axis=1))
    np.testing.assert_allclose(float(loss), np.sum(-want * adv) / 7.0, rtol=1e-5)
    np.testing.assert_allclose(float(st["ratio_min"]), want.min(), rtol=1e-5)
    np.testing.assert_allclose(float(st["ratio_max"]), want.max(), rtol=1e-5)
    np.testing.assert_allclose(float(st["ratio_mean"]), want.mean(), rtol=1e-5)
