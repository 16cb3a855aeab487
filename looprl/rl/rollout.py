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
from looprl.errors import ConfigError
from looprl.sampling.sampler import SamplingConfig


def sampling_config(exp_cfg: ExperimentConfig, *, greedy: bool = False, tokenizer=None,
                    **overrides) -> SamplingConfig:
    """The rollout's (or, with `greedy`, the evaluation's) `SamplingConfig`
    (`SamplingConfig.from_rollout_config` of the run's rollout section and compute dtype).

    With `rollout.thinking_budget` set, the rollout (not the greedy evaluation) samples with
    it: `forced_answer_text` and `think_close_text` are tokenised once by `tokenizer` (a
    `looprl.tokenizer.TextTokenizer`). Raises ConfigError without a tokenizer, or for a text
    the tokenizer cannot encode (TaskError's message)."""
    r = exp_cfg.rollout
    if r.thinking_budget is not None and not greedy:
        overrides = {**thinking_settings(r, tokenizer), **overrides}
    return SamplingConfig.from_rollout_config(r, exp_cfg.model.compute_dtype, greedy=greedy,
                                              **overrides)


def thinking_settings(rollout, tokenizer) -> dict:
    """The `SamplingConfig` fields of a rollout section's thinking budget (ids tokenised)."""
    if tokenizer is None:
        raise ConfigError("rollout.thinking_budget needs the run's tokenizer to tokenise "
                          "rollout.forced_answer_text and rollout.think_close_text")
    ids = {}
    for key in ("forced_answer_text", "think_close_text"):
        try:
            ids[key] = tuple(tokenizer.encode(getattr(rollout, key)))
        except Exception as e:  # TaskError: characters outside the vocabulary
            raise ConfigError(f"config key 'rollout.{key}': {e}") from e
    tb = tuple(rollout.thinking_budget)
    return dict(thinking_budget=(tb[0], tb[-1]), answer_budget=int(rollout.answer_budget),
                forced_answer_ids=ids["forced_answer_text"],
                think_close_ids=ids["think_close_text"])


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


def loss_exit_loops(batch) -> np.ndarray:
    """int32 [B, S]: the exit loops the loss reads, 0 at the tokens the thinking budget forced
    (`RolloutBatch.forced_BxS`), so they leave the loss, its token count and loop credit; the
    learner's K/V depths come from the recorded exit loops (`RolloutBatch.kv_depth_BxS`)."""
    el = np.asarray(batch.exit_loop_BxS, np.int32)
    return el if batch.forced_BxS is None else np.where(batch.forced_BxS, 0, el).astype(np.int32)


def interrupted_fraction(batch) -> float:
    """Fraction of the rows whose thinking budget ran out (a forced answer was written)."""
    f = batch.forced_BxS
    return 0.0 if f is None else float(np.asarray(f).any(axis=1).mean())


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
