"""The sampler's Gumbel-max draw (`processing.sample_tokens`) is `jax.random.categorical`'s,
token for token, though its scores are materialised before the argmax instead of fused into it:
the noise's logs give the same bits in either form, for every uniform draw there is."""
import jax
import jax.numpy as jnp
import numpy as np

from looprl import kernels as kn
from looprl.sampling.processing import sample_tokens


def _gumbel_of_bits(bits_N):
    """`jax.random.gumbel`'s default noise from its random uint32 bits, as XLA simplifies it:
    the high 23 bits are the mantissa of u + 1 in [1, 2), u = max(tiny, u), -log(-log(u))."""
    fb = (bits_N >> 9) | np.uint32(0x3F800000)
    u = jax.lax.bitcast_convert_type(fb, jnp.float32) - 1.0
    u = jnp.maximum(jnp.float32(np.finfo(np.float32).tiny), u)
    return -jnp.log(-jnp.log(u))


def test_noise_has_the_same_bits_in_a_loop_and_inside_a_reduce():
    """All 2^23 draws: the noise as its own (vectorised) loop, and computed inside a reduce's
    scalar loop (a max over [noise, -inf], the value the fused argmax compares)."""
    bits = jnp.asarray(np.arange(1 << 23, dtype=np.uint32) << 9)

    def in_reduce(bits):
        g = _gumbel_of_bits(bits)[:, None]
        return jnp.max(jnp.concatenate([g, jnp.full_like(g, -jnp.inf)], axis=1), axis=1)

    computations = jax.jit(in_reduce).lower(bits).compile().as_text().split("\n\n")
    with_logs = [c for c in computations if " log(" in c]
    assert with_logs and all(" reduce(" in c for c in with_logs)  # the logs are in the reduce
    loop = np.asarray(jax.jit(_gumbel_of_bits)(bits)).view(np.uint32)
    fused = np.asarray(jax.jit(in_reduce)(bits)).view(np.uint32)
    assert np.isfinite(np.asarray(loop).view(np.float32)).all()
    assert np.array_equal(loop, fused)


def test_tokens_equal_jax_random_categorical():
    """4096 rows x 58 tokens at three temperatures, random keys: the same token in every row."""
    rng = np.random.default_rng(0)
    keys = jax.random.split(jax.random.PRNGKey(3), 4096)
    old = jax.jit(jax.vmap(jax.random.categorical))
    new = jax.jit(lambda k, lp: sample_tokens(k, lp, greedy=False))
    for scale in (0.3, 3.0, 30.0):
        logp = kn.log_softmax(jnp.asarray(rng.standard_normal((4096, 58)) * scale, jnp.float32))
        want, got = np.asarray(old(keys, logp)), np.asarray(new(keys, logp))
        assert got.dtype == np.int32
        assert np.array_equal(want, got)


def test_row_argmax_is_jnp_argmax_on_ties_signed_zeros_nans_and_infinities():
    nan, inf = np.nan, np.inf
    x = np.array([[1.0, 3.0, 3.0, 2.0], [-0.0, 0.0, -1.0, -0.0], [0.0, -0.0, 0.0, 0.0],
                  [1.0, nan, 5.0, nan], [nan, 5.0, 1.0, 1.0], [-inf, -inf, -inf, -inf],
                  [-inf, -1e30, inf, inf], [2.0, 1.0, 0.5, 0.25]], np.float32)
    want = np.asarray(jnp.argmax(jnp.asarray(x), axis=-1))
    got = np.asarray(jax.jit(kn.row_argmax)(jnp.asarray(x)))
    assert got.dtype == np.int32 and got.tolist() == [1, 0, 0, 1, 0, 0, 2, 0]
    assert np.array_equal(got, want)
    assert np.asarray(kn.row_argmax(jnp.ones((3, 1), jnp.float32))).tolist() == [0, 0, 0]
