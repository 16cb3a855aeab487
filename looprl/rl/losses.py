"""The GRPO policy losses other than PPO-clip (`grpo.loss`): CISPO, GSPO and GSPO-token, per token
`[B, S]` fp32, so that they compose with every `grpo.loss_agg` mode, the k3 KL term and TIS the
same way `looprl.rl.grpo.ppo_clip_loss` does (`policy_token_loss` dispatches between them).

- `cispo` (MiniMax-M1, arXiv 2506.13585, eq. 4): `-sg(clip(rho, w_low, w_high)) A log pi`, with
  `rho = pi / pi_old` per token: every token keeps a gradient, its weight truncated.
- `gspo` (arXiv 2507.18071, eqs. 5-7): the length-normalised sequence ratio
  `s = exp(mean_t (log pi - log pi_old))`, clipped as PPO clips `rho`; the sequence's loss
  `-min(s A, clip(s, 1 - eps_low, 1 + eps_high) A)` is put on each of its tokens.
- `gspo-token` (arXiv 2507.18071, eqs. 13-14): per token `s_t = sg(s) pi_t / sg(pi_t)`: the value
  of `s`, the gradient of each token's own log-prob.

Masked positions hold exactly 0 (whatever their inputs), as in `looprl.rl.grpo`. The per-token
loss is what `aggregate_loss` reduces: `seq-mean-token-mean` gives GSPO's mean over sequences.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from looprl.rl import grpo

LOSSES = ("ppo-clip", "cispo", "gspo", "gspo-token")
_F32 = jnp.float32


def _tis_weight(old, sampler_logprobs_BxS, tis_cap, valid):
    """`min(exp(old - sampler), tis_cap)` (stop-gradient) and the raw weight, fp32 `[B, S]`."""
    samp = jnp.where(valid, jax.lax.stop_gradient(sampler_logprobs_BxS).astype(_F32), 0.0)
    raw = jnp.exp(old - samp)
    return jnp.minimum(raw, tis_cap), raw


def policy_token_loss(loss: str, logprobs_BxS: jax.Array, old_logprobs_BxS: jax.Array,
                      advantages_B: jax.Array, mask_BxS: jax.Array, *, eps_low: float = 0.2,
                      eps_high: float = 0.2, cispo_clip_low: float | None = None,
                      cispo_clip_high: float = 5.0, sampler_logprobs_BxS: jax.Array | None = None,
                      tis_cap: float | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Per-token policy loss `[B, S]` fp32 of `loss` (one of `LOSSES`) and its fp32 stats.

    Args:
      loss: `ppo-clip` (`looprl.rl.grpo.ppo_clip_loss`, unchanged), `cispo`, `gspo`,
        `gspo-token` (module doc).
      logprobs_BxS, old_logprobs_BxS, advantages_B, mask_BxS, sampler_logprobs_BxS, tis_cap:
        as `ppo_clip_loss` takes them (old and sampler log-probs under stop-gradient).
      eps_low, eps_high: the clip range of PPO's token ratio and of GSPO's sequence ratio (the
        GSPO paper uses 3e-4 and 4e-4).
      cispo_clip_low, cispo_clip_high: CISPO's bounds on the importance weight itself (the
        paper's `1 - eps_low_IS`, `1 + eps_high_IS`); None for the low bound is no bound.

    Returns:
      `(loss_BxS, stats)`: the stats of `ppo_clip_loss` (`tokens`, `clip_frac_low`,
      `clip_frac_high`, `clip_frac`, `ratio_mean`, `ratio_min`, `ratio_max`, `approx_kl`, with
      TIS `tis_weight_mean`, `tis_capped_frac`). The ratio is the one each loss clips: the
      token ratio (ppo-clip, cispo) or the sequence ratio on each token (gspo, gspo-token).
      `clip_frac_low` / `_high` count tokens whose gradient the clip removes (ppo-clip, gspo)
      or whose weight it truncates (cispo).

    Raises:
      ValueError: unknown `loss`, or only one of `sampler_logprobs_BxS` and `tis_cap`.
    """
    if loss == "ppo-clip":
        tis = {} if tis_cap is None and sampler_logprobs_BxS is None else dict(
            sampler_logprobs_BxS=sampler_logprobs_BxS, tis_cap=tis_cap)
        return grpo.ppo_clip_loss(logprobs_BxS, old_logprobs_BxS, advantages_B, mask_BxS,
                                  eps_low=eps_low, eps_high=eps_high, **tis)
    if loss not in LOSSES:
        raise ValueError(f"policy_token_loss: unknown loss {loss!r}, expected one of {LOSSES}")
    if (sampler_logprobs_BxS is None) != (tis_cap is None):
        raise ValueError("truncated importance sampling needs both sampler_logprobs_BxS and tis_cap")
    sg = jax.lax.stop_gradient
    valid = mask_BxS.astype(bool)
    lp = jnp.where(valid, logprobs_BxS.astype(_F32), 0.0)
    old = jnp.where(valid, sg(old_logprobs_BxS).astype(_F32), 0.0)
    log_ratio = lp - old
    adv = sg(advantages_B).astype(_F32)[:, None]
    if loss == "cispo":
        ratio = jnp.exp(log_ratio)
        lo = -jnp.inf if cispo_clip_low is None else cispo_clip_low
        weight = sg(jnp.clip(ratio, lo, cispo_clip_high))
        per_token = -weight * adv * lp
        low, high = ratio < lo, ratio > cispo_clip_high
    else:
        lengths = jnp.maximum(jnp.sum(valid, axis=-1).astype(_F32), 1.0)
        seq_log_ratio = (jnp.sum(log_ratio, axis=-1) / lengths)[:, None]
        if loss == "gspo":
            log_s = jnp.broadcast_to(seq_log_ratio, lp.shape)
        else:  # gspo-token: sg(s) * pi_t / sg(pi_t)
            log_s = sg(seq_log_ratio) + (lp - sg(lp))
        ratio = jnp.exp(log_s)
        clipped = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
        per_token = -jnp.minimum(ratio * adv, clipped * adv)
        low, high = (adv < 0) & (ratio < 1.0 - eps_low), (adv > 0) & (ratio > 1.0 + eps_high)

    n = jnp.sum(valid).astype(_F32)
    denom = jnp.maximum(n, 1.0)

    def mean(x):
        return jnp.sum(jnp.where(valid, x.astype(_F32), 0.0)) / denom

    stats = {"tokens": n, "clip_frac_low": mean(low), "clip_frac_high": mean(high),
             "ratio_mean": mean(ratio), "ratio_min": jnp.min(jnp.where(valid, ratio, jnp.inf)),
             "ratio_max": jnp.max(jnp.where(valid, ratio, -jnp.inf)),
             "approx_kl": mean(jnp.expm1(log_ratio) - log_ratio)}
    stats["clip_frac"] = stats["clip_frac_low"] + stats["clip_frac_high"]
    if tis_cap is not None:
        weight, raw = _tis_weight(old, sampler_logprobs_BxS, tis_cap, valid)
        per_token = per_token * weight
        stats["tis_weight_mean"] = mean(weight)
        stats["tis_capped_frac"] = mean(raw > tis_cap)
    stats = {k: sg(v) for k, v in stats.items()}
    return jnp.where(valid, per_token, 0.0), stats
