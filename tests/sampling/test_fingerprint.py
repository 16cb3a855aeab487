"""`params_fingerprint` (the schedule's record of the sampler's weights) and its cache."""
import jax
import jax.numpy as jnp
import numpy as np

from looprl.sampling.schedule import params_fingerprint


def _tree(seed):
    rng = np.random.default_rng(seed)
    return {"a": jnp.asarray(rng.standard_normal((4, 8)), jnp.float32),
            "b": {"c": jnp.asarray(rng.standard_normal((3,)), jnp.bfloat16)}}


def test_fingerprint_is_a_function_of_the_values_not_of_the_objects():
    t = _tree(0)
    fp = params_fingerprint(t)
    assert params_fingerprint(t) == fp  # cached
    assert params_fingerprint(jax.tree.map(lambda x: x + 0, t)) == fp  # new arrays, same bits
    assert params_fingerprint(jax.tree.map(np.asarray, t)) == fp  # numpy leaves (not cached)


def test_fingerprint_changes_with_one_bit_even_after_a_cached_call():
    t = _tree(1)
    fp = params_fingerprint(t)
    bits = np.asarray(t["a"]).view(np.uint32).copy()
    bits[2, 3] ^= 1
    t2 = {"a": jnp.asarray(bits.view(np.float32)), "b": t["b"]}
    assert params_fingerprint(t2) != fp
    n = np.asarray(t["a"]).copy()  # a mutable numpy tree is hashed on every call
    tn = {"a": n, "b": t["b"]}
    fn = params_fingerprint(tn)
    n[0, 0] += 1.0
    assert params_fingerprint(tn) != fn
