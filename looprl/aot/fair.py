"""The fair baselines: what a user would run for the learner step and the decode step, at the
same widths and shapes as `programs.build`, for compile-only targets and the device check.

The learner step: XLA's dots, the plain RMSNorm and RoPE, and jax's own Pallas flash attention
forward and backward (`pallas.ops.gpu.attention.mha` on a GPU, `pallas.ops.tpu.flash_attention`
on a TPU), causal with segment ids for the left padding; the LM head and its log-softmax as the
stock form writes them. The decode step: the same layer with jax's Pallas paged attention
(`pallas.ops.gpu.paged_attention`, `pallas.ops.tpu.paged_attention`) over a paged KV cache read
in place: the layer is picked by the page table, the new key written into its page in place
(the cache is donated), and the layer weights are held in the compute dtype (cast once, as a
serving stack holds them). The padding's keys are not masked (a paged cache holds none; the
keys read are the same). Compile these without looprl's GPU pins (`targets.compile_for`,
`pinned=False`): a user's XLA autotunes.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from looprl import kernels as kn
from looprl.aot.programs import Phase, abstract_weights, head
from looprl.model.config import OuroConfig

PAGE = 128  # keys per page of the fair decode's cache
PAGES_PER_BLOCK = 4  # pages per flash block of the TPU's paged kernel


def _mm(x, w):
    return jnp.einsum("...k,kn->...n", x, w.astype(x.dtype))


def _norm(cfg, x, w):
    return kn.rms_norm(x, w, cfg.rms_norm_eps, stock=True)


def _qkv(cfg, lw, x_BxCxD, cos, sin):
    B, C, _ = x_BxCxD.shape
    H, J, K = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    h = _norm(cfg, x_BxCxD, lw["input_layernorm"])
    q = kn.apply_rope(_mm(h, lw["q_proj"]).reshape(B, C, H, K), cos, sin)
    k = kn.apply_rope(_mm(h, lw["k_proj"]).reshape(B, C, J, K), cos, sin)
    return q, k, _mm(h, lw["v_proj"]).reshape(B, C, J, K)


def _rest(cfg, lw, x_BxCxD, o_BxCxHxK):
    B, C, _ = x_BxCxD.shape
    a = x_BxCxD + _norm(cfg, _mm(o_BxCxHxK.reshape(B, C, -1), lw["o_proj"]),
                        lw["input_layernorm_2"])
    z = _norm(cfg, a, lw["post_attention_layernorm"])
    m = _mm(jax.nn.silu(_mm(z, lw["gate_proj"])) * _mm(z, lw["up_proj"]), lw["down_proj"])
    return a + _norm(cfg, m, lw["post_attention_layernorm_2"])


def flash(backend: str, q_BxSxHxK, k_BxSxJxK, v_BxSxJxK, seg_BxS, scale: float):
    """jax's Pallas flash attention, causal, keys of another segment masked; `[B, S, H, K]`."""
    H = q_BxSxHxK.shape[2]
    k, v = kn_repeat(k_BxSxJxK, H), kn_repeat(v_BxSxJxK, H)
    if backend == "gpu":
        from jax.experimental.pallas.ops.gpu import attention as A
        return A.mha(q_BxSxHxK, k, v, seg_BxS, sm_scale=scale, causal=True)
    from jax.experimental.pallas.ops.tpu import flash_attention as F
    t = lambda x: x.transpose(0, 2, 1, 3)  # noqa: E731
    o = F.flash_attention(t(q_BxSxHxK), t(k), t(v), segment_ids=F.SegmentIds(seg_BxS, seg_BxS),
                          causal=True, sm_scale=scale)
    return t(o)


def kn_repeat(x_BxSxJxK, H: int):
    """K or V with each of J kv heads repeated for its H / J query heads."""
    J = x_BxSxJxK.shape[2]
    return x_BxSxJxK if J == H else jnp.repeat(x_BxSxJxK, H // J, axis=2)


def paged(backend: str, q_BxHxK, k_pages, v_pages, lengths_B, pages_BxP, scale: float):
    """jax's Pallas paged attention over pages `[J, pages, PAGE, K]` read in place."""
    q = q_BxHxK * jnp.asarray(scale, q_BxHxK.dtype)
    if backend == "gpu":
        from jax.experimental.pallas.ops.gpu import paged_attention as G
        return G.paged_attention(q, k_pages, v_pages, pages_BxP, lengths_B,
                                 k_splits=pages_BxP.shape[1])
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as P
    return P(q, k_pages, v_pages, lengths_B, pages_BxP, pages_per_compute_block=PAGES_PER_BLOCK)


def _learner(cfg, backend, w, x_BxSxD, pad_B, targets_BxS):
    B, S, _ = x_BxSxD.shape
    layout = jnp.arange(S)
    positions = jnp.maximum(layout[None] - pad_B[:, None], 0)
    seg = (layout[None] >= pad_B[:, None]).astype(jnp.int32)
    cos, sin = kn.rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, x_BxSxD.dtype)
    dt = w["norm"].dtype

    def body(x, lw):
        lw = {k: v.astype(dt) for k, v in lw.items()}
        q, k, v = _qkv(cfg, lw, x, cos, sin)
        o = flash(backend, q, k, v, seg, cfg.head_dim ** -0.5)
        return _rest(cfg, lw, x, o), None

    h, _ = jax.lax.scan(body, x_BxSxD, w["layers"])
    h = _norm(cfg, h, w["norm"])
    return head(w, h, targets_BxS, True)


