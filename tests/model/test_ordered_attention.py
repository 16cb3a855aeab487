"""Attention's two ordered products read from the KV cache in place
(`cpu.ffi.ordered_attention_scores` / `_values`, looprl/kernels/cpu/csrc/ordered_attention.cc): each output
is exactly the chain the kernel's comment defines, written here in numpy from the rotated
128-slot blocks (`reference_matmul`, the ordered matmul's correctly rounded emulation), for
fp32 and bf16 caches, GQA, a window written over the slot (w0 clamped as
`dynamic_update_slice` clamps), sub-batch rows, another slot of a many-slot cache, 1-5 query
rows (every register-block path), a head dim with a scalar tail and one of 32 at one query
row (two heads' chains interleaved, an odd head alone); `attention` gives the bits of the form
it replaced (rotated K/V blocks gathered, then `ordered_batched_matmul`, rebuilt below) on one
block (Sp = 128), several, and several query tiles; and `attention_cached` gives the bits of
`attention` on the slot it describes."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from looprl import kernels as kn
from looprl.kernels import tiling
from looprl.kernels.cpu import ffi as og

KB = og.KEY_BLOCK


def _u32(x):
    return np.asarray(x, np.float32).view(np.uint32)


def _slot_keys(cache, win, rows, slot, w0):
    """The slot the kernel reads, made in numpy: `[M, S, J, D]` float32."""
    S, C = cache.shape[2], win.shape[1]
    w0 = min(max(w0, 0), S - C)
    keys = np.array(cache[slot][rows], np.float32)
    keys[:, w0:w0 + C] = win
    return keys


def _rotated_block(keys_SxJxD, offset, blk, Sp, kv):
    """Block `blk` of a row's rotated key axis, head `kv`: `[128, D]`."""
    S = keys_SxJxD.shape[0]
    slot = np.minimum((blk * KB + np.arange(KB) + offset) % Sp, S - 1)
    return keys_SxJxD[slot, kv]


def _case(rng, M, H, J, R, D, N, B, S, C, dtype):
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    cache = np.asarray(jnp.asarray(f(N, B, S, J, D), dtype).astype(jnp.float32))
    win = np.asarray(jnp.asarray(f(M, C, J, D), dtype).astype(jnp.float32))
    rows = rng.permutation(B)[:M].astype(np.int32)
    return f(M, H, R, D), cache, win, rows


