"""The TPU's in-place decode attention (`pallas_attention_tpu.flash_attention_cached`),
interpreted on the CPU, against the slot path it replaces: `flash_attention` over
`CachedKV.slots()` with the mask `KeyRange.mask()` (the TPU form, rows rotated). Raw bits
equal for fp32 and bf16, GQA, kv heads in groups of 8 per program, pads before, across and after a key-block boundary, a cache length
that is not a multiple of the key block or shorter than one, a sub-batch of rows in a later slot, and the new key
at the cache's start, middle and end. What this cannot show: Mosaic's own code for the roll
and the dots (the device's), checked by compiling for a v5e in tests/aot."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from looprl.kernels import KeyRange
from looprl.kernels.operands import CachedKV
from looprl.kernels.pallas.attention import flash_attention
from looprl.kernels.pallas.attention_tpu import flash_attention_cached, supports


def _bits(x):
    x = np.asarray(x)
    return x.view({2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


def _case(dtype, S, H, J, pads, w0, N=3, B=6, K=128, seed=0):
    rng = np.random.default_rng(seed)
    M = len(pads)
    cache = [jnp.asarray(rng.standard_normal((N, B, S, J, K)), dtype) for _ in range(2)]
    rows = jnp.asarray(rng.permutation(B)[:M], jnp.int32)
    win = [jnp.asarray(rng.standard_normal((M, 1, J, K)), dtype) for _ in range(2)]
    q = jnp.asarray(rng.standard_normal((M, H, 1, K)), dtype)
    kv = CachedKV(*cache, jnp.int32(1), rows, jnp.int32(w0), *win)
    mask = KeyRange(jnp.asarray(pads, jnp.int32), jnp.asarray([w0], jnp.int32), S)
    return q, kv, mask


@pytest.mark.parametrize("dtype,S,H,J,pads,w0", [
    (jnp.float32, 300, 2, 2, [0, 40, 127, 128, 250, 299], 299),
    (jnp.float32, 256, 4, 2, [3, 130, 200], 140),
    (jnp.bfloat16, 300, 4, 1, [0, 40, 250, 299], 260),
    (jnp.bfloat16, 384, 2, 2, [0, 129], 0),  # row 0 sees only the new key, at slot 0
    (jnp.float32, 256, 16, 16, [0, 130], 200),  # two groups of 8 kv heads per program
    (jnp.bfloat16, 300, 16, 8, [7, 255], 290),  # one group, 2 query heads per kv head
    (jnp.float32, 40, 2, 2, [0, 13, 39], 39),  # a slot shorter than one key block
])
def test_in_place_equals_the_slot_path(dtype, S, H, J, pads, w0):
    q, kv, mask = _case(dtype, S, H, J, pads, w0)
    prec = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None
    got = jax.jit(lambda q, kv: flash_attention_cached(q, kv, mask, 0.088, "tpu", prec))(q, kv)
    k, v = kv.slots()
    want = jax.jit(lambda q, k, v: flash_attention(q, k, v, mask.mask(), 0.088, "tpu",
                                                   prec))(q, k, v)
    assert got.shape == want.shape == q.shape
    assert np.array_equal(_bits(got), _bits(want))
    seen = np.asarray(mask.pad_B) <= min(w0, S - 1)
    assert np.all(np.abs(np.asarray(got, np.float32)[seen]).sum(axis=(1, 2, 3)) > 0)
    assert np.all(np.asarray(got, np.float32)[~seen] == 0)


def test_other_operands_are_refused():
    q, kv, mask = _case(jnp.float32, 256, 2, 2, [0], 10)
    assert supports(kv, mask) and not supports(kv, mask.mask())
    with pytest.raises(ValueError, match="KeyRange"):
        flash_attention_cached(q, kv, mask.mask(), 0.1, "tpu")
