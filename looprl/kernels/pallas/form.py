"""The accelerator kernel forms `pallas-gpu` (Triton) and `pallas-tpu` (Mosaic TPU): one kernel
set, the same design for both, every forward product and row sum a Pallas kernel with a fixed
tile and a fixed order (docs/NUMERICS.md, "The accelerator forms").

matmul: `pallas.matmul` (64 x 128 x 128 blocks, no split-K, fp32 at HIGHEST, bf16 with fp32
accumulation); attention: `pallas.attention.flash_attention` (one flash-style kernel for every
caller, GQA by index); rowsum: `pallas.rows` (RMSNorm, the softmaxes, the log-prob's
normaliser). Attention's backward: `pallas.attention_bwd` (two kernels, no score matrix in
HBM, fixed order). Row max and argmax stay XLA reduces (order-free). RoPE: a Pallas kernel on
the device, the plain expression as its own program on the CPU (`rope_form`): every caller
reads the same bits. Each kernel is compiled for the
platform the program is lowered for and interpreted on the CPU (`pallas.target`). The other
backward passes are plain XLA dots (`kernels`' custom_vjp).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from looprl.kernels.pallas import attention_tpu as tpu_attention
from looprl.kernels.pallas.attention import flash_attention, flash_attention_cached
from looprl.kernels.pallas.attention_bwd import flash_attention_bwd
from looprl.kernels.pallas.matmul import pallas_matmul_for
from looprl.kernels.pallas.rope import rope_for
from looprl.kernels.pallas.rows import rowsum_form
from looprl.kernels.pallas.target import opaque_on_cpu
from looprl.kernels.plain import rope_rotate_half


def matmul_form(backend: str):
    """The form's matmul(rows_MxI, w_IxO, out_dtype, precision) -> `[M, O]`: the weight cast
    to the rows' dtype (bf16 stays bf16 on the tensor cores / MXU); `precision` is the
    kernel's own (HIGHEST for fp32)."""
    def matmul_pallas(rows_MxI, w_IxO, out_dtype, precision=None):
        return pallas_matmul_for(rows_MxI, w_IxO.astype(rows_MxI.dtype), out_dtype, backend)
    return matmul_pallas


def attention_form(backend: str):
    """The form's attention(q_BxHxCxK, k_BxSxJxK, v_BxSxJxK, mask_BxCxS, scale, softmax,
    precision) -> `[B, H, C, K]`: K/V with their J kv heads (read by index); the mask bool or
    a `KeyRange` (built in the kernel); `softmax` is unused (the kernel's online softmax)."""
    def attention_pallas(q, k, v, mask, scale, softmax, precision):
        return flash_attention(q, k.astype(q.dtype), v.astype(q.dtype), mask, scale, backend,
                               precision)
    return attention_pallas


def attention_cached_form(backend: str):
    """The form's attention_cached(q_MxHxCxK, kv: CachedKV, mask, scale, softmax) -> `[M, H, C,
    K]`, the same bits as the attention over `kv.slots()` (fp32 dots at HIGHEST where q and
    the cache are fp32, as `Form.fp32_precision` asks); `mask` bool `[M, C, S]` or a
    `KeyRange`. The cache read in place on the GPU (`pallas.attention.flash_attention_cached`)
    and on the TPU for the decode step (one new key, a `KeyRange` mask:
    `pallas_attention_tpu`); every other TPU call attends over `kv.slots()` (a copy)."""
    over_slot = attention_form(backend)

    def attention_cached(q, kv, mask, scale, softmax):
        prec = (jax.lax.Precision.HIGHEST if q.dtype == jnp.float32
                and kv.k_NxBxSxJxK.dtype == jnp.float32 else None)
        if backend == "gpu":
            return flash_attention_cached(q, kv, mask, scale, backend, prec)
        if tpu_attention.supports(kv, mask):
            return tpu_attention.flash_attention_cached(q, kv, mask, scale, backend, prec)
        return over_slot(q, *kv.slots(), mask, scale, softmax, prec)
    return attention_cached


def attention_grads_form(backend: str):
    """The form's attention backward(q, k, v, mask, out, g, scale, precision) -> (dq, dk, dv):
    `pallas.attention_bwd.flash_attention_bwd`, K/V cast to q's dtype as the forward reads
    them, the gradients back in K/V's dtypes."""
    def attention_grads(q, k, v, mask, out, g, scale, precision):
        dq, dk, dv = flash_attention_bwd(q, k.astype(q.dtype), v.astype(q.dtype), mask, out, g,
                                         scale, backend, precision)
        return dq, dk.astype(k.dtype), dv.astype(v.dtype)
    return attention_grads


def rope_form(backend: str):
    """The form's rope(x, cos, sin): the Pallas rope kernel on the device (`pallas.rope`), and
    `plain.rope_rotate_half` as its own program on the CPU (`pallas.target.opaque_on_cpu`). Fused with what consumes it (the sampler's
    cache write, the learner's key layout), XLA CPU's FMA contraction of `x*cos + rot*sin`
    picks the product to fuse by the graph around it (`fma(x, cos, rot*sin)` in one program,
    `fma(rot, sin, x*cos)` in another), and the sampler's keys differ from the learner's in the
    last bit. Backward: the plain expression's (exact data movement and products)."""
    device = rope_for(backend)

    @jax.custom_vjp
    def rope(x, cos, sin):
        return opaque_on_cpu(rope_rotate_half, backend, x, cos, sin, device=device)

    def fwd(x, cos, sin):
        return rope(x, cos, sin), (x, cos, sin)

    def bwd(res, g):
        return jax.vjp(rope_rotate_half, *res)[1](g)

    rope.defvjp(fwd, bwd)
    return rope


def form_kernels(backend: str) -> dict:
    """The Form fields of the Pallas form for `backend` (`gpu`, `tpu`)."""
    return dict(matmul=matmul_form(backend), attention=attention_form(backend),
                rowsum=rowsum_form(backend), backend=backend, kv_heads_by_index=True,
                attention_key_range=True,
                rope=rope_form(backend), attention_cached=attention_cached_form(backend))
