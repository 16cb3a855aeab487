"""GRPO math: group advantages, loss aggregation, k3 KL, RLTT loop credit, and Ouro's stage-I /
stage-II losses. Pure jax functions of arrays; every reduction in fp32. The policy losses
(PPO-clip, CISPO, GSPO) are `looprl.rl.losses`.

Axes: N groups, G group size, B sequences (B = N * G), S positions, T loops. `mask_BxS` is 1 on
positions whose emitted token belongs to the completion (docs/DESIGN.md §3: position i emits
token i + 1); masked positions contribute exactly 0, whatever (inf, NaN) their inputs hold.
Per-token losses `loss_BxS` become a scalar in `aggregate_loss`, divided by a normaliser computed
once over the whole minibatch (`loss_normalizer`), so microbatch results add up to the same loss
and gradient for any split.

Sources: GRPO (Shao et al. 2024, arXiv 2402.03300); token-mean (DAPO, arXiv 2503.14476);
Dr.GRPO (arXiv 2503.20783); k3 KL (Schulman, "Approximating KL divergence", 2020); loop credit
(RLTT, arXiv 2602.10520); Ouro's stage-I and stage-II losses (docs/DESIGN.md §1).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from looprl.config.sections import AGG_MODES, LOOP_CREDIT_MODES, LoopCredit, LossAgg

_F32 = jnp.float32


def _masked(x, mask):
    """x where mask, exactly 0 elsewhere (also when x is inf/NaN there), fp32."""
    return jnp.where(mask.astype(bool), x.astype(_F32), 0.0)


# --- advantages ---------------------------------------------------------------------------------

class GroupAdvantages(NamedTuple):
    advantages_NxG: jax.Array   # fp32
    degenerate_N: jax.Array     # bool: the group's rewards are equal (up to the std floor)
    num_degenerate: jax.Array   # int32 scalar: degenerate_N.sum()


def group_advantages(rewards_NxG: jax.Array, scale_by_std: bool = True, std_floor: float = 1e-6,
                     ddof: int = 1) -> GroupAdvantages:
    """Group-normalised advantages `A = (r - mean_g r) / std_g r` (GRPO), per group of G samples
    of one prompt. With `scale_by_std=False` (Dr.GRPO) `A = r - mean_g r`.

    Args:
      rewards_NxG: rewards, any float dtype; computed in fp32.
      scale_by_std: divide by the group std (GRPO) or not (Dr.GRPO).
      std_floor: a group is *degenerate* when its rewards are all exactly equal or its std is at
        most `std_floor * max(1, max_g |r|)` (absolute below 1, relative above). Its advantages
        are exactly 0: seven rewards of 0.35 have an fp32 std of round-off (not 0), and dividing
        by it would turn round-off into +-1 advantages.
      ddof: the std is `sqrt(sum (r - mean)^2 / (G - ddof))`. Default 1 (unbiased), as
        `torch.std` computes it in TRL's and verl's GRPO.

    Returns:
      `GroupAdvantages(advantages_NxG fp32, degenerate_N bool, num_degenerate int32)`.
      Degenerate groups (all rewards equal, and every group of one) get advantage 0, so their
      policy term contributes no gradient (their tokens still count in the aggregation
      normaliser; dropping them is the trainer's choice). A group of one gives 0, never NaN.
    """
    r = rewards_NxG.astype(_F32)
    G = r.shape[-1]
    mean = jnp.mean(r, axis=-1, keepdims=True)
    centred = r - mean
    if G - ddof > 0:
        std = jnp.sqrt(jnp.sum(centred * centred, axis=-1) / (G - ddof))
    else:
        std = jnp.zeros(r.shape[:-1], _F32)
    scale = jnp.maximum(1.0, jnp.max(jnp.abs(r), axis=-1))
    all_equal = jnp.all(r == r[..., :1], axis=-1)
    degenerate = all_equal | (std <= std_floor * scale) | (G == 1)
    if scale_by_std:
        safe_std = jnp.where(degenerate, 1.0, std)
        adv = centred / safe_std[..., None]
    else:
        adv = centred
    adv = jnp.where(degenerate[..., None], 0.0, adv)
    return GroupAdvantages(adv, degenerate, jnp.sum(degenerate).astype(jnp.int32))


# --- KL to the reference ------------------------------------------------------------------------

def k3_kl(logprobs_BxS: jax.Array, ref_logprobs_BxS: jax.Array, mask_BxS: jax.Array) -> jax.Array:
    """Per-token k3 estimate of KL(current || reference), fp32, 0 on masked positions:
    `k3 = exp(ref - cur) - (ref - cur) - 1 >= 0`, written `expm1(x) - x` to avoid cancellation
    near 0. Differentiable in `logprobs_BxS`; the reference is stop-gradient. Add
    `kl_beta * k3_kl(...)` to the per-token policy loss before `aggregate_loss` (beta 0 by
    default, and then skip the reference pass). Source: Schulman (2020); GRPO eq. 4."""
    valid = mask_BxS.astype(bool)
    cur = jnp.where(valid, logprobs_BxS.astype(_F32), 0.0)
    ref = jnp.where(valid, jax.lax.stop_gradient(ref_logprobs_BxS).astype(_F32), 0.0)
    x = ref - cur
    return _masked(jnp.expm1(x) - x, valid)


# --- aggregation (microbatch-invariant) ---------------------------------------------------------

def loss_normalizer(mask_BxS: jax.Array, mode: LossAgg, max_new_tokens: int | None = None
                    ) -> jax.Array:
    """The constant that `aggregate_loss` divides by, computed once over the FULL batch (all
    microbatches of one optimizer update) before it is split. fp32 scalar, at least 1.

    - `token-mean`: the number of valid tokens in the batch (DAPO).
    - `seq-mean-token-mean`: the number of sequences with at least one valid token (each
      sequence's loss is first its own token mean; GRPO paper).
    - `dr-grpo`: `max_new_tokens * B`, a constant independent of the responses (Dr.GRPO).

    Raises:
      ValueError: unknown mode, or `dr-grpo` without `max_new_tokens`.
    """
    valid = mask_BxS.astype(bool)
    if mode == "token-mean":
        n = jnp.sum(valid)
    elif mode == "seq-mean-token-mean":
        n = jnp.sum(jnp.any(valid, axis=-1))
    elif mode == "dr-grpo":
        if max_new_tokens is None:
            raise ValueError("loss_normalizer: mode 'dr-grpo' needs max_new_tokens")
        n = jnp.asarray(max_new_tokens * mask_BxS.shape[0])
    else:
        raise ValueError(f"loss_normalizer: unknown mode {mode!r}, expected one of {AGG_MODES}")
    return jnp.maximum(n.astype(_F32), 1.0)


def aggregate_loss(loss_BxS: jax.Array, mask_BxS: jax.Array, mode: LossAgg,
                   normalizer: jax.Array | float) -> jax.Array:
    """This microbatch's share of the batch loss: a masked *sum* divided by the full batch's
    `normalizer` (from `loss_normalizer`). Summing it over microbatches gives the full-batch
    loss (and, by linearity, gradient) for any split, e.g. token-mean of a 10-token sequence
    with loss 1 and a 100-token sequence with loss 0 is 10/110 whether they are one
    microbatch or two.

    - `token-mean` and `dr-grpo`: `sum_{b,s} mask * loss / normalizer`.
    - `seq-mean-token-mean`: `sum_b (sum_s mask * loss / max(1, sum_s mask)) / normalizer`.

    Returns an fp32 scalar. Raises ValueError for an unknown mode.
    """
    valid = mask_BxS.astype(bool)
    masked = _masked(loss_BxS, valid)
    if mode in ("token-mean", "dr-grpo"):
        total = jnp.sum(masked)
    elif mode == "seq-mean-token-mean":
        lengths = jnp.maximum(jnp.sum(valid, axis=-1).astype(_F32), 1.0)
        total = jnp.sum(jnp.sum(masked, axis=-1) / lengths)
    else:
        raise ValueError(f"aggregate_loss: unknown mode {mode!r}, expected one of {AGG_MODES}")
    return total / jnp.asarray(normalizer, _F32)


# --- loop credit (RLTT) -------------------------------------------------------------------------

def loop_credit_weights(exit_loop_BxS: jax.Array, num_loops: int, mode: LoopCredit, *,
                        alpha: float = 1.0, exit_probs_TxBxS: jax.Array | None = None
                        ) -> jax.Array:
    """Weights `w_TxBxS` (fp32, stop-gradient) over the loops t = 1..T that the schedule
    computed for each position's emitted token (t <= exit loop k), summing to 1 over t where
    k >= 1 and all 0 where k = 0 (no emission). After RLTT (arXiv 2602.10520).

    Modes: `none` (one-hot at the exit loop: the ordinary objective), `uniform` (1/k),
    `progressive` (`t^alpha / sum_{j<=k} j^alpha`), `exit_dist` (the exit distribution
    `p_t` from the gates, `exit_probs_TxBxS` as `looprl.model.looped.exit_distribution` returns
    it, stop-gradient and renormalised over t <= k; where those p sum to 0 in fp32 it falls back
    to one-hot at the exit loop).

    Raises ValueError for an unknown mode or `exit_dist` without `exit_probs_TxBxS`.
    """
    k = exit_loop_BxS.astype(jnp.int32)
    t = jnp.arange(1, num_loops + 1, dtype=jnp.int32)[:, None, None]
    computed = (t <= k[None]) & (k[None] >= 1)
    one_hot = (t == k[None]).astype(_F32)
    if mode == "none":
        return one_hot
    if mode == "uniform":
        raw = computed.astype(_F32)
    elif mode == "progressive":
        raw = jnp.where(computed, t.astype(_F32) ** alpha, 0.0)
    elif mode == "exit_dist":
        if exit_probs_TxBxS is None:
            raise ValueError("loop_credit_weights: mode 'exit_dist' needs exit_probs_TxBxS")
        raw = jnp.where(computed, jax.lax.stop_gradient(exit_probs_TxBxS).astype(_F32), 0.0)
    else:
        raise ValueError(f"loop_credit_weights: unknown mode {mode!r}, "
                         f"expected one of {LOOP_CREDIT_MODES}")
    total = jnp.sum(raw, axis=0, keepdims=True)
    w = jnp.where(total > 0, raw / jnp.where(total > 0, total, 1.0), one_hot)
    return jax.lax.stop_gradient(w)


def loop_credit_logprobs(logprobs_TxBxS: jax.Array, weights_TxBxS: jax.Array) -> jax.Array:
    """`sum_t w_t log pi^(t)(y)`, `[B, S]` fp32. Loops with weight 0 (not computed, or no
    emission) contribute exactly 0 even if their log-probs are -inf or garbage."""
    w = weights_TxBxS.astype(_F32)
    return jnp.sum(jnp.where(w > 0, w * logprobs_TxBxS.astype(_F32), 0.0), axis=0)


# --- Ouro warm-start losses (docs/DESIGN.md §1) ------------------------------------------------

def _gate_logs(gate_logits_TxBxS, exit_lambda_TxBxS, eps: float):
    """(log lambda, log(1 - lambda)) in fp32, from the gate logit (exact, via log-sigmoid) or,
    failing that, from lambda clipped to [eps, 1 - eps]."""
    if (gate_logits_TxBxS is None) == (exit_lambda_TxBxS is None):
        raise ValueError("give exactly one of gate_logits_TxBxS and exit_lambda_TxBxS")
    if gate_logits_TxBxS is not None:
        z = gate_logits_TxBxS.astype(_F32)
        return jax.nn.log_sigmoid(z), jax.nn.log_sigmoid(-z)
    lam = jnp.clip(exit_lambda_TxBxS.astype(_F32), eps, 1.0 - eps)
    return jnp.log(lam), jnp.log1p(-lam)


def gate_stage2_loss(ce_TxBxS: jax.Array, mask_BxS: jax.Array, *,
                     gate_logits_TxBxS: jax.Array | None = None,
                     exit_lambda_TxBxS: jax.Array | None = None,
                     normalizer: jax.Array | float | None = None, sharpness: float = 50.0,
                     threshold: float = 0.005, eps: float = 1e-6) -> jax.Array:
    """Ouro stage-II gate loss: binary cross-entropy of the continue probability `1 - lambda_t`
    toward `w_t = sigmoid(sharpness * (I_t - threshold))`, `I_t = max(0, CE_{t-1} - CE_t)`:
    `L = -mean_{valid positions, t = 2..T}[w_t log(1 - lambda_t) + (1 - w_t) log lambda_t]`.

    Args:
      ce_TxBxS: per-loop cross-entropy of the target token (stop-gradient is applied: only the
        gate trains).
      mask_BxS: 1 on positions whose target counts.
      gate_logits_TxBxS: the gate logit z (lambda = sigmoid(z)); logs via log-sigmoid, exact
        even where lambda rounds to 0 or 1. Preferred.
      exit_lambda_TxBxS: lambda itself, if the logit is not at hand; clipped to [eps, 1 - eps].
      normalizer: divide the sum by this instead of `(T - 1) * valid positions` (pass the full
        batch's count to make microbatches add up).

    Returns an fp32 scalar (0 when T = 1 or no position is valid).
    """
    ce = jax.lax.stop_gradient(ce_TxBxS).astype(_F32)
    log_lam, log_cont = _gate_logs(gate_logits_TxBxS, exit_lambda_TxBxS, eps)
    improvement = jnp.maximum(0.0, ce[:-1] - ce[1:])
    w = jax.nn.sigmoid(sharpness * (improvement - threshold))
    bce = -(w * log_cont[1:] + (1.0 - w) * log_lam[1:])
    valid = jnp.broadcast_to(mask_BxS.astype(bool)[None], bce.shape)
    total = jnp.sum(_masked(bce, valid))
    if normalizer is None:
        normalizer = jnp.maximum(jnp.sum(valid).astype(_F32), 1.0)
    return total / jnp.asarray(normalizer, _F32)


def exit_stage1_loss(ce_TxBxS: jax.Array, exit_probs_TxBxS: jax.Array, mask_BxS: jax.Array, *,
                     entropy_beta: float = 0.0, normalizer: jax.Array | float | None = None
                     ) -> jax.Array:
    """Ouro stage-I loss `sum_t p_t CE_t - beta H(p)`, `H(p) = -sum_t p_t log p_t` (0 log 0 = 0),
    masked mean over positions (or sum / `normalizer`). Both the LM (through CE) and the gate
    (through p, `looprl.model.looped.exit_distribution`) get gradients. fp32 scalar."""
    ce = ce_TxBxS.astype(_F32)
    p = exit_probs_TxBxS.astype(_F32)
    expected_ce = jnp.sum(p * ce, axis=0)
    positive = p > 0
    entropy = -jnp.sum(jnp.where(positive, p * jnp.log(jnp.where(positive, p, 1.0)), 0.0), axis=0)
    per_position = expected_ce - entropy_beta * entropy
    valid = mask_BxS.astype(bool)
    total = jnp.sum(_masked(per_position, valid))
    if normalizer is None:
        normalizer = jnp.maximum(jnp.sum(valid).astype(_F32), 1.0)
    return total / jnp.asarray(normalizer, _F32)
