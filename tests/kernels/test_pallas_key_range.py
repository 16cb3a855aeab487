"""The Pallas attention's `KeyRange` operand (the mask built per block in the kernel from the
pad and layout vectors, no `[B, C, S]` mask made or read) gives the bits of the same attention
over `KeyRange.mask()`, forward and backward, on both backends (interpreted), fp32 and bf16:
left padding, a row that sees no key, S and C off the block sizes, GQA, layouts that start
inside the slot. The learner's layers hand the Pallas forms the `KeyRange`."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from looprl import kernels as kn
from looprl.kernels import KeyRange
from looprl.kernels.pallas.attention import flash_attention, key_range_operands
from looprl.kernels.pallas.attention_bwd import flash_attention_bwd

H, J, K = 4, 2, 32


def _bits(x):
    x = np.asarray(x)
    return x.view(np.uint16 if x.dtype.itemsize == 2 else np.uint32)


def _case(dtype, S, C, pads, w0):
    ks = jax.random.split(jax.random.PRNGKey(S + C), 4)
    B = len(pads)
    q = jax.random.normal(ks[0], (B, H, C, K), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], (B, S, J, K), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[2], (B, S, J, K), jnp.float32).astype(dtype)
    g = jax.random.normal(ks[3], (B, H, C, K), jnp.float32).astype(dtype)
    keys = KeyRange(jnp.asarray(pads, jnp.int32), w0 + jnp.arange(C, dtype=jnp.int32), S)
    return q, k, v, g, keys


CASES = [  # S, C, pads, w0: the learner's whole row (C = S) and a chunk inside the slot
    (130, 130, [0, 70, 131], 0),   # row 2 all padding: sees no key
    (300, 70, [5, 260, 0], 200),
]


SLOW = pytest.mark.slow  # the other two (dtype, case) pairs: each form's code path runs anyway


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
@pytest.mark.parametrize("dtype, case", [
    pytest.param(jnp.float32, CASES[0], id="whole-fp32"),
    pytest.param(jnp.bfloat16, CASES[1], id="chunk-bf16"),
    pytest.param(jnp.bfloat16, CASES[0], id="whole-bf16", marks=SLOW),
    pytest.param(jnp.float32, CASES[1], id="chunk-fp32", marks=SLOW),
])
def test_a_key_range_gives_the_masks_bits_forward_and_backward(backend, dtype, case):
    q, k, v, g, keys = _case(dtype, *case)
    hi = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None
    scale = K ** -0.5
    want = flash_attention(q, k, v, keys.mask(), scale, backend, hi)
    got = flash_attention(q, k, v, keys, scale, backend, hi)
    assert np.array_equal(_bits(got), _bits(want))
    assert np.any(_bits(got) != 0)
    d_want = flash_attention_bwd(q, k, v, keys.mask(), want, g, scale, backend, hi)
    d_got = flash_attention_bwd(q, k, v, keys, got, g, scale, backend, hi)
    for a, b in zip(d_got, d_want):
        assert a.dtype == b.dtype and np.array_equal(_bits(a), _bits(b))
        assert np.any(_bits(a) != 0)


def test_the_key_range_operands_are_the_pad_and_each_querys_last_key():
    keys = KeyRange(jnp.asarray([3, 0], jnp.int32), jnp.asarray([5, 6, 200], jnp.int32), 150)
    meta, last = key_range_operands(keys, 64)
    assert meta.shape == (2, 1, 3) and last.shape == (64, 1)
    assert meta[:, 0].tolist() == [[3, 2, 3], [0, 2, 0]]  # offset, blocks to key 149, pad
    assert last[:4, 0].tolist() == [5, 6, 149, -1]


@pytest.mark.parametrize("form", ["pallas-tpu", "pallas-gpu"])
def test_the_kernels_attention_takes_a_key_range_and_its_gradient(form):
    """`kernels.attention` with a KeyRange under a Pallas form: the value and the gradient
    equal those with the dense mask, bit for bit; other forms make the mask."""
    q, k, v, g, keys = _case(jnp.float32, 130, 130, [0, 70, 131], 0)
    q, g = jnp.swapaxes(q, 1, 2), jnp.swapaxes(g, 1, 2)

    def run(mask):
        f = lambda q, k, v: kn.attention(q, k, v, mask, K ** -0.5)  # noqa: E731
        out, vjp = jax.vjp(f, q, k, v)
        return (out, *vjp(g))

    with kn.use_form(form):
        assert kn.attention_takes_key_range()
        for a, b in zip(run(keys), run(keys.mask())):
            assert np.array_equal(_bits(a), _bits(b))
    with kn.use_form("cpu-ordered"):
        assert not kn.attention_takes_key_range()
