"""Row invariance of the batch-invariant kernels (looprl.kernels): a row's bits must not
depend on how many other rows ran with it, on XLA CPU with the pinned thread count."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from looprl import kernels as kn
from looprl.kernels import ops

ROWS = (1, 2, 5, 8, 32, 63, 64, 100)


def _bits(x):
    x = np.asarray(x)
    return x.view(np.uint16 if x.dtype.itemsize == 2 else np.uint32)


def _rows_invariant(fn, x):
    f = jax.jit(fn)
    ref = _bits(f(x))
    return [n for n in ROWS if not np.array_equal(_bits(f(x[:n])), ref[:n])]


@pytest.mark.parametrize("dtype, out_dtype", [("float32", None), ("bfloat16", None),
                                               ("bfloat16", "float32")])
@pytest.mark.parametrize("k, n", [(64, 128), (128, 384), (384, 128), (64, 1), (64, 58),
                                  (300, 4), (64, 17), (129, 33)])
def test_matmul_rows_do_not_depend_on_the_row_count(k, n, dtype, out_dtype):
    """CPU: rows padded to a row tile (a multiple of ROW_QUANTUM: 8 with AVX-512, 24
    elsewhere; with 8 on an AVX2 machine 8- and 32-row calls differed), K > 128 in 128-long
    blocks (384, 300, 129), N padded to a multiple of 16; without them 1 row (matrix-vector),
    2..7 rows, 8..32-row vs 40..256-row tiles with an unsplit K = 384, and the last column of a
    single row when N = 8j + 1 (17, 33) differed from 256 rows."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((256, k)), dtype)
    w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), dtype)
    assert _rows_invariant(lambda a: kn.matmul(a, w, out_dtype), x) == []


@pytest.mark.parametrize("seq_len, dtype", [  # the chunks at Ouro widths: test_kernels_ouro_shapes
    (300, "bfloat16"), *[pytest.param(s, d, marks=pytest.mark.slow)
                         for s, d in ((40, "float32"), (40, "bfloat16"), (300, "float32"))]])
def test_attention_query_rows_do_not_depend_on_how_many_ran(dtype, seq_len):
    """A query's output must not depend on the chunk it ran in (1 decode query, a deferred
    window, a whole teacher-forced sequence) nor on the batch: 1 query row was a matrix-vector
    product and a key axis longer than 128 was split by the row count before the query rows
    were padded and the value product was cut into 128-key blocks."""
    rng = np.random.default_rng(2)
    B, C, H, K = 3, 64, 4, 32
    q = jnp.asarray(rng.standard_normal((B, C, H, K)), dtype)
    k = jnp.asarray(rng.standard_normal((B, seq_len, H, K)), dtype)
    v = jnp.asarray(rng.standard_normal((B, seq_len, H, K)), dtype)
    mask = jnp.asarray(rng.random((B, C, seq_len)) < 0.8)
    f = jax.jit(lambda q, k, v, m: kn.attention(q, k, v, m, K ** -0.5))
    ref = _bits(f(q, k, v, mask))
    bad = [(b, c) for b in (1, 3) for c in (1, 2, 3, 8, 9, 17, 64)
           if not np.array_equal(_bits(f(q[:b, :c], k[:b], v[:b], mask[:b, :c])), ref[:b, :c])]
    assert bad == []


@pytest.mark.parametrize("vocab, temperature", [(58, 1.0), (49, 0.7), *[
    pytest.param(v, t, marks=pytest.mark.slow) for v, t in ((49, 1.0), (58, 0.7), (64, 1.0),
                                                          (64, 0.7))]])