def _learner_step(cfg, backend, w, x_BxSxD, pad_B, targets_BxS):
    def loss(w):
        return jnp.sum(_learner(cfg, backend, w, x_BxSxD, pad_B, targets_BxS)[1])
    return jax.value_and_grad(loss)(w)


def _decode(cfg, backend, w, x_Bx1xD, k_pages, v_pages, pad_B, w0, targets_Bx1):
    B = x_Bx1xD.shape[0]
    J, n_pages, _, K = k_pages.shape
    L = cfg.num_layers
    per_row = n_pages // (L * B)
    positions = (w0 - pad_B)[:, None]
    cos, sin = kn.rope_cos_sin(positions, K, cfg.rope_theta, x_Bx1xD.dtype)
    row_pages = jnp.arange(B, dtype=jnp.int32)[:, None] * per_row + jnp.arange(per_row)
    lengths = jnp.full((B,), w0 + 1, jnp.int32)
    dt = w["norm"].dtype

    def body(carry, xs):
        x, kp, vp = carry
        lw, layer = xs
        lw = {k: v.astype(dt) for k, v in lw.items()}
        q, k, v = _qkv(cfg, lw, x, cos, sin)

        def put(pages, new_BxJxK):  # the new key into its page, in place
            grid = pages.reshape(J, L, B, per_row, PAGE, K)
            new = new_BxJxK.transpose(1, 0, 2)[:, None, :, None, None]
            at = (0, layer, 0, w0 // PAGE, w0 % PAGE, 0)
            return jax.lax.dynamic_update_slice(grid, new, at).reshape(pages.shape)

        kp, vp = put(kp, k[:, 0]), put(vp, v[:, 0])
        o = paged(backend, q[:, 0], kp, vp, lengths, row_pages + layer * B * per_row,
                  K ** -0.5)
        return (_rest(cfg, lw, x, o[:, None]), kp, vp), None

    layers = jnp.arange(L, dtype=jnp.int32)
    (h, k_pages, v_pages), _ = jax.lax.scan(body, (x_Bx1xD, k_pages, v_pages),
                                            (w["layers"], layers))
    h = _norm(cfg, h, w["norm"])
    return head(w, h, targets_Bx1, True), k_pages, v_pages


def build(cfg: OuroConfig, dtype: str, phase: Phase, backend: str):
    """(fn, args, donate): the fair program of `phase` (`learner_step` or `decode`) for
    `backend` (`gpu` or `tpu`) at `cfg`'s widths and layer count in `dtype`, its arguments as
    ShapeDtypeStructs, and the argument indices to donate (the decode's paged cache `[J,
    L*B*S/PAGE, PAGE, K]`: the same bytes as the sampler's cache of one loop). Raises
    ValueError for another phase kind or a cache length not a multiple of PAGE."""
    w = abstract_weights(cfg, dtype)
    dt = jnp.dtype(dtype)
    sds = jax.ShapeDtypeStruct
    B, C, S = phase.B, phase.C, phase.S
    x = sds((B, C, cfg.hidden_size), dt)
    pad, targets = sds((B,), jnp.int32), sds((B, C), jnp.int32)
    if phase.kind == "learner_step":
        return functools.partial(_learner_step, cfg, backend), (w, x, pad, targets), ()
    if phase.kind != "decode":
        raise ValueError(f"no fair program for phase kind {phase.kind!r}")
    if S % PAGE:
        raise ValueError(f"the fair decode's cache length {S} is not a multiple of {PAGE}")
    pages = sds((cfg.num_kv_heads, cfg.num_layers * B * S // PAGE, PAGE, cfg.head_dim), dt)
    w = abstract_weights(cfg, dtype, layers=True)  # the stacks cast once
    fn = functools.partial(_decode, cfg, backend)
    return fn, (w, x, pages, pages, pad, sds((), jnp.int32), targets), (2, 3)
