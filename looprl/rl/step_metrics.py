"""A GRPO step's metrics row (`metrics.jsonl`; docs/DESIGN.md §6 names the required keys), and
the figures it holds besides the learner's: the mean token entropy of the sampled distribution
(`token_entropy`), the learner-vs-sampler log-prob gap and importance weights under Tunix's names
(`logp_diff_mean`, `logp_diff_max`, `is_weight_mean`, `is_weight_max`, `is_weight_clipped_frac`),
and the no-signal figures (`zero_std_fraction`, `truncated_fraction`, `update_skipped`); the
thinking budget's `interrupted_fraction`.

`token_entropy` is `-sum_v p_v log p_v` of the distribution each completion token was drawn from
(temperature, top-k, top-p applied: `looprl.sampling.processing.process_logits`), at the
sampler's parameters, by a dense teacher-forced pass over the recorded schedule (the sampler's
logits, bit for bit where replay is exact), averaged over the emitting positions. `entropy` stays
the sampled estimate `-mean log p(token)` of the full-vocabulary distribution.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from looprl.distributed.mesh import row_sharded_call
from looprl.logprobs.methods import exit_hidden
from looprl.model.looped import cast_weights, lm_logits
from looprl.rl.rollout import mean_exit_loop, rollout_sha256
from looprl.rl.signal import zero_std_fraction
from looprl.sampling.kv_policies import policy_named
from looprl.sampling.processing import process_logits
from looprl.sampling.fingerprint import params_fingerprint


@functools.partial(jax.jit, static_argnames=("spec",))
def _entropy_BxS(params, tokens, pad, exit_loop, kv_depth, *, spec):
    """`[B, S]` fp32: the entropy (nats) of the processed next-token distribution at each
    position's exit loop, 0 where nothing is emitted."""
    w = cast_weights(params, spec.compute_dtype)
    kv = policy_named(spec.kv_policy).learner_kv_depth(kv_depth)
    h = exit_hidden(spec.cfg, w, tokens, pad, exit_loop, kv, remat=False)
    logits = lm_logits(w, h)
    B, S, V = logits.shape
    _, proc = process_logits(logits.reshape(B * S, V), spec.temperature, spec.top_k, spec.top_p)
    finite = jnp.isfinite(proc)
    ent = -jnp.sum(jnp.where(finite, jnp.exp(proc) * jnp.where(finite, proc, 0.0), 0.0), axis=-1)
    return (jnp.where(exit_loop > 0, ent.reshape(B, S), 0.0),)


def token_entropy(params, arrays: dict[str, np.ndarray], spec, mesh=None,
                  rows_per_call: int = 0) -> float:
    """Mean entropy (nats) of the sampled distribution over the emitting positions of the
    learner's arrays (`tokens`, `pad`, `exit_loop`, `kv_depth`, `[B, S]`); 0.0 with none.
    `rows_per_call` rows at a time (0: all), as the loss takes microbatches: the logits of a
    call are `[rows, S, V]` fp32."""
    emit = arrays["exit_loop"] > 0
    B = emit.shape[0]
    step = rows_per_call or B
    parts = []
    for u in range(0, B, step):
        args = tuple(arrays[k][u:u + step] for k in ("tokens", "pad", "exit_loop", "kv_depth"))
        if mesh is not None:
            (ent,) = row_sharded_call(_entropy_BxS, mesh, (params,), args, static={"spec": spec})
        else:
            (ent,) = _entropy_BxS(params, *map(jnp.asarray, args), spec=spec)
        parts.append(np.asarray(ent, np.float64))
    return float(np.concatenate(parts)[emit].mean()) if emit.any() else 0.0


def is_weight_metrics(own_lp, recorded, emit, tis_cap: float | None, measured: bool
                      ) -> dict[str, Any]:
    """The learner's log-probs at the sampler's parameters against the sampler's, over the
    sampled tokens: `logp_diff_mean` / `_max` (|learner - sampler|, nats) and the importance
    weight `exp(learner - sampler)`'s `is_weight_mean`, `_max` and `is_weight_clipped_frac`
    (share above `grpo.tis_cap`; None without a cap). All None when not `measured`."""
    keys = ("logp_diff_mean", "logp_diff_max", "is_weight_mean", "is_weight_max",
            "is_weight_clipped_frac")
    if not measured:
        return dict.fromkeys(keys)
    x = (np.asarray(own_lp, np.float64) - np.asarray(recorded, np.float64))[emit]
    if not x.size:
        return dict(zip(keys, (0.0, 0.0, 1.0, 1.0, None if tis_cap is None else 0.0)))
    wgt = np.exp(x)
    return {"logp_diff_mean": float(np.mean(np.abs(x))), "logp_diff_max": float(np.abs(x).max()),
            "is_weight_mean": float(wgt.mean()), "is_weight_max": float(wgt.max()),
            "is_weight_clipped_frac": None if tis_cap is None else float(np.mean(wgt > tis_cap))}


def step_metrics(learner, step: int, batch, rewards, adv, at, upd, extra: dict[str, Any],
                 rollout_s: float, learner_s: float) -> dict[str, Any]:
    """The step's metrics row: `learner` a `GRPOLearner`, `at` its `_AtSampler`, `upd` its
    `_Updates` (empty on a skipped step: grad_norm and loss 0.0, the ratios None), `extra` the
    figures computed elsewhere (`token_entropy`, `truncated_fraction`, `interrupted_fraction`,
    `update_skipped`)."""
    wmean = upd.weighted_mean
    emit, recorded = at.emit, at.recorded
    comp = np.asarray(batch.completion_len_B)
    ran = bool(upd.grad_norms)
    none = None  # a skipped step has no ratios
    out = {"step": step, "reward_mean": float(rewards.mean()),
           "reward_std": float(rewards.std()), "accuracy": float(np.mean(rewards == 1.0)),
           "response_length": float(comp.mean()), "mean_exit_loop": mean_exit_loop(batch),
           "kl": at.kl_ref, "clip_frac": wmean("clip_frac"),
           "entropy": float(-recorded[emit].mean()) if emit.any() else 0.0,
           "grad_norm": float(np.mean(upd.grad_norms)) if ran else 0.0,
           "loss": float(np.mean(upd.losses)) if ran else 0.0,
           "replay_exact_fraction": at.replay_exact, "replay_impl": learner.replay_impl,
           "stock_max_abs_diff": at.stock_diff,
           "ratio_mean": wmean("ratio_mean") if ran else none,
           "ratio_min": min(v for v, _ in upd.stats["ratio_min"]) if ran else none,
           "ratio_max": max(v for v, _ in upd.stats["ratio_max"]) if ran else none,
           "approx_kl_old": wmean("approx_kl") if ran else none,
           "degenerate_groups": int(adv.num_degenerate),
           "zero_std_fraction": zero_std_fraction(adv.degenerate_N),
           **at.mismatch,
           **is_weight_metrics(at.own_lp, recorded, emit, learner.exp_cfg.grpo.tis_cap,
                               measured=next(iter(at.mismatch.values())) is not None),
           **extra,
           "tokens": int(emit.sum()), "learner_seq_len": at.live,
           "rollout_s": rollout_s, "learner_s": learner_s,
           "rollout_sha256": rollout_sha256(batch),
           "params_fingerprint": params_fingerprint(learner.params)}  # after the updates
    if "gate_loss" in upd.stats:
        out["gate_loss"] = wmean("gate_loss")
    if "tis_weight_mean" in upd.stats:
        out["tis_weight_mean"] = wmean("tis_weight_mean")
    return out