def test_log_softmax_of_scaled_logits_does_not_depend_on_the_row_count(vocab, temperature):
    """Regression: `exp(x - max)` fused after a temperature division compiled differently for
    < 64 rows and for rows that are not whole vectors (vocab 58: 32 sampler rows vs 128 differed
    in low bits, so replay failed whenever a device held 32 rollout rows)."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((128, vocab)) * 4, jnp.float32)
    t = jnp.float32(temperature)
    assert _rows_invariant(lambda a: kn.log_softmax(a / t), x) == []
    assert _rows_invariant(lambda a: kn.softmax(a / t), x) == []


def test_log_softmax_keeps_minus_inf_and_sums_to_one():
    x = jnp.asarray([[0.0, -jnp.inf, 1.0], [2.0, 2.0, 2.0]], jnp.float32)
    lp = np.asarray(kn.log_softmax(x))
    assert lp[0, 1] == -np.inf and np.isfinite(lp[0, [0, 2]]).all()
    np.testing.assert_allclose(np.exp(lp).sum(-1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(kn.softmax(x)), np.exp(lp), rtol=1e-6)
    g = jax.grad(lambda a: jnp.sum(jnp.where(jnp.isfinite(kn.log_softmax(a)),
                                             kn.log_softmax(a), 0.0)))(x)
    assert np.isfinite(np.asarray(g)[:, [0, 2]]).all()


def _product_rowsum(x):
    """`rowsum` as it was before `ordered_gemm.row_sum`: the ordered product with a ones column."""
    ones = np.zeros((x.shape[-1], kn.N_MIN), np.float32)
    ones[:, 0] = 1.0
    return kn.matmul(x.astype(jnp.float32), jnp.asarray(ones))[..., :1]


def _product_softmax(x):
    def fn(x):
        e = jnp.exp(x - jax.lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True)))
        return e / _product_rowsum(e)
    return ops._tiled_rows(fn, x.astype(jnp.float32))


def _product_log_softmax(x):
    def fn(x):
        shifted = x - jax.lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True))
        return shifted - jnp.log(_product_rowsum(jnp.exp(shifted)))
    return ops._tiled_rows(fn, x.astype(jnp.float32))


def _product_rms_norm(x, w, eps):
    xf = x.astype(jnp.float32)
    var = _product_rowsum(xf * xf) * jnp.float32(1.0 / x.shape[-1])
    return (xf * jax.lax.rsqrt(var + jnp.float32(eps))).astype(x.dtype) * w.astype(x.dtype)


# (64, 4, 1, 128): a decode step's scores at 64 rows (4 heads, 128 slots); (256, 49152): the
# sampler's log-probs over Ouro's vocabulary at the RL batch; (130, 58): the arithmetic vocab
@pytest.mark.parametrize("shape", [(64, 4, 1, 128), (130, 58), (7, 300),
                                   pytest.param((256, 49152), marks=pytest.mark.slow),
                                   (16, 49152)])
def test_softmax_and_log_softmax_have_the_product_forms_bits(shape):
    """The row max and sum as FFI reductions (`ordered_gemm.row_max` / `row_sum`) leave every
    bit of softmax and log_softmax as the max-reduce-and-product form gave them (argument in
    `ops._row_max` and `row_sum`), for ordinary rows, rows with masked (-1e30) and -inf
    entries, a row whose max is a zero with -0.0, +0.0 and subnormal ties, a row with one zero
    and the rest far below (log-sum 0: the zero's sign is the output's), and a padding row of
    MASK_VALUE only; and the gradient of log_softmax is the product form's, bit for bit."""
    rng = np.random.default_rng(sum(shape))
    x = (rng.standard_normal(shape) * 3).astype(np.float32)
    rows = x.reshape(-1, shape[-1])
    rows[rng.integers(0, rows.shape[0], 20), rng.integers(0, shape[-1], 20)] = kn.MASK_VALUE
    rows[1, :] = -1000.0
    rows[1, :4] = [-0.0, 0.0, 3e-39, -0.0]  # max a zero, tied between bit patterns
    rows[2, :] = -1000.0
    rows[2, 3] = -0.0                        # one zero: log(sum) = +0
    rows[3, :] = kn.MASK_VALUE               # a padding query row
    rows[4, : shape[-1] // 2] = -np.inf
    xj = jnp.asarray(x)
    for new, old in [(kn.softmax, _product_softmax), (kn.log_softmax, _product_log_softmax)]:
        got, want = jax.jit(new)(xj), jax.jit(old)(xj)
        assert np.array_equal(_bits(got), _bits(want)), new.__name__
    x5 = xj.reshape(-1, shape[-1])[5:9]  # finite rows for the gradient
    ct = jnp.asarray(rng.standard_normal(x5.shape).astype(np.float32))
    grads = [jax.jit(jax.grad(lambda a, f=f: jnp.sum(f(a) * ct)))(x5)
             for f in (kn.log_softmax, _product_log_softmax)]
    assert np.array_equal(_bits(grads[0]), _bits(grads[1]))


@pytest.mark.parametrize("jit", [True, False])
def test_softmax_gradients_keep_negative_zeros_as_the_product_form(jit):
    """Regression (a review of bf5faf8): the sum's kept-alive operand must add nothing to the
    gradient, not an array of zeros (which turns a -0.0 gradient entry +0.0 outside jit): -0.0
    cotangents at masked positions, eager and jitted, softmax and log_softmax."""
    x = jnp.asarray([[1.0, 2.0, kn.MASK_VALUE, 0.5], [kn.MASK_VALUE, 3.0, -1.0, 2.0]], jnp.float32)
    ct = jnp.asarray([[1.0, 1.0, -0.0, 2.0], [-0.0, -1.0, 0.5, 1.0]], jnp.float32)
    for new, old in [(kn.softmax, _product_softmax), (kn.log_softmax, _product_log_softmax)]:
        grads = []
        for f in (new, old):
            g = jax.grad(lambda a, f=f: jnp.sum(f(a) * ct))
            grads.append(jax.jit(g)(x) if jit else g(x))
        assert np.array_equal(_bits(grads[0]), _bits(grads[1])), new.__name__
        assert np.signbit(np.asarray(grads[0])[0, 2]) == np.signbit(np.asarray(grads[1])[0, 2])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rms_norm_has_the_product_forms_bits_at_ouro_width(dtype):
    """RMSNorm's mean of squares through `row_sum`: the product form's bits, forward and
    gradient, at Ouro's hidden size 2048 (eight k chunks) for 1 and 300 rows."""
    rng = np.random.default_rng(2)
    w = jnp.asarray(1 + 0.1 * rng.standard_normal(2048), dtype)
    for m in (1, 300):
        x = jnp.asarray(rng.standard_normal((m, 2048)) * 2, dtype)
        got = jax.jit(lambda a: kn.rms_norm(a, w, 1e-6))(x)
        want = jax.jit(lambda a: _product_rms_norm(a, w, 1e-6))(x)
        assert np.array_equal(_bits(got), _bits(want))
        grads = [jax.jit(jax.grad(lambda a, f=f: jnp.sum(f(a, w, 1e-6).astype(jnp.float32))))(x)
                 for f in (kn.rms_norm, _product_rms_norm)]
        assert np.array_equal(_bits(grads[0]), _bits(grads[1]))


def test_the_accelerator_form_pads_rows_and_asks_for_full_fp32_precision():
    """The GPU/TPU form (fixed 64-row tiles, 128-long K blocks, Precision.HIGHEST for fp32 so
    GPUs do not use TF32; tests/kernels/test_pallas_kernels.py checks its structure and bits),
    traced and run here with `use_form("pallas-gpu")` (interpreted): same values as the CPU
    form, and the precision request is in the program (none for bf16)."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((5, 3, 64)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((64, 40)) / 8, jnp.float32)
    q = jnp.asarray(rng.standard_normal((2, 3, 4, 16)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((2, 20, 4, 16)), jnp.float32)
    mask = jnp.asarray(rng.random((2, 3, 20)) < 0.7).at[:, :, 0].set(True)
    cpu_mm, cpu_att = kn.matmul(x, w), kn.attention(q, kv, kv, mask, 0.25)
    with kn.use_form("pallas-gpu"):
        np.testing.assert_allclose(np.asarray(kn.matmul(x, w)), np.asarray(cpu_mm), rtol=1e-5,
                                   atol=1e-5)
        np.testing.assert_allclose(np.asarray(kn.attention(q, kv, kv, mask, 0.25)),
                                   np.asarray(cpu_att), rtol=1e-5, atol=1e-5)
        assert "HIGHEST" in str(jax.make_jaxpr(kn.matmul)(x, w))
        assert "HIGHEST" in str(jax.make_jaxpr(kn.stock_matmul)(x, w))
        xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
        assert "HIGHEST" not in str(jax.make_jaxpr(kn.matmul)(xb, wb))
        assert kn.row_tile() == kn.ROW_TILE
    jax.clear_caches()  # traces do not know the form
    assert "HIGHEST" not in str(jax.make_jaxpr(kn.stock_matmul)(x, w))  # the CPU form again


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_attention_does_not_depend_on_the_left_padding(dtype):
    """100 live keys in a prompt bucket of P = 128 (pad 28) and of P = 192 (pad 92,
    the live keys straddling slot 128 of the cache): the same queries over the same keys give
    the same bits (keys are rotated to each row's first live key, so 128-key blocks sit at token
    positions)."""
    rng = np.random.default_rng(0)
    H, K, live, C = 4, 128, 100, 8
    q = rng.standard_normal((1, C, H, K)).astype(np.float32)
    kv = rng.standard_normal((2, 1, live, H, K)).astype(np.float32)
    outs = []
    for P in (128, 192):
        S, pad = P + 16, P - live
        k = np.zeros((1, S, H, K), np.float32)
        v = np.zeros((1, S, H, K), np.float32)
        k[:, pad:pad + live], v[:, pad:pad + live] = kv[0], kv[1]
        qpos = pad + live - C + np.arange(C)  # the last C live positions query
        mask = (np.arange(S)[None, :] >= pad) & (np.arange(S)[None, :] <= qpos[:, None])
        f = jax.jit(lambda q, k, v, m: kn.attention(q, k, v, m, K ** -0.5))
        out = f(jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype),
                jnp.asarray(mask[None]))
        outs.append(np.asarray(out.astype(jnp.float32)).view(np.uint32))
    assert np.array_equal(outs[0], outs[1])


def test_repeat_kv_heads_gives_head_h_the_kv_head_h_over_the_group_size():
    k = jnp.arange(2 * 3 * 2 * 4, dtype=jnp.float32).reshape(2, 3, 2, 4)  # J = 2 kv heads
    kr, vr = kn.repeat_kv_heads(k, -k, 4)
    assert kr.shape == (2, 3, 4, 4)
    for h in range(4):
        np.testing.assert_array_equal(np.asarray(kr[:, :, h]), np.asarray(k[:, :, h // 2]))
        np.testing.assert_array_equal(np.asarray(vr[:, :, h]), -np.asarray(k[:, :, h // 2]))
    same_k, _ = kn.repeat_kv_heads(k, k, 2)
    assert same_k is k