@pytest.mark.parametrize("M, H, J, R, D, N, S, C, w0, live", [
    (3, 4, 4, 1, 32, 1, 40, 1, 39, 1),      # a decode step: one query, window at the end
    (2, 4, 2, 3, 40, 8, 300, 2, 298, 3),    # GQA, another slot, 3 blocks, a 40-wide head
    (2, 2, 2, 5, 16, 2, 129, 7, 200, 2),    # w0 past the end (clamped), 5 rows (4 + 1)
    (1, 2, 1, 2, 128, 3, 260, 260, 0, 3),   # the window is the whole slot (the learner's)
    (2, 5, 5, 1, 32, 1, 200, 1, 150, 2),    # one query, head dim 32: heads in pairs, one left
    (17, 4, 2, 1, 32, 2, 200, 1, 150, 2),   # 17 rows: a row's kv heads read together (GQA)
    (16, 6, 3, 2, 128, 1, 300, 3, 100, 3),  # head dim 128: kv heads two at a time, one left
])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_scores_and_values_are_the_documented_chains(M, H, J, R, D, N, S, C, w0, live, dtype):
    rng = np.random.default_rng(M * 100 + S + R)
    B = M + 2
    q, cache, win, rows = _case(rng, M, H, J, R, D, N, B, S, C, dtype)
    Sp = -(-S // KB) * KB
    slot = N - 1
    offset = rng.integers(0, Sp, M).astype(np.int32)
    span = rng.integers(1, live * KB + 1, M).astype(np.int32)
    jc, jw = (jnp.asarray(cache, dtype), jnp.asarray(win, dtype))
    scores = jax.jit(og.ordered_attention_scores, static_argnums=9)(
        jnp.asarray(q), jc, jw, rows, offset, span, slot, w0, live, Sp)
    probs = rng.random((M, H, R, Sp)).astype(np.float32)
    probs[..., ::5] = 0.0
    for m in range(M - 1):  # zero past the span (masked), as the softmax gives them; the last
        probs[m, ..., span[m]:] = 0.0  # row keeps nonzero ones there (a padding query row's)
    values = jax.jit(og.ordered_attention_values)(jnp.asarray(probs), jc, jw, rows, offset, span,
                                                  slot, w0, live)
    keys = _slot_keys(cache, win, rows, slot, w0)
    for m in range(M):
        for h in range(H):
            kv = h // (H // J)
            acc = np.full((R, D), -0.0, np.float32)
            for blk in range(live):
                block = _rotated_block(keys[m], offset[m], blk, Sp, kv)
                ref = og.reference_matmul(q[m, h], block.T)  # [R, 128]
                got = np.asarray(scores[m, h, :, blk * KB:(blk + 1) * KB])
                seen = min(KB, max(0, span[m] - blk * KB))  # slots past the span: masked
                assert np.array_equal(_u32(got[:, :seen]), _u32(ref[:, :seen])), (m, h, blk)
                acc = og._flush(acc + og.reference_matmul(probs[m, h, :, blk * KB:(blk + 1) * KB],
                                                          block))
            past = max(live * KB, -(-span[m] // 16) * 16)  # after the span's last panel: +0.0
            assert not np.any(_u32(scores[m, h, :, past:])), (m, h)
            assert np.array_equal(_u32(values[m, h]), _u32(acc)), (m, h)


def test_no_live_block_gives_zeros():
    """live = 0: every score +0.0, every value -0.0 (the accumulator's start)."""
    q = jnp.ones((2, 2, 1, 16), jnp.float32)
    cache = jnp.ones((1, 2, 10, 2, 16), jnp.float32)
    args = (cache, cache[0, :, :1], np.arange(2, dtype=np.int32), np.zeros(2, np.int32))
    s = og.ordered_attention_scores(q, *args, np.full(2, 10, np.int32), 0, 0, 0, 128)
    v = og.ordered_attention_values(jnp.ones((2, 2, 1, 128)), *args, np.full(2, 10, np.int32),
                                    0, 0, 0)
    assert np.array_equal(_u32(s), np.zeros((2, 2, 1, 128), np.uint32))
    assert np.array_equal(_u32(v), np.full((2, 2, 1, 16), 0x80000000, np.uint32))


def test_bad_operands_are_named():
    q = jnp.ones((2, 2, 1, 16), jnp.float32)
    cache = jnp.ones((1, 2, 10, 2, 16), jnp.float32)
    rows, off = np.arange(2, dtype=np.int32), np.zeros(2, np.int32)
    with pytest.raises(ValueError, match="not a multiple of 128"):
        og.ordered_attention_scores(q, cache, cache[0, :, :1], rows, off, off, 0, 0, 1, 100)
    with pytest.raises(ValueError, match="head dim"):
        og.ordered_attention_scores(q[..., :8], cache, cache[0, :, :1], rows, off, off, 0, 0, 1,
                                    128)
    with pytest.raises(ValueError, match=r"are not \[M\]"):
        og.ordered_attention_values(jnp.ones((2, 2, 1, 128)), cache, cache[0, :, :1], rows[:1],
                                    off, off, 0, 0, 1)
    with pytest.raises(ValueError, match="window"):
        og.ordered_attention_values(jnp.ones((2, 2, 1, 128)), cache, cache[0, :, :2, :1], rows,
                                    off, off, 0, 0, 1)
    with pytest.raises(ValueError, match="one dtype"):
        og.ordered_attention_values(jnp.ones((2, 2, 1, 128)), cache,
                                    cache[0, :, :1].astype(jnp.bfloat16), rows, off, off, 0, 0,
                                    1)
    with pytest.raises(ValueError, match="be 0"):
        og.ordered_attention_values(jnp.ones((2, 0, 1, 128)), cache, cache[0, :, :1], rows, off,
                                    off, 0, 0, 1)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_attention_cached_is_attention_on_the_slot(dtype):
    """A 3-row sub-batch of a 5-row, 6-slot cache, GQA (4 heads, 2 kv heads), a 2-position
    window: `attention_cached` (read in place) == `attention` on `kv.slots()`, bit for bit."""
    rng = np.random.default_rng(7)
    T_L, B, S, J, K, H, C = 6, 5, 150, 2, 32, 4, 2
    cache = jnp.asarray(rng.standard_normal((2, T_L, B, S, J, K)), dtype)
    rows = jnp.asarray([4, 0, 2], jnp.int32)
    win = jnp.asarray(rng.standard_normal((2, 3, C, J, K)), dtype)
    kv = kn.CachedKV(cache[0], cache[1], jnp.int32(3), rows, jnp.int32(140), win[0], win[1])
    q = jnp.asarray(rng.standard_normal((3, C, H, K)), dtype)
    pad = np.array([0, 30, 100])
    s = np.arange(S)
    mask = jnp.asarray((s[None, None] >= pad[:, None, None])
                       & (s[None, None] <= 140 + np.arange(C)[None, :, None]))
    got = jax.jit(kn.attention_cached, static_argnums=3)(q, kv, mask, K ** -0.5)
    want = jax.jit(kn.attention, static_argnums=4)(q, *kv.slots(), mask, K ** -0.5)
    assert np.array_equal(_u32(got.astype(jnp.float32)), _u32(want.astype(jnp.float32)))


def _gathered_attention(q_BxCxHxK, k_BxSxJxK, v_BxSxJxK, mask_BxCxS, scale):
    """The ordered CPU attention as it was before the cache was read in place (6814715): each
    live block's rotated K/V gathered, both products `ordered_batched_matmul` per (b, h)."""
    B, C, H, K = q_BxCxHxK.shape
    k_BxSxHxK, v_BxSxHxK = kn.repeat_kv_heads(k_BxSxJxK, v_BxSxJxK, H)
    q_BxHxCxK = jnp.swapaxes(q_BxCxHxK, 1, 2)
    dtype = q_BxHxCxK.dtype
    mask, offset_B = tiling.mask_in_blocks(mask_BxCxS)
    S = mask.shape[2]
    mask = tiling.keys_from_first_live(mask, offset_B, 2)

    def key_block(x_BxSxHxK, j):
        x = tiling.keys_from_first_live(x_BxSxHxK, offset_B, 1, j * KB, KB, period=S)
        return jnp.swapaxes(x, 1, 2).astype(jnp.float32)

    def per_head_dot(x, w, transposed=False):
        b, h, r, i = x.shape
        y = og.ordered_batched_matmul(x.reshape(b * h, r, i), w.reshape(b * h, *w.shape[2:]),
                                      transposed)
        return y.reshape(b, h, r, y.shape[-1])

    def tile(qm):
        q, m = qm
        q32 = q.astype(jnp.float32)
        R = q32.shape[2]
        n = tiling.live_key_blocks(m)

        def over(body, init):
            return body(0, init) if S == KB else jax.lax.fori_loop(0, n, body, init)

        scores = over(lambda j, buf: jax.lax.dynamic_update_slice_in_dim(
            buf, per_head_dot(q32, key_block(k_BxSxHxK, j), True), j * KB, axis=3),
            jnp.zeros((B, H, R, S), jnp.float32))
        probs = tiling.masked_probs(scores, m, scale, dtype, kn.softmax).astype(jnp.float32)
        acc = over(lambda j, acc: acc + per_head_dot(
            jax.lax.dynamic_slice_in_dim(probs, j * KB, KB, axis=3), key_block(v_BxSxHxK, j)),
            jnp.full((B, H, R, K), -0.0, jnp.float32))
        return acc.astype(dtype)

    t = tiling.row_tile_for(C)
    if C <= t:
        out = tile((q_BxHxCxK, mask))
    else:
        q_pad, _ = tiling.pad_rows(q_BxHxCxK, 2, t)
        m_pad, _ = tiling.pad_rows(mask, 1, t)
        out = tiling.map_query_tiles(tile, q_pad, m_pad, t)[:, :, :C]
    return jnp.swapaxes(out, 1, 2)


@pytest.mark.parametrize("B, C, S, H, J, K, dtype", [
    (5, 1, 40, 4, 4, 32, jnp.float32),     # a decode step of the tiny preset: Sp = 128
    (3, 3, 300, 4, 2, 32, jnp.bfloat16),   # a deferred window, GQA, three blocks
    (2, 600, 600, 2, 2, 64, jnp.float32),  # a prefill of two query tiles, five blocks
])
def test_attention_has_the_bits_of_the_gathered_form(B, C, S, H, J, K, dtype, monkeypatch):
    monkeypatch.delenv("LOOPRL_KERNELS", raising=False)  # the default form, whatever the env
    monkeypatch.delenv("LOOPRL_CPU_MATMUL", raising=False)
    jax.clear_caches()
    rng = np.random.default_rng(S + C)
    q = jnp.asarray(rng.standard_normal((B, C, H, K)), dtype)
    k, v = (jnp.asarray(rng.standard_normal((B, S, J, K)), dtype) for _ in range(2))
    pad = rng.integers(0, S - C + 1, B)
    pad[0] = S - C  # a row whose only keys are its queries'
    s = np.arange(S)
    mask = jnp.asarray((s[None, None] >= pad[:, None, None])
                       & (s[None, None] <= (S - C + np.arange(C))[None, :, None]))
    got = jax.jit(kn.attention, static_argnums=4)(q, k, v, mask, K ** -0.5)
    want = jax.jit(_gathered_attention, static_argnums=4)(q, k, v, mask, K ** -0.5)
    assert np.array_equal(_u32(got.astype(jnp.float32)), _u32(want.astype(jnp.float32)))


@pytest.mark.parametrize("D, R, off", [(32, 1, 0), (40, 2, 0), (32, 1, 37)])  # the two-head
def test_values_past_the_span_keep_the_full_chains_bits(D, R, off):  # path; chain_product's
    """The values past a row's span are skipped only where skipping cannot change a bit: an
    output that is -0.0 after the span's slots runs the whole block (there a masked slot's
    `+0 * v`, v >= 0, makes it +0.0); so does a block with a nonzero probability past the
    span. Each output equals the documented full chain (every slot of every live block)."""
    M, H, J, N, S = 3, 4, 2, 1, 256
    rng = np.random.default_rng(D + R + off)
    cache = rng.standard_normal((N, M, S, J, D)).astype(np.float32)
    cache[0, 0, :, :, :5] = -0.0  # row 0, head dims 0..4: -0.0 in every slot ...
    late = (np.arange(S) - off) % S >= 240  # ... except in its last rotated slots, far past the
    cache[0, 0, late, :, 1:3] = 2.0  # span (a re-read that restarts misaligned misses them)
    win = cache[0, :, :1].copy()
    rows = np.arange(M, dtype=np.int32)
    offset = np.full(M, off, np.int32)
    span = np.array([150, 40, 0], np.int32)  # block 1 partly seen; a short row; no seen slot
    probs = rng.random((M, H, R, 2 * KB)).astype(np.float32)
    for m in range(M):
        probs[m, ..., span[m]:] = 0.0
    probs[1, 2, 0, 100] = 0.25  # a nonzero probability past row 1's span (head 2)
    values = og.ordered_attention_values(jnp.asarray(probs), jnp.asarray(cache), jnp.asarray(win),
                                         rows, offset, span, 0, 0, 2)
    for m in range(M):
        for h in range(H):
            acc = np.full((R, D), -0.0, np.float32)
            for blk in range(2):
                block = _rotated_block(cache[0, m], off, blk, 2 * KB, h // 2)
                acc = og._flush(acc + og.reference_matmul(probs[m, h, :, blk * KB:(blk + 1) * KB],
                                                          block))
            assert np.array_equal(_u32(values[m, h]), _u32(acc)), (m, h)
    # the test can fail: row 0's dims 1, 2 are +0.0 only because block 1 ran past the span
    assert np.array_equal(_u32(values[0, :, :, 1:3]), np.zeros((H, R, 2), np.uint32))
    assert np.array_equal(_u32(values[0, :, :, 3:5]), np.full((H, R, 2), 0x80000000, np.uint32))


@pytest.mark.parametrize("S, C", [(40, 1), (128, 1), (300, 1), (50, 7), (256, 17)])
def test_a_key_range_gives_the_gathered_rotated_mask(S, C):
    """`KeyRange.rotated_blocks` (the sampler's attention builds the rotated mask from the
    indices) equals the pad-argmax-gather form on `KeyRange.mask()` value for value: rows with
    no padding, with padding, all masked (pad past every query), padding up to the last slot,
    and queries at the first, a middle and the last slot."""
    rng = np.random.default_rng(S + C)
    B = 9
    pad = np.array([0, 1, S // 2, S - 1, S - 1, 3, 0, S // 3, 2], np.int32)
    for w0 in (0, S // 3, S - C):
        layout = (w0 + np.arange(C)).astype(np.int32)
        kr = kn.KeyRange(jnp.asarray(pad), jnp.asarray(layout), S)
        want_mask, want_off = tiling.mask_in_blocks(kr.mask())
        want_mask = tiling.keys_from_first_live(want_mask, want_off, 2)
        got_mask, got_off = jax.jit(kr.rotated_blocks)()
        assert got_mask.shape == want_mask.shape and got_mask.dtype == want_mask.dtype
        assert np.array_equal(np.asarray(got_mask), np.asarray(want_mask)), w0
        assert np.array_equal(np.asarray(got_off), np.asarray(want_off)), w0
    pad_all = rng.integers(0, S, B).astype(np.int32)  # random pads, queries before some of them
    kr = kn.KeyRange(jnp.asarray(pad_all), jnp.asarray((np.arange(C) + S // 4).astype(np.int32)),
                     S)
    want_mask, want_off = tiling.mask_in_blocks(kr.mask())
    want_mask = tiling.keys_from_first_live(want_mask, want_off, 2)
    got_mask, got_off = kr.rotated_blocks()
    assert np.array_equal(np.asarray(got_mask), np.asarray(want_mask))
    assert np.array_equal(np.asarray(got_off), np.asarray(want_off))
