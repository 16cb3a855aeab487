"""Per-row randomness and logit processing for sampling.

Randomness: every sampled token draws from a key derived with `fold_in` from (seed, training
step, the prompt's global index in its dataset, sample index within the group, the token's index
in its completion), so a seed reproduces a rollout exactly and no two steps, prompts, samples or
tokens share noise. Never a reused key. Keying by the completion index (`NOISE_KEYING` =
"completion") makes a row's samples independent of its batch-mates: the padded layout position
(the legacy "layout" keying, kept for resuming older runs and re-verifying older rollouts)
shifts with the longest prompt of the batch.

Processing order (as HF transformers and vLLM do): temperature -> top-k -> top-p. The recorded
behaviour log-prob is `log_softmax(logits / temperature)` over the full vocabulary in fp32
(docs/DESIGN.md §3); when top-k/top-p are on, the processed (renormalised over the kept tokens)
log-prob is recorded as well, and the PPO ratio uses that one.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from looprl import kernels as kn


NOISE_KEYINGS = ("completion", "layout")
NOISE_KEYING = "completion"  # "layout": files that name no keying (looprl.legacy)


def noise_position(keying: str, emit_position, prompt_len: int):
    """The position folded into a sampled token's key: its index in the completion (0 for the
    first completion token, emitted by layout position P - 1) under "completion", the padded
    layout position under "layout" (the older keying: `looprl.legacy`)."""
    if keying == "completion":
        return emit_position - (prompt_len - 1)
    return emit_position


def row_keys(seed: int, step, prompt_index_B, sample_index_B, position):
    """uint32 PRNG keys `[B, 2]`: fold_in(seed) <- step <- prompt index <- sample <- position
    (`noise_position`)."""
    base = jax.random.fold_in(jax.random.PRNGKey(seed), step)

    def one(pi, si):
        k = jax.random.fold_in(jax.random.fold_in(base, pi), si)
        return jax.random.fold_in(k, position)

    return jax.vmap(one)(prompt_index_B, sample_index_B)


def process_logits(logits_BxV, temperature: float, top_k: int, top_p: float,
                   stock: bool = False):
    """Returns (full_logprobs_BxV, processed_logprobs_BxV), fp32.

    full = log_softmax(logits / T). processed = log_softmax over the tokens kept by top-k then
    top-p (nucleus over the top-k-renormalised distribution, always keeping the most likely
    token), -inf elsewhere; equal to `full` when both are off. Temperature 0 means greedy and
    records the temperature-1 log-probs. `stock` uses `jax.nn.log_softmax` (XLA's reduce, not
    row-invariant) instead of the row-invariant `looprl.kernels.log_softmax`.
    """
    lsm = functools.partial(jax.nn.log_softmax, axis=-1) if stock else kn.log_softmax
    logits = logits_BxV.astype(jnp.float32)
    scaled = logits / jnp.float32(temperature) if temperature > 0 else logits
    full = lsm(scaled)
    if top_k <= 0 and top_p >= 1.0:
        return full, full
    keep = jnp.ones_like(scaled, dtype=bool)
    V = scaled.shape[-1]
    if 0 < top_k < V:
        kth = jax.lax.top_k(scaled, top_k)[0][..., -1:]
        keep &= scaled >= kth
    if top_p < 1.0:
        masked = jnp.where(keep, scaled, -jnp.inf)
        order = jnp.argsort(-masked, axis=-1)
        sorted_logp = jnp.take_along_axis(jax.nn.log_softmax(masked, axis=-1), order, axis=-1)
        probs = jnp.exp(sorted_logp)
        cum_before = jnp.cumsum(probs, axis=-1) - probs
        keep_sorted = cum_before < jnp.float32(top_p)
        keep_sorted = keep_sorted.at[..., 0].set(True)
        inv = jnp.argsort(order, axis=-1)
        keep &= jnp.take_along_axis(keep_sorted, inv, axis=-1)
    processed = lsm(jnp.where(keep, scaled, -jnp.inf))
    return full, processed


def sample_tokens(keys_Bx2, processed_logprobs_BxV, greedy: bool):
    """Gumbel-max draw per row from the processed distribution (argmax when greedy), int32 `[B]`.

    `jax.random.categorical(key, logp)` written out, `argmax(jax.random.gumbel(key) + logp)`:
    the same noise, sum and first-maximum argmax, with the scores materialised before the argmax
    (`kernels.row_argmax`): fused into XLA's argmax reduce, XLA CPU computes the noise's two
    logs per element in the reduce's scalar loop. The noise has the same bits in either form,
    checked for every uniform draw it can take (2^23 values, tests/sampling/test_gumbel_max.py);
    the add and the argmax are exact."""
    if greedy:
        return jnp.argmax(processed_logprobs_BxV, axis=-1).astype(jnp.int32)

    def scores(key, logp):
        return jax.random.gumbel(key, logp.shape, logp.dtype) + logp

    return kn.row_argmax(jax.vmap(scores)(keys_Bx2, processed_logprobs_BxV))
