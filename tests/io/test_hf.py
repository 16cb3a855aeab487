"""HF checkpoints: import/export bit-identical round trips, sharded loading, the `convert` CLI,
and every bad input raising a CheckpointError that names the tensor or file."""
import json

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from looprl.cli import main
from looprl.errors import CheckpointError
from looprl.io import hf
from looprl.model import looped
from looprl.model.config import preset

CFG = preset("tiny", num_kv_heads=2)


def random_params(cfg, seed=0):
    rng = np.random.default_rng(seed)
    p = jax.tree.map(lambda s: rng.standard_normal(s.shape).astype(np.float32),
                     looped.expected_param_shapes(cfg))
    p["norm"][0] = -0.0  # raw-bit comparison must keep the sign of zero
    return p


def bits(a):
    a = np.asarray(a)
    return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def assert_same_bits(state_a, state_b):
    assert sorted(state_a) == sorted(state_b)
    for name in state_a:
        assert state_a[name].dtype == state_b[name].dtype, name
        assert np.array_equal(bits(state_a[name]), bits(state_b[name])), name


def write_state(path, state, cfg=CFG, hf_config=None):
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(hf_config or cfg.to_hf_config()))
    save_file(state, str(path / "model.safetensors"))
    return path


def tiny_tokenizer_json():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    vocab = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2, "a": 3}
    return Tokenizer(WordLevel(vocab, unk_token="a")).to_str()


# --- round trips ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_hf_looprl_hf_round_trip_is_bit_identical(tmp_path, dtype, capsys):
    src = hf.save_hf(random_params(CFG), CFG, tmp_path / "src", dtype,
                     tokenizer_json=tiny_tokenizer_json())
    src_state, _ = hf.read_hf_state_dict(src)
    assert src_state["lm_head.weight"].dtype == hf._NAME_TO_NP[dtype]
    # library path: load_hf -> params -> HF state in the recorded source dtype
    model = hf.load_hf(src)
    assert model.source_dtype == dtype
    assert_same_bits(src_state, hf.hf_state_from_params(model.weights(), CFG, model.source_dtype))
    # CLI path: HF -> looprl checkpoint -> HF, the export dtype defaulting to the source's
    assert main(["convert", "--hf", str(src), "--out", str(tmp_path / "ckpt")]) == 0
    assert main(["convert", "--checkpoint", str(tmp_path / "ckpt"),
                 "--to-hf", str(tmp_path / "back")]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and f"source dtype {dtype}" in lines[0] and dtype in lines[1]
    back_state, _ = hf.read_hf_state_dict(tmp_path / "back")
    assert_same_bits(src_state, back_state)
    assert (tmp_path / "back" / "tokenizer.json").read_text() == tiny_tokenizer_json()
    assert json.loads((tmp_path / "back" / "config.json").read_text())["torch_dtype"] == dtype


def test_export_dtype_override_and_mixed_source(tmp_path):
    params = random_params(CFG)
    state = hf.hf_state_from_params(params, CFG, "bfloat16")
    state["model.early_exit_gate.weight"] = state["model.early_exit_gate.weight"].astype(
        np.float32)  # a source that keeps the gate in fp32
    src = write_state(tmp_path / "src", state)
    assert main(["convert", "--hf", str(src), "--out", str(tmp_path / "ckpt")]) == 0
    assert main(["convert", "--checkpoint", str(tmp_path / "ckpt"), "--to-hf",
                 str(tmp_path / "mixed")]) == 0
    assert_same_bits(state, hf.read_hf_state_dict(tmp_path / "mixed")[0])
    assert main(["convert", "--checkpoint", str(tmp_path / "ckpt"), "--to-hf",
                 str(tmp_path / "f32"), "--dtype", "float32"]) == 0
    f32 = hf.read_hf_state_dict(tmp_path / "f32")[0]
    assert all(a.dtype == np.float32 for a in f32.values())
    assert np.array_equal(f32["lm_head.weight"],
                          state["lm_head.weight"].astype(np.float32))  # bf16 -> fp32 is exact


def test_sharded_index_loads_same_params(tmp_path):
    params = random_params(CFG)
    state = hf.hf_state_from_params(params, CFG, "bfloat16")
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[:20],
              "model-00002-of-00002.safetensors": names[20:]}
    d = tmp_path / "sharded"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(CFG.to_hf_config()))
    for shard, ns in shards.items():
        save_file({n: state[n] for n in ns}, str(d / shard))
    weight_map = {n: s for s, ns in shards.items() for n in ns}
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": 0}, "weight_map": weight_map}))
    ckpt = hf.read_hf(d)
    assert ckpt.source_dtype == "bfloat16"
    want = jax.tree.map(lambda a: np.asarray(a.astype(ml_dtypes.bfloat16)).astype(np.float32),
                        params)
    for got, exp in zip(jax.tree.leaves(ckpt.params), jax.tree.leaves(want)):
        assert np.array_equal(bits(got), bits(exp))
    # a shard the index lists but that is missing
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
        hf.read_hf(d)


