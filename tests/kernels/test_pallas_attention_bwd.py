"""The Pallas forms' attention backward (`pallas.attention_bwd`, interpreted on the CPU) against
the plain math's gradient: the same values up to fp32 rounding (the backward needs no
invariance), on left-padded causal rows with GQA; and the same bits run to run."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from looprl.kernels.pallas.attention import flash_attention
from looprl.kernels.pallas.attention_bwd import flash_attention_bwd
from looprl.kernels.plain import attention_plain
from looprl.kernels.operands import repeat_kv_heads

B, H, J, C, K = 2, 4, 2, 130, 32


def _case():
    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(ks[0], (B, H, C, K), jnp.float32)
    k = jax.random.normal(ks[1], (B, C, J, K), jnp.float32)
    v = jax.random.normal(ks[2], (B, C, J, K), jnp.float32)
    g = jax.random.normal(ks[3], (B, H, C, K), jnp.float32)
    pad = jnp.array([0, 70])  # row 1: 70 padding slots, its first 70 queries see no key
    s = jnp.arange(C)
    mask = (s[None, None, :] >= pad[:, None, None]) & (s[None, None, :] <= s[None, :, None])
    # a query that sees no key has no cotangent (a learner's padding): the plain math's
    # softmax over no key would spread it over every key, the kernels' output there is 0
    g = jnp.where(jnp.any(mask, axis=-1)[:, None, :, None], g, 0.0)
    return q, k, v, g, mask


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_the_flash_backward_is_the_plain_gradient(backend):
    q, k, v, g, mask = _case()
    hi = jax.lax.Precision.HIGHEST
    out = flash_attention(q, k, v, mask, K ** -0.5, backend, hi)

    def plain(q, k, v):
        return attention_plain(q, *repeat_kv_heads(k, v, H), mask, K ** -0.5, hi)
    want = jax.vjp(plain, q, k, v)[1](g)
    got = flash_attention_bwd(q, k, v, mask, out, g, K ** -0.5, backend, hi)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5)
    again = flash_attention_bwd(q, k, v, mask, out, g, K ** -0.5, backend, hi)
    for a, b in zip(got, again):
        assert np.array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32))
