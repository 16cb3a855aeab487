"""Sampling weights held in the compute dtype (issue 19): a loader's `leaf_fn` that moves each
fp32 leaf to the device as it is read, casts it there, and streams the fingerprint of the fp32
master it came from.

`looprl generate` / `looprl eval --dtype bfloat16` sample with `cast_weights(params, bf16)`.
Holding the fp32 master for that costs 4 B per parameter that the sampler never reads;
`ComputeWeights` holds 2 B instead, and the fp32 tree never exists at once (peak: the bf16 tree
plus the copies of the leaf being read: the loader's fp32 array, its device copy and its cast;
about 5.6 GB at 1.43 B parameters, README "Memory"). The cast is the one `cast_weights` applies (an XLA convert of the same fp32
values, the exit gate kept in fp32), so the sampler computes the same bits from either form, and
the rollout records the master's fingerprint (`FingerprintStream`), so `looprl verify --rollout`
and the learner check it against the fp32 checkpoint as before.

    params, cfg, tok, meta, fingerprint = load_for_sampling(path, "bfloat16")
    generate(cfg, params, prompts, scfg, master_fingerprint=fingerprint)

In fp32 the loader's tree moves to the device after it is read (`device_params`, in place), as
before: casting nothing, interleaving the copies with the reads would only overlap them.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from looprl.io.convert import load_any_checkpoint
from looprl.model.looped import PARAM_PATHS, device_params
from looprl.sampling.schedule import FingerprintStream


class ComputeWeights:
    """`leaf_fn(keys, fp32 leaf) -> device array` for `looprl.io.convert.load_any_checkpoint`.

    Args:
      dtype: the compute dtype (`float32`, `bfloat16`, `float16`); every leaf but the exit gate's
        is held in it (DESIGN.md §2: the gate stays fp32).
    """

    def __init__(self, dtype):
        self.dtype = jnp.dtype(dtype)
        self._stream = FingerprintStream(PARAM_PATHS)

    def __call__(self, keys, leaf):
        x = jax.device_put(leaf)
        self._stream.add(keys, x)  # the fp32 master's bits, before the cast (in place)
        if keys[0] != "early_exit_gate" and x.dtype != self.dtype:
            x = x.astype(self.dtype)
        # wait for each leaf, so its fp32 copy is freed before the next one is read
        return jax.block_until_ready(x)

    def fingerprint(self) -> str:
        """`params_fingerprint` of the fp32 master (every leaf must have been read)."""
        return self._stream.hexdigest()


def load_for_sampling(path: str, dtype):
    """(params on the device, OuroConfig, tokenizer json or None, meta, master fingerprint) of a
    looprl checkpoint or HF directory (`load_any_checkpoint`), for sampling in `dtype`: fp32
    weights with fingerprint None (the sampler computes it from them), or `ComputeWeights`'
    compute-dtype copy with the fp32 master's fingerprint (pass it as `master_fingerprint`).
    Raises CheckpointError as `load_any_checkpoint`."""
    if jnp.dtype(dtype) == jnp.float32:
        params, cfg, tok, meta = load_any_checkpoint(path)
        return device_params(params), cfg, tok, meta, None
    weights = ComputeWeights(dtype)
    params, cfg, tok, meta = load_any_checkpoint(path, leaf_fn=weights)
    return params, cfg, tok, meta, weights.fingerprint()