def test_upstream_config_extra_keys_accepted(tmp_path):
    hf_config = {**CFG.to_hf_config(), "layer_types": ["full_attention"] * 2,
                 "sliding_window": None, "use_sliding_window": False, "torch_dtype": "bfloat16",
                 "transformers_version": "4.55.0", "bos_token_id": 0, "eos_token_id": 0}
    src = write_state(tmp_path / "src", hf.hf_state_from_params(random_params(CFG), CFG),
                      hf_config=hf_config)
    model = hf.load_hf(src, token_ids={"bos_token_id": 1, "eos_token_id": 2})
    assert model.cfg.eos_token_id == 2 and model.cfg.num_kv_heads == 2


def test_load_hf_bf16_holds_bf16_params_and_top_level_api(tmp_path):
    import looprl
    src = hf.save_hf(random_params(CFG), CFG, tmp_path / "src", "float32")
    model = looprl.load_hf(src, dtype="bfloat16")
    leaves = jax.tree.leaves(model.weights())
    assert all(a.dtype == np.dtype(ml_dtypes.bfloat16) for a in leaves)
    assert str(model.compute_dtype) == "bfloat16"


def test_load_hf_model_compiles_once_and_its_call_is_the_eager_forward(tmp_path):
    """Issue 19: `model(tokens)` is one compiled program; a second call at the same shape hits
    the trace cache (no new compilation) and the compiled forward's bits are the eager one's."""
    import jax.numpy as jnp
    src = hf.save_hf(random_params(CFG), CFG, tmp_path / "src", "float32")
    model = hf.load_hf(src)
    assert all(isinstance(a, jax.Array) for a in jax.tree.leaves(model.weights()))
    tokens = jnp.asarray([[1, 3, 5, 7], [2, 4, 6, 8]], jnp.int32)
    before = looped._inspect_forward._cache_size()
    out1 = model(tokens)
    assert looped._inspect_forward._cache_size() == before + 1
    out2 = model(np.asarray(tokens))
    assert looped._inspect_forward._cache_size() == before + 1  # reused
    assert np.array_equal(bits(out1.logits), bits(out2.logits))
    eager = looped.all_loop_outputs(CFG, looped.cast_weights(model.weights(), "float32"), tokens)
    assert out1.logits.shape == (CFG.total_ut_steps, 2, 4, CFG.vocab_size)
    assert np.array_equal(bits(out1.exit_lambda), bits(eager.exit_lambda))


def test_device_params_replaces_numpy_leaves_in_place_with_the_same_bits():
    p = random_params(CFG)
    host = jax.tree.map(np.copy, p)
    out = looped.device_params(p)
    assert out is p and all(isinstance(a, jax.Array) for a in jax.tree.leaves(p))
    for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(host)):
        assert np.array_equal(bits(a), bits(b))


# --- bad input ---------------------------------------------------------------------------------
def _good_state():
    return hf.hf_state_from_params(random_params(CFG), CFG, "float32")


@pytest.mark.parametrize("name", ["model.layers.1.input_layernorm_2.weight",
                                  "model.early_exit_gate.bias"])
def test_missing_tensor_is_named(tmp_path, name):
    state = _good_state()
    del state[name]
    src = write_state(tmp_path / "src", state)
    with pytest.raises(CheckpointError, match=f"missing tensor '{name}'.*expected shape"):
        hf.load_hf(src)


