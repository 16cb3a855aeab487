"""The policy losses of `grpo.loss`, one registry: PPO-clip, CISPO, GSPO and GSPO-token.

Every loss is per token, `[B, S]` fp32, so it composes with every `grpo.loss_agg` mode, the k3
KL term and truncated importance sampling (TIS) the same way. `policy_token_loss` takes the
log-ratio once, runs the loss named in `LOSSES`, then adds the shared stats and TIS.

- `ppo-clip` (Schulman et al. 2017; DAPO's clip-higher, arXiv 2503.14476):
  `-min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A)`, `rho = pi / pi_old` per token.
- `cispo` (MiniMax-M1, arXiv 2506.13585, eq. 4): `-sg(clip(rho, w_low, w_high)) A log pi`.
  Every token keeps a gradient; its weight is truncated.
- `gspo` (arXiv 2507.18071, eqs. 5-7): the length-normalised sequence ratio
  `s = exp(mean_t (log pi - log pi_old))`, clipped as PPO clips `rho`. The sequence's loss
  `-min(s A, clip(s, 1 - eps_low, 1 + eps_high) A)` sits on each of its tokens.
- `gspo-token` (arXiv 2507.18071, eqs. 13-14): per token `s_t = sg(s) pi_t / sg(pi_t)`. It has
  the value of `s` and the gradient of each token's own log-prob.

TIS (Yao et al. 2025) multiplies each token's loss by `min(exp(old - sampler), tis_cap)`,
stop-gradient. Masked positions hold exactly 0, whatever their inputs hold. `aggregate_loss`
reduces the per-token loss: `seq-mean-token-mean` gives GSPO's mean over sequences.

Adding a loss: a function below, its entry in `LOSSES`, its settings in `LossSettings` (named
as the `grpo` section names them), and its name in `config/sections.py`'s `GRPOLoss`.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

_F32 = jnp.float32
_sg = jax.lax.stop_gradient


@dataclasses.dataclass(frozen=True)
class LossSettings:
    """The policy losses' settings, each a key of the `grpo` config section of the same name.

    `eps_low`, `eps_high` clip PPO's token ratio and GSPO's sequence ratio to
    `[1 - eps_low, 1 + eps_high]` (the GSPO paper uses 3e-4 and 4e-4). `cispo_clip_low`,
    `cispo_clip_high` bound CISPO's importance weight (the paper's `1 - eps_low_IS`,
    `1 + eps_high_IS`); None for the low bound is no bound.
    """
    eps_low: float = 0.2
    eps_high: float = 0.2
    cispo_clip_low: float | None = None
    cispo_clip_high: float = 5.0

    @classmethod
    def from_section(cls, grpo: Any) -> "LossSettings":
        """The settings a `GRPOConfig` (the `grpo` section) holds."""
        return cls(**{f.name: getattr(grpo, f.name) for f in dataclasses.fields(cls)})


# A loss: (log_ratio, logprobs, advantages [B, 1], valid, settings) -> (loss, ratio, low, high),
# all [B, S]. `ratio` is the ratio the loss clips; `low` / `high` mark the tokens whose gradient
# the clip removes (or whose weight it truncates) from below / above.
TokenLoss = Callable[..., tuple[jax.Array, jax.Array, jax.Array, jax.Array]]


def _clipped(ratio, adv, s: LossSettings):
    """PPO's clipped objective of `ratio` and the clip's low and high masks."""
    clipped = jnp.clip(ratio, 1.0 - s.eps_low, 1.0 + s.eps_high)
    loss = -jnp.minimum(ratio * adv, clipped * adv)
    return loss, ratio, (adv < 0) & (ratio < 1.0 - s.eps_low), \
        (adv > 0) & (ratio > 1.0 + s.eps_high)


def ppo_clip(log_ratio, lp, adv, valid, s: LossSettings):
    """PPO-clip on the token ratio."""
    return _clipped(jnp.exp(log_ratio), adv, s)


def cispo(log_ratio, lp, adv, valid, s: LossSettings):
    """CISPO: the token's log-prob weighted by its truncated ratio (stop-gradient)."""
    ratio = jnp.exp(log_ratio)
    lo = -jnp.inf if s.cispo_clip_low is None else s.cispo_clip_low
    weight = _sg(jnp.clip(ratio, lo, s.cispo_clip_high))
    return -weight * adv * lp, ratio, ratio < lo, ratio > s.cispo_clip_high


def _sequence_log_ratio(log_ratio, valid):
    """`[B, 1]`: the mean log-ratio over each sequence's valid tokens."""
    lengths = jnp.maximum(jnp.sum(valid, axis=-1).astype(_F32), 1.0)
    return (jnp.sum(log_ratio, axis=-1) / lengths)[:, None]


