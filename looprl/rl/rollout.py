"""The rollout side of a GRPO step: the run's `SamplingConfig`, rewards of a rollout batch, and
the per-step rollout figures (mean exit loop, `rollout_sha256`; bit-equal fractions are
`looprl.logprobs.mismatch`'s).

Everything here reads a `RolloutBatch` (`looprl.sampling.schedule`) that the sampler returned;
nothing samples or differentiates.
"""
from __future__ import annotations

import hashlib

import numpy as np

from looprl.config import ExperimentConfig
from looprl.sampling.sampler import SamplingConfig


def sampling_config(exp_cfg: ExperimentConfig, *, greedy: bool = False,
                    **overrides) -> SamplingConfig:
    """The rollout's (or, with `greedy`, the evaluation's) `SamplingConfig`
    (`SamplingConfig.from_rollout_config` of the run's rollout section and compute dtype)."""
    return SamplingConfig.from_rollout_config(exp_cfg.rollout, exp_cfg.model.compute_dtype,
                                              greedy=greedy, **overrides)


def completion_rewards(task, tokenizer, problems, batch, group_size: int):
    """(rewards_B fp32, completion texts) of a rollout batch (row b = problem b // G)."""
    toks = np.asarray(batch.tokens_BxS)
    P = batch.schedule.prompt_len
    n = np.asarray(batch.completion_len_B)
    texts, rewards = [], []
    for b in range(toks.shape[0]):
        text = tokenizer.decode_completion(toks[b, P:P + int(n[b])].tolist())
        texts.append(text)
        rewards.append(task.reward(problems[b // group_size], text))
    return np.asarray(rewards, np.float32), texts


def mean_exit_loop(batch) -> float:
    """Mean exit loop over the completion's emitting positions (docs/DESIGN.md §3 alignment)."""
    el = np.asarray(batch.exit_loop_BxS)[:, batch.schedule.prompt_len - 1:]
    return float(el[el > 0].mean()) if np.any(el > 0) else 0.0


def rollout_sha256(batch) -> str:
    """SHA-256 (hex) of what a rollout sampled: tokens_BxS (int32), exit_loop_BxS (int32) and
    the recorded logprob_BxS (fp32 bits), each little-endian, in that order. Two runs sampled
    the same completions at a step exactly when their values agree."""
    h = hashlib.sha256()
    for a, dt in ((batch.tokens_BxS, "<i4"), (batch.exit_loop_BxS, "<i4"),
                  (batch.logprob_BxS, "<f4")):
        a = np.ascontiguousarray(np.asarray(a))
        if a.dtype != np.dtype(dt):
            raise TypeError(f"rollout array of dtype {a.dtype}, expected {dt}")
        h.update(a.astype(dt, copy=False).tobytes())
    return h.hexdigest()
