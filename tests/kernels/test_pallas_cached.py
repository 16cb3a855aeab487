"""The GPU Pallas attention over the sampler's KV cache read in place (`pallas-gpu`,
`flash_attention_cached`), checked from the CPU (kernels interpreted): the same raw bits as the
attention over the slot copy `kv.slots()`, and a program that exports for CUDA with the cache
passed whole (no slot gathered)."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from looprl import kernels as kn
from looprl.kernels import forms
from looprl.kernels.plain import attention_plain

N, B, J, H, K = 2, 4, 2, 4, 16  # 2 cache slots of 4 batch rows; GQA: 2 kv heads, 4 heads


def _bits(x):
    x = np.asarray(x)
    return x.view(np.uint16 if x.dtype.itemsize == 2 else np.uint32)


def _case(rng, S, C, w0, pads, q_dtype, cache_dtype):
    """q `[M, C, H, K]`, a CachedKV reading slot 1 at batch rows (2, 0, 3) and its KeyRange.
    The rows and slot not read hold NaN: a read of the wrong row poisons the output."""
    cache = rng.standard_normal((2, N, B, S, J, K)).astype(np.float32)
    cache[:, 0] = np.nan
    cache[:, 1, 1] = np.nan
    rows = np.asarray([2, 0, 3], np.int32)
    M = len(rows)
    win = rng.standard_normal((2, M, C, J, K))
    q = jnp.asarray(rng.standard_normal((M, C, H, K)), q_dtype)
    kv = kn.CachedKV(*(jnp.asarray(c, cache_dtype) for c in cache), jnp.int32(1),
                     jnp.asarray(rows), jnp.int32(w0),
                     *(jnp.asarray(w, q_dtype) for w in win))
    w0c = min(max(w0, 0), S - C)
    return q, kv, kn.KeyRange(jnp.asarray(pads, jnp.int32), w0c + jnp.arange(C), S)


# (S, C, w0, pads): decode at the last slot and mid-block (row 2, pad 250, sees no key); a
# 5-wide window across a block cut of row 0 (pad 40: its blocks start at 40, 168, ...) and
# one past S - C (clamped); two query tiles (C = 70: rows whose first tile sees no key, a row
# that sees none); a prefill (C = S); pads 40 and 250 straddle 128-key blocks
CASES = [(300, 1, 299, (40, 250, 0)), (300, 1, 200, (40, 0, 250)),
         (300, 5, 165, (40, 150, 3)), (300, 5, 298, (250, 40, 0)),
         (300, 70, 200, (40, 250, 290)), (70, 70, 0, (0, 5, 69))]
_SLOW = pytest.mark.slow
RUNS = [("pallas-gpu", "float32", "float32"), ("pallas-gpu", "bfloat16", "bfloat16"),
        ("pallas-tpu", "float32", "float32"),
        pytest.param("pallas-tpu", "bfloat16", "bfloat16", marks=_SLOW),
        pytest.param("pallas-gpu", "float32", "bfloat16", marks=_SLOW),
        pytest.param("pallas-tpu", "float32", "bfloat16", marks=_SLOW)]


@pytest.mark.parametrize("form,q_dtype,cache_dtype", RUNS)
def test_cached_attention_equals_attention_over_the_slot(form, q_dtype, cache_dtype):
    """Raw bits: for every case, `attention_cached` (the GPU: the cache read in place, the
    window laid over it in the kernel; the TPU: its decode kernel at C = 1, the slot copy
    otherwise) equals `attention` over `kv.slots()` (the slot copied, the window written,
    padded), fp32 and bf16, and a bf16 cache under fp32 queries; the values agree with the
    plain attention over the slot (finite: no NaN row or slot was read)."""
    rng = np.random.default_rng(7)
    with kn.use_form(form):
        assert forms.current().attention_cached is not None
        jax.clear_caches()
        for S, C, w0, pads in CASES:
            q, kv, keys = _case(rng, S, C, w0, pads, q_dtype, cache_dtype)
            got = jax.jit(lambda q, kv, p, c: kn.attention_cached(
                q, kv, kn.KeyRange(p, c, S), K ** -0.5))(q, kv, keys.pad_B, keys.layout_C)
            k, v = kv.slots()
            want = kn.attention(q, k.astype(q.dtype), v.astype(q.dtype), keys.mask(),
                                K ** -0.5)
            assert got.shape == (3, C, H, K) and got.dtype == q.dtype
            assert np.array_equal(_bits(got), _bits(want)), (S, C, w0, pads)
            if C == 5:  # a bool mask: the int mask operand instead of the key range
                by_mask = kn.attention_cached(q, kv, keys.mask(), K ** -0.5)
                assert np.array_equal(_bits(by_mask), _bits(want)), (S, C, w0, pads)
            ref = attention_plain(
                jnp.swapaxes(q, 1, 2).astype(jnp.float32),
                *kn.repeat_kv_heads(k.astype(jnp.float32), v.astype(jnp.float32), H),
                keys.mask(), K ** -0.5, None)
            tol = 3e-2 if "bfloat16" in (q_dtype, cache_dtype) else 1e-5
            seen = np.asarray(keys.mask()).any(-1)  # [M, C]: a query that sees no key gives 0
            got, ref = np.asarray(got, np.float32), np.asarray(jnp.swapaxes(ref, 1, 2))
            np.testing.assert_allclose(got[seen], ref[seen], rtol=tol, atol=tol)
            assert np.all(got[~seen] == 0) and seen.mean() > 0.4, (S, C, w0)
    jax.clear_caches()


def test_key_range_table_is_the_block_table_of_its_mask():
    """`key_range_table` (from the index vectors) equals `block_table` of the padded mask:
    unordered and out-of-range layout indices, pads past every query, 1 to 3 query tiles."""
    from looprl.kernels.pallas.attention import block_table, key_range_table
    from looprl.kernels.pallas.matmul import pad_to_multiple
    rng = np.random.default_rng(3)
    for S, C in ((300, 1), (300, 70), (130, 130), (513, 150)):
        for _ in range(4):
            keys = kn.KeyRange(jnp.asarray(rng.integers(0, S + 2, 5), jnp.int32),
                               jnp.asarray(rng.integers(-2, S + 3, C), jnp.int32), S)
            mask = pad_to_multiple(pad_to_multiple(keys.mask(), 1, kn.ROW_TILE), 2, 128)
            meta, layout = key_range_table(keys, mask.shape[1])
            assert np.array_equal(np.asarray(meta), np.asarray(block_table(mask))), (S, C)
            assert layout.shape == (mask.shape[1], 1) and int(layout[C:].max(initial=-1)) == -1


@pytest.mark.parametrize("form,platform,target", [
    ("pallas-gpu", "cuda", "__gpu$xla.gpu.triton"), ("pallas-tpu", "tpu", "tpu_custom_call")])
def test_cached_attention_exports_without_a_slot_copy(form, platform, target):
    """Lowering only: the decode's cached attention exports for CUDA (`pallas-gpu`: the caches
    whole as `[N*B', S, J*K]`) and for a TPU (`pallas-tpu`) as one kernel call each; no gather
    or dynamic slice of a slot-sized array is left in the program (the fallback `kv.slots()`
    has both)."""
    S, C, K = 2048, 1, 128  # a TPU block's lanes: 128
    sds = jax.ShapeDtypeStruct
    cache = sds((N, B, S, J, K), jnp.bfloat16)
    win = sds((3, C, J, K), jnp.bfloat16)
    args = (sds((3, C, H, K), jnp.bfloat16), cache, cache, sds((), jnp.int32),
            sds((3,), jnp.int32), sds((), jnp.int32), win, win, sds((3,), jnp.int32))

    def fn(q, kc, vc, slot, rows, w0, kw, vw, pads):
        kv = kn.CachedKV(kc, vc, slot, rows, w0, kw, vw)
        return kn.attention_cached(q, kv, kn.KeyRange(pads, w0 + jnp.arange(C), S), 0.25)
    check = export.DisabledSafetyCheck.custom_call(target)
    with kn.use_form(form):
        jax.clear_caches()
        text = export.export(jax.jit(fn), platforms=(platform,),
                             disabled_checks=[check])(*args).mlir_module()
    jax.clear_caches()
    assert text.count(f"stablehlo.custom_call @{target}(") == 1, form
    if platform == "cuda":
        assert text.count(f"tensor<{N * B}x{S}x{J * K}xbf16>") >= 2
    slot = f"{S}x{J}x{K}xbf16"
    assert not re.search(rf"(gather|dynamic_slice|dynamic_update_slice).*tensor<\d+x{slot}>",
                         text), "a slot-sized gather or slice is left"
