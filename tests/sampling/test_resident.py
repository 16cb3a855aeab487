"""Sampling weights held in the compute dtype: `ComputeWeights` as a loader's
`leaf_fn`, the master fingerprint it streams, and the sampler's bits from either form."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from looprl.errors import CheckpointError, SamplingError
from looprl.io.checkpoint import load_model_checkpoint, save_model_checkpoint
from looprl.io.convert import load_any_checkpoint
from looprl.io import orbax_tree
from looprl.io.hf import save_hf
from looprl.io.slabs import LeafSlabs
from looprl.model.config import preset
from looprl.model.looped import PARAM_PATHS, expected_param_shapes
from looprl.sampling.resident import ComputeWeights
from looprl.sampling.sampler import SamplingConfig, generate
from looprl.sampling.fingerprint import FingerprintStream, params_fingerprint

CFG = preset("tiny", num_layers=3)
TOK = '{"version": "1.0"}'


def _params(seed=0):
    """Random fp32 master weights (not bf16-exact, so the cast rounds)."""
    rng = np.random.default_rng(seed)
    p = jax.tree.map(lambda s: (0.05 * rng.standard_normal(s.shape)).astype(np.float32),
                     expected_param_shapes(CFG))
    for k in ("input_layernorm", "input_layernorm_2", "post_attention_layernorm",
              "post_attention_layernorm_2"):
        p["layers"][k] += 1.0
    p["norm"] += 1.0
    return p


def _u(a):
    a = np.asarray(a)
    return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def test_param_paths_are_the_layout_of_every_config():
    for cfg in (CFG, preset("ouro-1.4b", num_layers=1)):
        flat = jax.tree_util.tree_flatten_with_path(expected_param_shapes(cfg))[0]
        assert tuple(tuple(k.key for k in p) for p, _ in flat) == PARAM_PATHS


@pytest.mark.parametrize("source", ["looprl", "hf_fp32", "hf_bf16"])
def test_compute_weights_hold_the_cast_of_the_master_and_its_fingerprint(tmp_path, source):
    master = _params()
    if source == "looprl":
        path = save_model_checkpoint(tmp_path / "ck", master, CFG, TOK)
    else:
        path = save_hf(master, CFG, tmp_path / "hf", "float32" if source == "hf_fp32"
                       else "bfloat16")
    plain = load_any_checkpoint(str(path))[0]  # the fp32 tree, read as before
    weights, seen = ComputeWeights("bfloat16"), {}

    def counted(keys, leaf):  # how many slabs each leaf came in
        seen["/".join(keys)] = len(leaf.bounds)
        return weights(keys, leaf)

    held = load_any_checkpoint(str(path), leaf_fn=counted)[0]
    if source != "looprl":  # HF: one slab per layer for the stacks, one for the rest
        assert seen["layers/up_proj"] == CFG.num_layers and seen["lm_head"] == 1
    want = jax.tree_util.tree_map_with_path(  # what `cast_weights` and `stack_pass` compute with
        lambda kp, a: a if kp[0].key == "early_exit_gate" else jnp.asarray(a, jnp.bfloat16), plain)
    for (kp, a), (_, b) in zip(jax.tree_util.tree_flatten_with_path(held)[0],
                               jax.tree_util.tree_flatten_with_path(want)[0]):
        assert isinstance(a, jax.Array)
        gate = kp[0].key == "early_exit_gate"
        assert a.dtype == (jnp.float32 if gate else jnp.bfloat16), kp
        assert np.array_equal(_u(a), _u(b)), kp
    assert weights.fingerprint() == params_fingerprint(plain)
    assert weights.fingerprint() != params_fingerprint(held)


def test_slabbed_checkpoint_load_matches_and_checks_the_file_digests(tmp_path, monkeypatch):
    """Small OCDBT data files make orbax split every leaf into several chunks, so the load
    reads it in slabs: the held bf16 tree, the master fingerprint and a damaged file's error
    are those of the whole-leaf load."""
    master = _params(4)
    monkeypatch.setattr(orbax_tree, "OCDBT_DATA_FILE_BYTES", 4096)
    path = save_model_checkpoint(tmp_path / "ck", master, CFG, TOK)
    seen = {}

    def counted(keys, leaf):
        seen["/".join(keys)] = (leaf.axis, len(leaf.bounds))
        return weights(keys, leaf)

    weights = ComputeWeights("bfloat16")
    held = load_model_checkpoint(path, leaf_fn=counted)[0]
    assert seen["layers/up_proj"][1] > 1 and seen["embed_tokens"][1] > 1, seen
    for kp, a in jax.tree_util.tree_flatten_with_path(held)[0]:
        b = master
        for k in kp:
            b = b[k.key]
        gate = kp[0].key == "early_exit_gate"
        assert np.array_equal(_u(a), _u(b if gate else jnp.asarray(b, jnp.bfloat16))), kp
    assert weights.fingerprint() == params_fingerprint(master)
    data = sorted((path / "params").rglob("d/*"), key=lambda f: f.stat().st_size)[-1]
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 1
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="damaged checkpoint file: SHA-256"):
        load_model_checkpoint(path, leaf_fn=ComputeWeights("bfloat16"))


def test_streamed_load_of_a_checkpoint_without_file_digests_checks_the_params_digest(tmp_path):
    import json
    path = save_model_checkpoint(tmp_path / "ck", _params(), CFG, TOK)
    meta = json.loads((path / "looprl_meta.json").read_text())
    meta.pop("file_sha256")
    (path / "looprl_meta.json").write_text(json.dumps({**meta, "params_sha256": "0" * 64}))
    with pytest.raises(CheckpointError, match=r"damaged parameters: params_sha256 [0-9a-f]{64} "
                                              r"differs from 0{64}"):
        load_model_checkpoint(path, leaf_fn=ComputeWeights("bfloat16"))


# 25-34 s a policy on 2 cores; by default the held weights are checked to be the master's cast
# bit for bit, with its fingerprint (the tests above)
@pytest.mark.slow
@pytest.mark.parametrize("kv_policy", ["dense", "deferred", "copy"])
def test_bf16_sampling_from_held_weights_gives_the_master_bits(kv_policy):
    master = _params(1)
    weights = ComputeWeights("bfloat16")
    held = {k: v for k, v in master.items()}
    held = jax.tree_util.tree_map_with_path(
        lambda kp, a: weights(tuple(k.key for k in kp), LeafSlabs.whole(a)), held)
    scfg = SamplingConfig(max_new_tokens=6, temperature=1.0, exit_threshold=0.6,
                          kv_policy=kv_policy, compute_dtype="bfloat16", stop_ids=())
    prompts = [[3, 4, 5], [6, 7, 8, 9, 10]]
    a = generate(CFG, jax.device_put(master), prompts, scfg, group_size=2, seed=3)
    b = generate(CFG, held, prompts, scfg, group_size=2, seed=3,
                 master_fingerprint=weights.fingerprint())
    for name in ("tokens_BxS", "exit_loop_BxS", "logprob_BxS", "logprob_processed_BxS",
                 "flush_BxS", "completion_len_B"):
        x, y = np.asarray(getattr(a, name)), np.asarray(getattr(b, name))
        assert np.array_equal(x.view(np.uint32) if x.dtype == np.float32 else x,
                              y.view(np.uint32) if y.dtype == np.float32 else y), name
    assert b.schedule.params_fingerprint == a.schedule.params_fingerprint
    assert len(set(np.asarray(a.exit_loop_BxS)[:, 5:].ravel().tolist()) - {0}) > 1  # exits vary


def test_held_weights_need_their_dtype_and_the_master_fingerprint():
    weights = ComputeWeights("bfloat16")
    held = jax.tree_util.tree_map_with_path(
        lambda kp, a: weights(tuple(k.key for k in kp), LeafSlabs.whole(a)), _params(2))
    bf16 = SamplingConfig(max_new_tokens=2, compute_dtype="bfloat16", stop_ids=())
    with pytest.raises(SamplingError, match="held in bfloat16.*master_fingerprint"):
        generate(CFG, held, [[3, 4]], bf16)
    with pytest.raises(SamplingError, match="needs compute_dtype bfloat16 \\(found float32\\)"):
        generate(CFG, held, [[3, 4]], SamplingConfig(max_new_tokens=2, stop_ids=()),
                 master_fingerprint=weights.fingerprint())


def test_fingerprint_stream_names_a_leaf_twice_unknown_or_missing():
    s = FingerprintStream(PARAM_PATHS)
    s.add(("norm",), np.ones(4, np.float32))
    with pytest.raises(ValueError, match="norm added twice"):
        s.add(("norm",), np.ones(4, np.float32))
    with pytest.raises(ValueError, match="layers/bogus not in the tree"):
        s.add(("layers", "bogus"), np.ones(4, np.float32))
    with pytest.raises(ValueError, match=f"{len(PARAM_PATHS) - 1} parameters never added"):
        s.hexdigest()


@pytest.mark.parametrize("axis,step", [(0, 2), (1, 5), (2, 7)])
def test_fingerprint_stream_takes_a_leaf_in_slabs_in_any_order(axis, step):
    master = _params(5)
    whole, parts = FingerprintStream(PARAM_PATHS), FingerprintStream(PARAM_PATHS)
    for path in PARAM_PATHS:
        leaf = master
        for k in path:
            leaf = leaf[k]
        whole.add(path, leaf)
        if path != ("layers", "up_proj"):
            parts.add(path, leaf)
    up = master["layers"]["up_proj"]  # [3, 64, 176] at the tiny preset
    starts = list(range(0, up.shape[axis], step))[::-1]  # last slab first
    for i, start in enumerate(starts):
        parts.add(("layers", "up_proj"), np.take(up, range(start, min(start + step,
                  up.shape[axis])), axis=axis), shape=up.shape, axis=axis, start=start)
        if i == 0:
            with pytest.raises(ValueError, match="1 parameters never added or incomplete "
                                                 r"\(first layers/up_proj\)"):
                parts.hexdigest()
    assert parts.hexdigest() == whole.hexdigest() == params_fingerprint(master)
    with pytest.raises(ValueError, match="layers/up_proj added twice"):
        parts.add(("layers", "up_proj"), np.take(up, range(step), axis=axis), shape=up.shape,
                  axis=axis, start=0)


def test_fingerprint_stream_refuses_a_slab_twice_even_when_the_count_would_match():
    """A slab added twice while another of the same size is missing has the right element
    count: it is still refused (overlapping positions), so the digest cannot silently be the
    wrong one."""
    a = np.arange(8, dtype=np.float32).reshape(4, 2)
    s = FingerprintStream([("w",)])
    s.add(("w",), a[0:2], shape=a.shape, axis=0, start=0)
    with pytest.raises(ValueError, match=r"w added twice \(positions 0..2 along axis 0"):
        s.add(("w",), a[0:2], shape=a.shape, axis=0, start=0)
    with pytest.raises(ValueError, match="parts of \\(4, 2\\) along 0"):
        s.add(("w",), a[:, 1:], shape=a.shape, axis=1, start=1)
    with pytest.raises(ValueError, match="1 parameters never added or incomplete"):
        s.hexdigest()
    s.add(("w",), a[2:4], shape=a.shape, axis=0, start=2)
    whole = FingerprintStream([("w",)])
    whole.add(("w",), a)
    assert s.hexdigest() == whole.hexdigest() == params_fingerprint({"w": a})


def test_load_for_sampling_holds_fp32_as_read_and_bf16_both_with_the_master_fingerprint(tmp_path):
    from looprl.sampling.resident import load_for_sampling
    master = _params(3)
    path = str(save_model_checkpoint(tmp_path / "ck", master, CFG, TOK))
    p32, cfg, tok, _, fp32 = load_for_sampling(path, "float32")
    assert fp32 == params_fingerprint(master) and cfg == CFG and tok == TOK
    assert all(isinstance(a, jax.Array) and a.dtype == jnp.float32 for a in jax.tree.leaves(p32))
    assert np.array_equal(_u(p32["layers"]["up_proj"]), _u(master["layers"]["up_proj"]))
    p16, _, _, _, fp16 = load_for_sampling(path, "bfloat16")
    assert fp16 == params_fingerprint(master)
    assert p16["lm_head"].dtype == jnp.bfloat16