def test_missing_lm_head_is_never_invented(tmp_path):
    state = _good_state()
    del state["lm_head.weight"]
    src = write_state(tmp_path / "src", state)
    with pytest.raises(CheckpointError, match=r"'lm_head.weight'.*\[64, 128\].*tie_word_emb"):
        hf.load_hf(src)


def test_unexpected_tensor_is_named(tmp_path):
    state = _good_state()
    state["model.layers.2.input_layernorm.weight"] = np.ones(128, np.float32)  # 2-layer model
    src = write_state(tmp_path / "src", state)
    with pytest.raises(CheckpointError,
                       match=r"model.safetensors.*unexpected tensor 'model.layers.2.input_lay"):
        hf.load_hf(src)


def test_wrong_shape_names_expected_and_found(tmp_path):
    state = _good_state()
    state["model.layers.0.self_attn.k_proj.weight"] = np.zeros((128, 128), np.float32)
    src = write_state(tmp_path / "src", state)
    with pytest.raises(CheckpointError, match=r"'model.layers.0.self_attn.k_proj.weight' has "
                                              r"shape \[128, 128\], expected \[64, 128\]"):
        hf.load_hf(src)


def test_unknown_model_type(tmp_path):
    src = write_state(tmp_path / "src", _good_state(),
                      hf_config={**CFG.to_hf_config(), "model_type": "llama"})
    with pytest.raises(CheckpointError, match=r"config.json.*model_type must be 'ouro', found "
                                              r"'llama'"):
        hf.load_hf(src)


@pytest.mark.parametrize("cut", [100, "header"])
def test_truncated_safetensors(tmp_path, cut):
    src = write_state(tmp_path / "src", _good_state())
    f = src / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:-cut] if cut != "header" else data[:40])
    with pytest.raises(CheckpointError, match=r"model.safetensors: truncated safetensors file"):
        hf.load_hf(src)