def gspo(log_ratio, lp, adv, valid, s: LossSettings):
    """GSPO: PPO-clip on the sequence ratio, the sequence's loss on each token."""
    log_s = jnp.broadcast_to(_sequence_log_ratio(log_ratio, valid), lp.shape)
    return _clipped(jnp.exp(log_s), adv, s)


def gspo_token(log_ratio, lp, adv, valid, s: LossSettings):
    """GSPO-token: the sequence ratio's value, each token's own gradient."""
    log_s = _sg(_sequence_log_ratio(log_ratio, valid)) + (lp - _sg(lp))
    return _clipped(jnp.exp(log_s), adv, s)


LOSSES: dict[str, TokenLoss] = {"ppo-clip": ppo_clip, "cispo": cispo, "gspo": gspo,
                                "gspo-token": gspo_token}


def _tis_weight(old, sampler_logprobs_BxS, tis_cap, valid):
    """`min(exp(old - sampler), tis_cap)` (stop-gradient) and the raw weight, fp32 `[B, S]`."""
    samp = jnp.where(valid, _sg(sampler_logprobs_BxS).astype(_F32), 0.0)
    raw = jnp.exp(old - samp)
    return jnp.minimum(raw, tis_cap), raw


def policy_token_loss(loss: str, logprobs_BxS: jax.Array, old_logprobs_BxS: jax.Array,
                      advantages_B: jax.Array, mask_BxS: jax.Array, *,
                      sampler_logprobs_BxS: jax.Array | None = None, tis_cap: float | None = None,
                      **settings: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Per-token policy loss `[B, S]` fp32 of `loss` (a key of `LOSSES`) and its fp32 stats.

    Args:
      loss: `ppo-clip`, `cispo`, `gspo` or `gspo-token` (module doc).
      logprobs_BxS: the learner's log-probs of the sampled tokens at the current parameters
        (differentiable; `hybrid` by default, so the first update's ratio is exactly 1).
      old_logprobs_BxS: the behaviour log-probs the ratio is taken against (stop-gradient).
      advantages_B: one advantage per sequence (fp32), broadcast over its tokens.
      mask_BxS: 1 on completion tokens.
      sampler_logprobs_BxS, tis_cap: TIS, both or neither. With `hybrid` log-probs and
        `old = sampler` the weight is exactly 1.
      settings: the fields of `LossSettings` (defaults there); each loss reads its own.

    Returns:
      `(loss_BxS, stats)`: loss fp32, 0 on masked positions. `stats` are fp32 scalars over
      the valid tokens (means are 0 when there are none): `tokens` (the count),
      `clip_frac_low`, `clip_frac_high`, `clip_frac` (their sum), `ratio_mean`, `ratio_min`,
      `ratio_max` (+inf / -inf without tokens), `approx_kl` (k3 of KL(old || current), the
      mean of `rho - 1 - log rho`) and, with TIS, `tis_weight_mean` and `tis_capped_frac`.
      The ratio is the one the loss clips: the token ratio (ppo-clip, cispo) or the sequence
      ratio on each token (gspo, gspo-token).

    Raises:
      ValueError: unknown `loss`, or only one of `sampler_logprobs_BxS` and `tis_cap`.
      TypeError: a setting `LossSettings` does not have.
    """
    if loss not in LOSSES:
        raise ValueError(f"policy_token_loss: unknown loss {loss!r}, expected one of "
                         f"{tuple(LOSSES)}")
    if (sampler_logprobs_BxS is None) != (tis_cap is None):
        raise ValueError("truncated importance sampling needs both sampler_logprobs_BxS and "
                         "tis_cap")
    valid = mask_BxS.astype(bool)
    lp = jnp.where(valid, logprobs_BxS.astype(_F32), 0.0)
    old = jnp.where(valid, _sg(old_logprobs_BxS).astype(_F32), 0.0)
    log_ratio = lp - old
    adv = _sg(advantages_B).astype(_F32)[:, None]
    per_token, ratio, low, high = LOSSES[loss](log_ratio, lp, adv, valid,
                                               LossSettings(**settings))
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
    stats = {k: _sg(v) for k, v in stats.items()}
    return jnp.where(valid, per_token, 0.0), stats


def ppo_clip_loss(logprobs_BxS: jax.Array, old_logprobs_BxS: jax.Array, advantages_B: jax.Array,
                  mask_BxS: jax.Array, *, eps_low: float = 0.2, eps_high: float = 0.2,
                  sampler_logprobs_BxS: jax.Array | None = None, tis_cap: float | None = None
                  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """`policy_token_loss("ppo-clip", ...)`: the per-token PPO-clip loss and its stats."""
    return policy_token_loss("ppo-clip", logprobs_BxS, old_logprobs_BxS, advantages_B, mask_BxS,
                             eps_low=eps_low, eps_high=eps_high,
                             sampler_logprobs_BxS=sampler_logprobs_BxS, tis_cap=tis_cap)
