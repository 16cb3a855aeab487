"""`params_fingerprint` (the schedule's record of the sampler's weights) and its cache."""
import jax
import jax.numpy as jnp
import numpy as np

from looprl.sampling import fingerprint
from looprl.sampling.fingerprint import params_fingerprint


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


def _numpy_fingerprint(tree):
    """The documented recipe in numpy (uint64 arithmetic reduced mod 2**32), whole leaves."""
    leaves = sorted(jax.tree_util.tree_leaves_with_path(tree),
                    key=lambda kv: jax.tree_util.keystr(kv[0]))
    acc = [0, 0]
    for i, (_, leaf) in enumerate(leaves):
        x = np.asarray(leaf)
        if x.dtype.itemsize == 4:
            w = x.view(np.uint32).ravel().astype(np.uint64)
        elif x.dtype.itemsize == 2:
            w = x.view(np.uint16).ravel().astype(np.uint64)
        else:
            w = x.astype(np.float32).view(np.uint32).ravel().astype(np.uint64)
        w ^= np.uint64((x.ndim * 7919 + x.size) % 2**32)
        m32 = np.uint64(2**32 - 1)
        idx = (np.arange(w.size, dtype=np.uint64) + np.uint64((i + 1) * 0x9E3779B9)) & m32
        m1 = ((idx * np.uint64(2654435761)) & m32) | np.uint64(1)
        m2 = (((idx ^ np.uint64(0x5BD1E995)) * np.uint64(40503)) & m32) | np.uint64(1)
        acc[0] += int(np.sum((w * m1) & m32, dtype=np.uint64))
        acc[1] += int(np.sum(((w ^ (w >> np.uint64(16))) * m2) & m32, dtype=np.uint64))
    return f"{acc[0] % 2**32:08x}{acc[1] % 2**32:08x}"


def _mixed_tree():
    rng = np.random.default_rng(0)
    n = 2 * fingerprint._CHUNK + 12345  # two whole streamed slices and a tail
    # bf16 leaves are rounded from float32, as ml_dtypes < 0.7 did for float64 input (0.7.0
    # rounds float64 -> bf16 once, giving other leaves and another digest than the recorded one)
    return {"a": jnp.asarray(rng.standard_normal((4, 8)), jnp.float32),
            "b": {"c": jnp.asarray(rng.standard_normal((3,)).astype(np.float32), jnp.bfloat16)},
            "d": jnp.asarray(rng.standard_normal((3, n // 3)), jnp.float32),
            "e": jnp.asarray(rng.standard_normal((n,)).astype(np.float32), jnp.bfloat16),
            "s": jnp.float32(3.0), "i": jnp.arange(5, dtype=jnp.int32)}


def test_streamed_fingerprint_keeps_the_value_recorded_before_it_streamed():
    """The value is the whole-leaf sum's, taken in chunks: the digest the pre-streaming code
    (commit d01f4d1) printed for this tree, and the numpy recipe's."""
    t = _mixed_tree()
    assert params_fingerprint(t) == "9fec77ed4711ec31"
    assert _numpy_fingerprint(t) == "9fec77ed4711ec31"


def test_saved_cpu_rollouts_still_match_their_parameters():
    """reproducibility/cpu's rollouts were recorded with the pre-streaming digest; `looprl
    verify --rollout` compares the schedule's string with this function's."""
    from pathlib import Path

    from looprl.io.params_npz import load_rollout_params
    from looprl.sampling.schedule import RolloutBatch
    root = Path(__file__).resolve().parents[2] / "reproducibility" / "cpu" / "rollouts"
    for name in ("random_float32_dense.npz", "trained_bfloat16_deferred.npz"):
        rb = RolloutBatch.load(root / name)
        params, _ = load_rollout_params(root / name)
        assert params_fingerprint(params) == rb.schedule.params_fingerprint, name
        assert params_fingerprint(jax.device_put(params)) == rb.schedule.params_fingerprint


def test_fingerprint_streams_without_leaf_sized_temporaries():
    """The compiled digest of an fp32 leaf of 8 chunks (32 MiB) allocates two chunks of
    temporaries, not a widened copy of the leaf (the pre-streaming program took RSS from 5.8 to
    22.7 GB at 1.43 B params); a bf16 leaf at most one leaf-sized copy."""
    C = fingerprint._CHUNK
    for shape, dtype, limit in [((8, C), jnp.float32, 3 * 4 * C),
                                ((8 * C + 7,), jnp.bfloat16, 3 * 4 * C),
                                ((4, 64, C // 32), jnp.bfloat16, 8 * C * 2 + 3 * 4 * C)]:
        compiled = fingerprint._tree_digest.lower((jax.ShapeDtypeStruct(shape, dtype),),
                                               np.uint32(1)).compile()
        assert compiled.memory_analysis().temp_size_in_bytes <= limit, (shape, dtype)
