"""Evaluation on a task's held-out problems: generate completions (one greedy per problem, or N
sampled) and grade them (used by `looprl train` before and after GRPO, and by `looprl eval`).

`pass_at_k` is the unbiased pass@k estimator of Chen et al. 2021 (arXiv 2107.03374, eq. 1):
from n samples of which c are correct, 1 - C(n-c, k) / C(n, k), computed as a product.
"""
from __future__ import annotations

from fractions import Fraction
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
                      progress=None, master_fingerprint: str | None = None,
                      num_samples: int = 1) -> list[dict[str, Any]]:
    """Generate `num_samples` completions per problem (in batches of `batch_size` problems, noise
    keyed by each problem's id and the sample's index) and grade them.

    Returns one dict per completion, problem-major (problem i's sample s at i * num_samples + s):
    sample (s), completion (text before the end of turn), reward
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
        batch = generate(model_cfg, params, prompts, scfg, group_size=num_samples, seed=seed,
                         step=0, prompt_indices=[p.id for p in chunk],
                         master_fingerprint=master_fingerprint)
        P = batch.schedule.prompt_len
        kv_bytes = kv_cache_bytes(model_cfg, batch.tokens_BxS.shape[0], batch.schedule.seq_len,
                                  scfg.compute_dtype)
        toks = np.asarray(batch.tokens_BxS)
        exits = np.asarray(batch.exit_loop_BxS)
        lens = np.asarray(batch.completion_len_B)
        for b in range(len(chunk) * num_samples):
            p = chunk[b // num_samples]
            n = int(lens[b])
            ids = toks[b, P:P + n].tolist()
            text = tokenizer.decode_completion(ids)
            reward = task.reward(p, text)
            rows.append({"sample": b % num_samples, "completion": text, "reward": reward,
                         "correct": reward == 1.0, "tokens": n, "truncated": tokenizer.end_of_turn_id not in ids,
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


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one problem with `c` correct of `n` samples: 1 - C(n-c, k) / C(n, k)
    (Chen et al. 2021, arXiv 2107.03374, eq. 1), as the exact product prod_{i=n-c+1}^{n} (1 - k/i)
    in rationals, so large n loses no precision. Raises ValueError unless 0 <= c <= n, 1 <= k <= n.
    """
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k: expected 0 <= c <= n and 1 <= k <= n, found n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    miss = Fraction(1)
    for i in range(n - c + 1, n + 1):
        miss *= Fraction(i - k, i)
    return float(1 - miss)


def pass_at_k_summary(correct: list[int], n: int) -> dict[str, float]:
    """`{"mean@n", "pass@1", "pass@2", "pass@4", ..., "pass@n"}` over problems with `correct[i]`
    correct of `n` samples each: mean@n is the mean fraction correct (= pass@1); each pass@k
    (k = 1, 2, 4, ... below n, and n) is `pass_at_k` averaged over the problems."""
    ks = sorted({2 ** j for j in range(n.bit_length()) if 2 ** j <= n} | {n})
    out = {f"mean@{n}": float(np.mean([c / n for c in correct]))}
    out.update({f"pass@{k}": float(np.mean([pass_at_k(n, c, k) for c in correct])) for k in ks})
    return out
