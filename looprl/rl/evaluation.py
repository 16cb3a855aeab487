"""Greedy evaluation on a task's held-out problems: generate one completion per problem and
grade it (used by `looprl train` before and after GRPO, and by `looprl eval`).
"""
from __future__ import annotations

from typing import Any

import jax
import numpy as np

from looprl.config import ExperimentConfig
from looprl.model.config import OuroConfig
from looprl.rl.rollout import sampling_config
from looprl.sampling.state import kv_cache_bytes
from looprl.sampling.sampler import SamplingConfig, generate


def evaluate_problems(model_cfg: OuroConfig, params, task, tokenizer, problems,
                      scfg: SamplingConfig, *, batch_size: int, seed: int = 0,
                      progress=None, master_fingerprint: str | None = None
                      ) -> list[dict[str, Any]]:
    """Generate one completion per problem (in batches of `batch_size`, noise keyed by each
    problem's id) and grade it.

    Returns one dict per problem (in order): completion (text before the end of turn), reward
    (`task.reward`), correct (reward == 1.0), tokens (completion tokens, the end of turn
    included), truncated (no end of turn within `scfg.max_new_tokens`), exit_loops (the exit
    loop of each completion token, docs/DESIGN.md §3), kv_cache_bytes (its batch's KV cache,
    `looprl.sampling.state.kv_cache_bytes`). `progress(n)` is called after each batch with
    its number of problems. `master_fingerprint`: for `params` held in the compute dtype
    (`looprl.sampling.sampler.generate`).
    """
    if not all(isinstance(x, jax.Array) for x in jax.tree.leaves(params)):
        params = jax.device_put(params)  # once for every batch (numpy trees: a copy per call)
    rows = []
    for i in range(0, len(problems), batch_size):
        chunk = problems[i:i + batch_size]
        prompts = [tokenizer.encode(task.format_prompt(p)) for p in chunk]
        batch = generate(model_cfg, params, prompts, scfg, group_size=1, seed=seed, step=0,
                         prompt_indices=[p.id for p in chunk],
                         master_fingerprint=master_fingerprint)
        P = batch.schedule.prompt_len
        kv_bytes = kv_cache_bytes(model_cfg, batch.tokens_BxS.shape[0], batch.schedule.seq_len,
                                  scfg.compute_dtype)
        toks = np.asarray(batch.tokens_BxS)
        exits = np.asarray(batch.exit_loop_BxS)
        lens = np.asarray(batch.completion_len_B)
        for b, p in enumerate(chunk):
            n = int(lens[b])
            ids = toks[b, P:P + n].tolist()
            text = tokenizer.decode_completion(ids)
            reward = task.reward(p, text)
            rows.append({"completion": text, "reward": reward, "correct": reward == 1.0,
                         "tokens": n, "truncated": tokenizer.end_of_turn_id not in ids,
                         "exit_loops": exits[b, P - 1:P - 1 + n].tolist(),
                         "kv_cache_bytes": kv_bytes})
        if progress is not None:
            progress(len(chunk))
    return rows


def evaluate(model_cfg: OuroConfig, params, task, tokenizer, exp_cfg: ExperimentConfig, problems,
             exit_threshold: float | None = None, progress=None) -> dict[str, Any]:
    """Greedy held-out accuracy at the run's q (or `exit_threshold`), in batches of
    `eval.eval_batch_size` (`evaluate_problems`). Returns {accuracy (mean reward),
    mean_exit_loop, problems}, and by_terms (accuracy per metadata `num_terms`) for tasks whose
    problems have terms (arithmetic, not GSM8K). `progress(n)`: as in `evaluate_problems`."""
    q = {} if exit_threshold is None else {"exit_threshold": exit_threshold}
    scfg = sampling_config(exp_cfg, greedy=True, **q)
    rows = evaluate_problems(model_cfg, params, task, tokenizer, problems, scfg,
                             batch_size=exp_cfg.eval.eval_batch_size, seed=exp_cfg.run.seed,
                             progress=progress)
    correct_a = np.asarray([float(r["reward"]) for r in rows])
    exits = [e for r in rows for e in r["exit_loops"]]
    result = {"accuracy": float(correct_a.mean()), "mean_exit_loop": float(np.mean(exits)),
              "problems": len(problems)}
    terms = [p.metadata.get("num_terms") for p in problems]
    if any(t is not None for t in terms):
        terms_a = np.asarray([-1 if t is None else int(t) for t in terms])
        result["by_terms"] = {str(k): float(correct_a[terms_a == k].mean())
                              for k in np.unique(terms_a) if k >= 0}
    return result
