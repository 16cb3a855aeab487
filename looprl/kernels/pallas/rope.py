"""RoPE as a Pallas kernel on a device: `x*cos + rotate_half(x)*sin` (`plain.rope_rotate_half`)
materialised once, so the sampler's cache write, its attention and the learner all read the
same bits (XLA otherwise recomputes the rope inside each consumer's fusion, and the compiler's
FMA contraction of the sum depends on the fusion around it).

The rotation (`cat(-x2, x1)`) and the per-head broadcast of cos and sin are data movement done
by XLA (exact); the kernel computes `x*c + r*s` elementwise on `[ROW_TILE, 128]` blocks of the
`[B*C, H*K]` layout, rows zero-padded to ROW_TILE, columns to 128. Each output element reads
only its own four inputs. Where the program is lowered for the CPU, `form.rope_form` runs
the plain expression as its own program instead (`target.opaque_on_cpu`).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from looprl.kernels.pallas.matmul import pad_to_multiple
from looprl.kernels.pallas.target import compiler_params
from looprl.kernels.tiling import ROW_TILE

LANES = 128


def _kernel(x_ref, r_ref, c_ref, s_ref, o_ref):
    o_ref[...] = x_ref[...] * c_ref[...] + r_ref[...] * s_ref[...]


def rope_kernel(x_BxCxHxK, cos_BxCxK, sin_BxCxK, backend: str):
    """RoPE of x `[B, C, H, K]` with cos, sin `[B, C, K]` (x's dtype), compiled for `backend`
    (`gpu`: Triton, `tpu`: Mosaic). Returns `[B, C, H, K]` in x's dtype."""
    B, C, H, K = x_BxCxHxK.shape
    half = K // 2
    rot = jnp.concatenate([-x_BxCxHxK[..., half:], x_BxCxHxK[..., :half]], axis=-1)

    def rows(a_BxCxHxK):
        a = a_BxCxHxK.reshape(B * C, H * K)
        return pad_to_multiple(pad_to_multiple(a, 0, ROW_TILE), 1, LANES)

    def heads(t_BxCxK):
        return jnp.broadcast_to(t_BxCxK[:, :, None, :], x_BxCxHxK.shape).astype(x_BxCxHxK.dtype)

    args = [rows(x_BxCxHxK), rows(rot), rows(heads(cos_BxCxK)), rows(heads(sin_BxCxK))]
    mp, wp = args[0].shape
    spec = pl.BlockSpec((ROW_TILE, LANES), lambda i, j: (i, j))
    out = pl.pallas_call(
        _kernel, out_shape=jax.ShapeDtypeStruct((mp, wp), x_BxCxHxK.dtype),
        grid=(mp // ROW_TILE, wp // LANES), in_specs=[spec] * 4, out_specs=spec,
        compiler_params=compiler_params(backend, False), name="looprl_rope")(*args)
    return out[:B * C, :H * K].reshape(B, C, H, K)


def rope_for(backend: str):
    """`rope_kernel` bound to `backend`: fn(x, cos, sin)."""
    return functools.partial(rope_kernel, backend=backend)
