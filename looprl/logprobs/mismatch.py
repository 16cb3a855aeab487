"""How far one set of log-probs is from another, over the sampled tokens: the raw-bit equality
and the k3 KL estimate that the trainer's per-step figures (`replay_exact_fraction`,
`mismatch_*`) and `looprl verify`'s cells (`exact_fraction`, `k3_kl`) report. NumPy, float64
accumulation, on host arrays; nothing here is differentiated (the KL *penalty* of the GRPO loss
is `looprl.rl.grpo.k3_kl`, the same estimator in jax).

k3 (Schulman 2020, "Approximating KL divergence"): with `x = log q(a) - log p(a)` for tokens
drawn from p, `expm1(x) - x = q/p - 1 - log(q/p) >= 0` estimates KL(p || q) without bias and is
never negative; `expm1` avoids the cancellation of `exp(x) - 1` near 0.
"""
from __future__ import annotations

import numpy as np


def bits_equal(a, b, mask) -> np.ndarray:
    """The masked entries of `a` and `b` (cast to fp32), True where their raw bits (as uint32)
    are equal: -0.0 and 0.0 differ, a NaN equals only the same NaN."""
    m = np.asarray(mask, bool)
    a = np.asarray(a, np.float32)[m]
    b = np.asarray(b, np.float32)[m]
    return a.view(np.uint32) == b.view(np.uint32)


def bits_equal_fraction(a, b, mask) -> float:
    """Fraction of masked entries whose fp32 bits are equal (1.0 when the mask is empty)."""
    eq = bits_equal(a, b, mask)
    return float(np.mean(eq)) if eq.size else 1.0


def k3_terms(log_ratio) -> np.ndarray:
    """Per-token k3 estimates `expm1(x) - x` of `x = log q - log p` (float64)."""
    x = np.asarray(log_ratio, np.float64)
    return np.expm1(x) - x


def compare_logprobs(lp_BxS, ref_BxS, mask_BxS) -> dict[str, float]:
    """`looprl verify`'s figures of the learner's `lp` against the sampler's `ref` over `mask`:
    `exact_fraction` (raw fp32 bits equal; 0.0 when the mask is empty), `max_abs_diff`,
    `mean_abs_diff` and `k3_kl` (mean k3 of `ref - lp`, KL(learner || sampler))."""
    m = np.asarray(mask_BxS, bool)
    lp = np.asarray(lp_BxS, np.float32)[m].astype(np.float64)
    ref = np.asarray(ref_BxS, np.float32)[m].astype(np.float64)
    exact = bits_equal(lp_BxS, ref_BxS, m)
    diff = np.abs(lp - ref)
    n = max(int(lp.size), 1)
    return {"exact_fraction": float(exact.sum() / n),
            "max_abs_diff": float(np.max(diff, initial=0.0)),
            "mean_abs_diff": float(diff.sum() / n), "k3_kl": float(k3_terms(ref - lp).sum() / n)}


def mismatch_stats(learner_lp_BxS, sampler_lp_BxS, mask_BxS, eps_low: float,
                   eps_high: float) -> dict[str, float]:
    """The trainer's figures of the learner's log-probs (at the sampler's parameters) against
    the sampler's, over the sampled tokens: `mismatch_k3_kl` (k3 of `learner - sampler`, tokens
    drawn from the sampler: mean of `r - 1 - log r`, `r = pi_learner / pi_sampler`),
    `mismatch_abs_mean` / `mismatch_abs_max` (|delta logprob|, nats) and
    `ratio_outside_clip_frac` (share of tokens whose ratio r lies outside the PPO clip range
    `[1 - eps_low, 1 + eps_high]`, where clipping acts on the first update). All 0.0 when the
    mask is empty."""
    m = np.asarray(mask_BxS, bool)
    x = (np.asarray(learner_lp_BxS, np.float64) - np.asarray(sampler_lp_BxS, np.float64))[m]
    if not x.size:
        return {"mismatch_k3_kl": 0.0, "mismatch_abs_mean": 0.0, "mismatch_abs_max": 0.0,
                "ratio_outside_clip_frac": 0.0}
    r = np.exp(x)
    return {"mismatch_k3_kl": float(np.mean(k3_terms(x))),
            "mismatch_abs_mean": float(np.mean(np.abs(x))),
            "mismatch_abs_max": float(np.max(np.abs(x))),
            "ratio_outside_clip_frac": float(np.mean((r < 1.0 - eps_low) | (r > 1.0 + eps_high)))}
