"""Batches with little or no learning signal: the step's advantages by `grpo.scale_rewards`, the
completions cut by the length limit (`grpo.mask_truncated` takes them out of the loss), and
whether a step has any signal left (`grpo.skip_zero_advantage_steps` skips it otherwise).

Sources: per-group std (GRPO, arXiv 2402.03300); batch std (TRL's `scale_rewards="batch"`, the
Ouro GRPO trainer's default); none (Dr.GRPO, arXiv 2503.20783); overlong filtering (DAPO,
arXiv 2503.14476); skipping the update when every advantage is 0 (the Ouro GRPO trainer).
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from looprl.rl import grpo

SCALE_REWARDS = ("group", "batch", "none")


def step_advantages(rewards_NxG, scale_rewards: str = "group", std_floor: float = 1e-6
                    ) -> grpo.GroupAdvantages:
    """`A = (r - mean_g r) / scale` per group of G samples of one prompt, fp32 `[N, G]`.

    scale_rewards: `group`, the group's std (`grpo.group_advantages`, the same bits); `batch`,
      the std of all N * G rewards (ddof 1); `none`, 1 (Dr.GRPO). Degenerate groups (equal
      rewards, `group_advantages`' std floor) get exactly 0 in every mode; a batch whose std is
      at most `std_floor * max(1, max |r|)` gets 0 everywhere.

    Raises ValueError for another `scale_rewards`.
    """
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"step_advantages: unknown scale_rewards {scale_rewards!r}, expected "
                         f"one of {SCALE_REWARDS}")
    out = grpo.group_advantages(rewards_NxG, scale_by_std=scale_rewards == "group",
                                std_floor=std_floor)
    if scale_rewards != "batch":
        return out
    r = jnp.asarray(rewards_NxG, jnp.float32).reshape(-1)
    std = jnp.std(r, ddof=1) if r.size > 1 else jnp.float32(0.0)
    flat = std <= std_floor * jnp.maximum(1.0, jnp.max(jnp.abs(r)))
    adv = jnp.where(flat, 0.0, out.advantages_NxG / jnp.where(flat, 1.0, std))
    return out._replace(advantages_NxG=adv)


def truncated_rows(batch) -> np.ndarray:
    """`[B]` bool: the completions that the length limit cut (their last token is not one of the
    schedule's stop ids). An empty completion counts as truncated."""
    toks = np.asarray(batch.tokens_BxS)
    n = np.asarray(batch.completion_len_B).astype(np.int64)
    P = batch.schedule.prompt_len
    last = toks[np.arange(len(n)), np.clip(P + n - 1, 0, toks.shape[1] - 1)]
    return (n == 0) | ~np.isin(last, np.asarray(batch.schedule.stop_ids))


def zero_std_fraction(degenerate_N) -> float:
    """The fraction of groups whose rewards are all equal (their advantages are 0)."""
    d = np.asarray(degenerate_N, bool)
    return float(d.mean()) if d.size else 0.0


def has_signal(advantages_B, keep_B=None) -> bool:
    """True when some completion that stays in the loss (`keep_B`, default all) has a nonzero
    advantage: otherwise the policy term's gradient is exactly 0."""
    a = np.asarray(advantages_B)
    keep = np.ones(a.shape, bool) if keep_B is None else np.asarray(keep_B, bool)
    return bool(np.any((a != 0) & keep))