def test_failed_convert_writes_nothing(tmp_path, capsys):
    state = _good_state()
    del state["model.early_exit_gate.bias"]
    src = write_state(tmp_path / "src", state)
    assert main(["convert", "--hf", str(src), "--out", str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.early_exit_gate.bias" in err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_export_refuses_non_empty_dir(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(CheckpointError, match="already exists"):
        hf.save_hf(random_params(CFG), CFG, out, "float32")
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_reads_bf16_file_written_by_torch(tmp_path):
    """Real Ouro weights are bf16 files written by PyTorch: our numpy parser must read them to
    the same bits as `safetensors.torch` does."""
    import torch
    from safetensors.torch import load_file
    from safetensors.torch import save_file as torch_save_file

    state = hf.hf_state_from_params(random_params(CFG, seed=5), CFG, "float32")
    tstate = {n: torch.from_numpy(a).to(torch.bfloat16) for n, a in state.items()}
    d = tmp_path / "torch_written"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(CFG.to_hf_config()))
    torch_save_file(tstate, str(d / "model.safetensors"), metadata={"format": "pt"})
    ours, _ = hf.read_hf_state_dict(d)
    theirs = load_file(str(d / "model.safetensors"))
    for n, t in theirs.items():
        assert ours[n].dtype == np.dtype(ml_dtypes.bfloat16)
        assert np.array_equal(bits(ours[n]), t.view(torch.int16).numpy().view(np.uint16)), n
    assert hf.read_hf(d).source_dtype == "bfloat16"


def test_invalid_tokenizer_refused_before_writing(tmp_path, capsys):
    src = hf.save_hf(random_params(CFG), CFG, tmp_path / "src", "float32")
    bad = tmp_path / "tok.json"
    bad.write_text('{"not": "a tokenizer"}')
    assert main(["convert", "--hf", str(src), "--out", str(tmp_path / "ckpt"),
                 "--tokenizer", str(bad)]) == 2
    assert "tok.json: not a valid HF tokenizers JSON" in capsys.readouterr().err
    assert not (tmp_path / "ckpt").exists()


# --- streaming I/O (issue 19) ----------------------------------------------------------------
def test_streamed_safetensors_file_is_read_by_the_safetensors_library(tmp_path):
    """`save_hf` writes its file one tensor at a time with our writer; the library's readers
    (numpy for F32, torch for BF16) read every tensor back to the same bits."""
    import torch
    from safetensors.numpy import load_file as np_load_file
    from safetensors.torch import load_file as torch_load_file

    params = random_params(CFG, seed=3)
    for dtype in ("float32", "bfloat16"):
        d = hf.save_hf(params, CFG, tmp_path / dtype, dtype)
        want = hf.hf_state_from_params(params, CFG, dtype)
        if dtype == "float32":
            got = np_load_file(str(d / hf.SAFETENSORS_FILE))
            assert_same_bits(want, got)
        else:
            got = torch_load_file(str(d / hf.SAFETENSORS_FILE))
            assert sorted(got) == sorted(want)
            for n, t in got.items():
                assert t.dtype == torch.bfloat16, n
                assert np.array_equal(t.view(torch.int16).numpy().view(np.uint16), bits(want[n]))
        assert list(hf.safetensors_index(d / hf.SAFETENSORS_FILE)) == list(hf.hf_tensor_shapes(CFG))


def test_streamed_writer_refuses_a_tensor_out_of_order(tmp_path):
    shapes = {"a": ((2, 3), "float32"), "b": ((4,), "bfloat16")}
    tensors = [("b", np.zeros(4, ml_dtypes.bfloat16)), ("a", np.zeros((2, 3), np.float32))]
    with pytest.raises(CheckpointError, match="tensor 'b'.*next entry 'a'"):
        hf.write_safetensors(tmp_path / "x.safetensors", shapes, iter(tensors))
    with pytest.raises(CheckpointError, match="fewer tensors"):
        hf.write_safetensors(tmp_path / "y.safetensors", shapes, iter(tensors[1:]))


def test_tensor_entry_reads_its_own_bytes_and_names_a_short_read(tmp_path):
    state = hf.hf_state_from_params(random_params(CFG), CFG, "bfloat16")
    d = write_state(tmp_path / "src", state)
    index = hf.hf_tensor_index(d)
    for n, e in index.items():
        a = e.read()
        assert a.flags.writeable and a.dtype == state[n].dtype  # its own copy, not a read-only map
        assert np.array_equal(bits(a), bits(state[n])), n
    e = index["lm_head.weight"]
    with open(e.path, "r+b") as f:  # the file shrinks after its header was read
        f.truncate(e.offset + 10)
    with pytest.raises(CheckpointError, match="short read"):
        e.read()


def test_a_tokenizer_that_does_not_cover_the_vocabulary_is_warned_of(tmp_path, capsys):
    """convert and load_hf name both counts (the tiny tokenizer: 4 ids, the model 64 rows);
    a tokenizer of exactly the vocabulary's size gives no warning."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    src = hf.save_hf(random_params(CFG), CFG, tmp_path / "src", "float32",
                     tokenizer_json=tiny_tokenizer_json())
    assert main(["convert", "--hf", str(src), "--out", str(tmp_path / "ckpt")]) == 0
    assert ("looprl convert: warning: the tokenizer covers 4 ids, the model's vocabulary has "
            f"{CFG.vocab_size}: ids 4..{CFG.vocab_size - 1} cannot be decoded"
            in capsys.readouterr().err)
    with pytest.warns(UserWarning, match=f"the tokenizer covers 4 ids, the model's vocabulary "
                                         f"has {CFG.vocab_size}"):
        hf.load_hf(src)
    full = Tokenizer(WordLevel({f"t{i}": i for i in range(CFG.vocab_size + 2)},
                               unk_token="t0")).to_str()
    big = hf.save_hf(random_params(CFG), CFG, tmp_path / "big", "float32", tokenizer_json=full)
    with pytest.warns(UserWarning, match=f"has {CFG.vocab_size + 2} ids, the model's vocabulary "
                                         f"only {CFG.vocab_size}"):
        hf.load_hf(big)
    exact = Tokenizer(WordLevel({f"t{i}": i for i in range(CFG.vocab_size)},
                                unk_token="t0")).to_str()
    ok = hf.save_hf(random_params(CFG), CFG, tmp_path / "ok", "float32", tokenizer_json=exact)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hf.load_hf(ok)
