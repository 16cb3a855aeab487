"""Sampling weights held in the compute dtype: a loader's `leaf_fn` that moves each fp32 leaf to
the device as it is read, in slabs, casts it there, and streams the fingerprint of the fp32
master it came from.

`ComputeWeights` holds 2 B per parameter in bf16 instead of the fp32 master's 4 B, which the
sampler never reads, and neither the fp32 tree nor a whole fp32 layer stack ever exists: the
load's peak is the held tree plus about two fp32 slabs (an HF directory's embedding and head
come as one slab each). The cast is the one `cast_weights` applies, so the sampler computes the
same bits from either form, and the rollout records the master's fingerprint
(`FingerprintStream`), which `looprl verify --rollout` and the learner check. In fp32 the same
path places the master itself on the device, slab by slab.

    params, cfg, tok, meta, fingerprint = load_for_sampling(path, "bfloat16")
    generate(cfg, params, prompts, scfg, master_fingerprint=fingerprint)
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from looprl.io.convert import load_any_checkpoint
from looprl.io.slabs import LeafSlabs
from looprl.model.looped import PARAM_PATHS
from looprl.sampling.fingerprint import FingerprintStream


class ComputeWeights:
    """`leaf_fn(keys, LeafSlabs) -> device array` for `looprl.io.convert.load_any_checkpoint`.

    A leaf read as one slab moves to the device, joins the fingerprint and is cast there. A
    leaf read in slabs (a layer stack) is assembled on the device in the compute dtype: each
    fp32 slab moves over, joins the fingerprint at its place in the leaf
    (`FingerprintStream.add(..., shape=, axis=, start=)`), is cast, and is written in place into
    the held leaf (a donated `dynamic_update_slice`), so the load holds the compute-dtype tree
    plus about two fp32 slabs, never a whole fp32 leaf that the loader sliced.

    Args:
      dtype: the compute dtype (`float32`, `bfloat16`, `float16`); every leaf but the exit gate's
        is held in it (docs/DESIGN.md §2: the gate stays fp32).
    """

    def __init__(self, dtype):
        self.dtype = jnp.dtype(dtype)
        self._stream = FingerprintStream(PARAM_PATHS)

    def __call__(self, keys, leaf: LeafSlabs):
        dtype = jnp.dtype(jnp.float32) if keys[0] == "early_exit_gate" else self.dtype
        if len(leaf.bounds) == 1:
            x = jax.device_put(leaf.full())
            self._stream.add(keys, x)  # the fp32 master's bits, before the cast (in place)
            # wait for each leaf, so its fp32 copy is freed before the next one is read
            return jax.block_until_ready(x.astype(dtype) if x.dtype != dtype else x)
        held = jnp.zeros(leaf.shape, dtype)
        for start, slab in leaf:
            x = jax.device_put(slab)
            self._stream.add(keys, x, shape=leaf.shape, axis=leaf.axis, start=start)
            held = jax.block_until_ready(_put_slab(held, x, start, leaf.axis))
        return held

    def fingerprint(self) -> str:
        """`params_fingerprint` of the fp32 master (every leaf must have been read)."""
        return self._stream.hexdigest()


@functools.partial(jax.jit, static_argnums=(3,), donate_argnums=(0,))
def _put_slab(held, slab, start, axis: int):
    """`held` with `slab`, cast to held's dtype, at `start` along `axis` (in place: donated)."""
    return jax.lax.dynamic_update_slice_in_dim(held, slab.astype(held.dtype), start, axis)


def load_for_sampling(path: str, dtype):
    """(params on the device, OuroConfig, tokenizer json or None, meta, master fingerprint) of a
    looprl checkpoint or HF directory (`load_any_checkpoint`), for sampling in `dtype`:
    `ComputeWeights`' device copy in `dtype` (fp32: the master itself) and the fp32 master's
    `params_fingerprint` (pass it as `master_fingerprint`). Raises CheckpointError as
    `load_any_checkpoint`."""
    weights = ComputeWeights(dtype)
    params, cfg, tok, meta = load_any_checkpoint(path, leaf_fn=weights)
    return params, cfg, tok, meta, weights.fingerprint()
