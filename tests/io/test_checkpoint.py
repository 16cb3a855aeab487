"""The looprl checkpoint directory (DESIGN.md §2): exact round trip, atomic writes, refusals."""
import hashlib
import json
import re

import jax
import ml_dtypes
import numpy as np
import pytest

from looprl.errors import CheckpointError
from looprl.model.config import preset
from looprl.model.looped import expected_param_shapes
from looprl.io.checkpoint import load_model_checkpoint, load_train_state, save_model_checkpoint

CFG = preset("tiny")
TOK = '{"version": "1.0", "note": "opaque to the checkpoint"}'


def random_params(seed=0):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda s: rng.standard_normal(s.shape).astype(np.float32),
                        expected_param_shapes(CFG))


def u32(a):
    return np.asarray(a).view(np.uint32)


def rewrite_manifest(ckpt):
    """Rewrite looprl_meta.json's file manifest after a test changed files on purpose."""
    meta_path = ckpt / "looprl_meta.json"
    meta = json.loads(meta_path.read_text())
    meta["files"] = {p.relative_to(ckpt).as_posix(): p.stat().st_size
                     for p in sorted(ckpt.rglob("*")) if p.is_file() and p != meta_path}
    meta["file_sha256"] = {p.relative_to(ckpt).as_posix(): hashlib.sha256(p.read_bytes())
                           .hexdigest() for p in sorted(ckpt.rglob("*"))
                           if p.is_file() and p != meta_path}
    meta_path.write_text(json.dumps(meta))


def test_round_trip_bits_config_tokenizer_meta(tmp_path):
    params = random_params()
    params["norm"][3] = -0.0
    save_model_checkpoint(tmp_path / "ck", params, CFG, TOK,
                          extra_meta={"source_dtype": "bfloat16"})
    got, cfg, tok, meta = load_model_checkpoint(tmp_path / "ck")
    assert cfg == CFG and tok == TOK and meta["source_dtype"] == "bfloat16"
    assert jax.tree.structure(got) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(params)):
        assert a.dtype == np.float32 and np.array_equal(u32(a), u32(b))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # no temp dirs left
    assert {"params", "model_config.json", "tokenizer.json", "looprl_meta.json"} <= {
        p.name for p in (tmp_path / "ck").iterdir()}


def test_bf16_params_stored_as_fp32_master(tmp_path):
    params = jax.tree.map(lambda a: a.astype(ml_dtypes.bfloat16), random_params())
    save_model_checkpoint(tmp_path / "ck", params, CFG, None)
    got, _, tok, meta = load_model_checkpoint(tmp_path / "ck")
    assert tok is None and meta["has_tokenizer"] is False
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(params)):
        assert a.dtype == np.float32 and np.array_equal(u32(a), u32(b.astype(np.float32)))


def test_train_state_saved_when_given(tmp_path):
    state = {"step": np.int64(7), "mu": {"w": np.arange(4, dtype=np.float32)},
             "rng": np.array([1, 2], np.uint32)}
    save_model_checkpoint(tmp_path / "ck", random_params(), CFG, TOK, train_state=state)
    got = load_train_state(tmp_path / "ck")
    assert int(got["step"]) == 7 and np.array_equal(got["mu"]["w"], state["mu"]["w"])
    assert np.array_equal(got["rng"], state["rng"])
    save_model_checkpoint(tmp_path / "model_only", random_params(), CFG, TOK)
    with pytest.raises(CheckpointError, match="without train_state"):
        load_train_state(tmp_path / "model_only")


def test_incomplete_or_foreign_directory_refused(tmp_path):
    save_model_checkpoint(tmp_path / "ck", random_params(), CFG, TOK)
    (tmp_path / "ck" / "looprl_meta.json").unlink()  # as an interrupted save would leave it
    with pytest.raises(CheckpointError, match=r"ck: not a complete looprl checkpoint "
                                              r"\(looprl_meta.json missing"):
        load_model_checkpoint(tmp_path / "ck")
    with pytest.raises(CheckpointError, match="not a looprl checkpoint directory"):
        load_model_checkpoint(tmp_path / "nowhere")
    save_model_checkpoint(tmp_path / "ck2", random_params(), CFG, TOK)
    (tmp_path / "ck2" / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="incomplete looprl checkpoint: tokenizer.json"):
        load_model_checkpoint(tmp_path / "ck2")


def test_existing_checkpoint_not_overwritten_unless_asked(tmp_path):
    save_model_checkpoint(tmp_path / "ck", random_params(0), CFG, TOK)
    with pytest.raises(CheckpointError, match="already exists"):
        save_model_checkpoint(tmp_path / "ck", random_params(1), CFG, TOK)
    assert np.array_equal(load_model_checkpoint(tmp_path / "ck")[0]["norm"],
                          random_params(0)["norm"])
    save_model_checkpoint(tmp_path / "ck", random_params(1), CFG, TOK, overwrite=True)
    assert np.array_equal(load_model_checkpoint(tmp_path / "ck")[0]["norm"],
                          random_params(1)["norm"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_params_must_match_config(tmp_path):
    params = random_params()
    params["layers"]["q_proj"] = params["layers"]["q_proj"][:, :, :64]
    with pytest.raises(CheckpointError, match=r"\['layers'\]\['q_proj'\] has shape "
                                              r"\[2, 128, 64\], expected \[2, 128, 128\]"):
        save_model_checkpoint(tmp_path / "ck", params, CFG, TOK)
    assert not (tmp_path / "ck").exists()
    save_model_checkpoint(tmp_path / "ok", random_params(), CFG, TOK)
    cfg_path = tmp_path / "ok" / "model_config.json"
    cfg_path.write_text(json.dumps({**CFG.to_dict(), "num_layers": 3}))
    rewrite_manifest(tmp_path / "ok")  # a checkpoint whose config really says 3 layers
    with pytest.raises(CheckpointError, match=r"\['layers'\]\['down_proj'\].*expected \[3,"):
        load_model_checkpoint(tmp_path / "ok")


def test_relative_paths_save_and_load(tmp_path, monkeypatch):
    """orbax refuses relative paths; the checkpoint functions make them absolute."""
    monkeypatch.chdir(tmp_path)
    state = {"step": np.int64(3)}
    save_model_checkpoint("runs/ck", random_params(), CFG, TOK, train_state=state)
    got, cfg, tok, _ = load_model_checkpoint("runs/ck")
    assert cfg == CFG and tok == TOK
    assert np.array_equal(u32(got["norm"]), u32(random_params()["norm"]))
    assert int(load_train_state("runs/ck")["step"]) == 3


def test_prng_key_round_trips_as_a_typed_key(tmp_path):
    key = jax.random.fold_in(jax.random.key(5), 7)
    state = {"rng_key": key, "step": np.int64(4), "count": np.int32(2)}
    save_model_checkpoint(tmp_path / "ck", random_params(), CFG, TOK, train_state=state)
    for got in (load_train_state(tmp_path / "ck"),
                load_train_state(tmp_path / "ck", template=state)):
        k = got["rng_key"]
        assert jax.dtypes.issubdtype(k.dtype, jax.dtypes.prng_key)
        assert str(jax.random.key_impl(k)) == str(jax.random.key_impl(key))
        assert np.array_equal(jax.random.key_data(k), jax.random.key_data(key))
        assert np.array_equal(u32(jax.random.uniform(k, (8,))), u32(jax.random.uniform(key, (8,))))
        # scalars keep their dtype (orbax alone would give back Python ints)
        assert got["step"].dtype == np.int64 and got["count"].dtype == np.int32
    with pytest.raises(CheckpointError, match=r"array 'rng_key' is a PRNG key .*expected dtype "
                                              r"uint32 shape \[2\]"):
        load_train_state(tmp_path / "ck", template={**state, "rng_key": np.zeros(2, np.uint32)})


def _adam_state(num_layers):
    import optax
    cfg = preset("tiny", num_layers=num_layers)
    params = jax.tree.map(lambda s: np.zeros(s.shape, np.float32), expected_param_shapes(cfg))
    return {"opt_state": optax.adam(1e-3).init(params), "step": np.int64(5)}


def test_mismatched_restore_names_the_array_and_never_casts(tmp_path):
    save_model_checkpoint(tmp_path / "ck", random_params(), CFG, TOK, train_state=_adam_state(2))
    assert CFG.num_layers == 2
    # 2 layers into a 3-layer optimizer state
    with pytest.raises(CheckpointError, match=r"train_state: array 'opt_state/0/mu/layers/"
                                              r"\w+' is dtype float32 shape \[2, .*expected "
                                              r"dtype float32 shape \[3, "):
        load_train_state(tmp_path / "ck", template=_adam_state(3))
    # an int step into a float step
    with pytest.raises(CheckpointError, match=r"array 'step' is dtype int64 shape \[\], expected "
                                              r"dtype float32 shape \[\] \(restores never cast\)"):
        load_train_state(tmp_path / "ck", template={**_adam_state(2), "step": np.float32(5)})
    with pytest.raises(CheckpointError, match=r"array 'extra' missing"):
        load_train_state(tmp_path / "ck", template={**_adam_state(2), "extra": np.zeros(1)})
    with pytest.raises(CheckpointError, match=r"unexpected array 'step'"):
        load_train_state(tmp_path / "ck", template={"opt_state": _adam_state(2)["opt_state"]})
    got = load_train_state(tmp_path / "ck", template=_adam_state(2))
    assert jax.tree.structure(got) == jax.tree.structure(_adam_state(2))


def test_params_stored_in_another_dtype_are_refused(tmp_path):
    import shutil

    import orbax.checkpoint as ocp
    save_model_checkpoint(tmp_path / "ck", random_params(), CFG, TOK)
    shutil.rmtree(tmp_path / "ck" / "params")
    ocp.PyTreeCheckpointer().save(tmp_path / "ck" / "params",
                                  jax.tree.map(lambda a: a.astype(np.float16), random_params()))
    rewrite_manifest(tmp_path / "ck")
    with pytest.raises(CheckpointError, match=r"parameter \['early_exit_gate'\]\['bias'\] stored "
                                              r"as float16, expected float32"):
        load_model_checkpoint(tmp_path / "ck")


def test_truncated_file_makes_a_checkpoint_incomplete(tmp_path):
    """A checkpoint whose meta survived but a data file did not (a crash between rename and
    the data reaching disk) is refused, naming the file."""
    save_model_checkpoint(tmp_path / "ck", random_params(), CFG, TOK, train_state={"s": 1})
    meta = json.loads((tmp_path / "ck" / "looprl_meta.json").read_text())
    biggest = max(meta["files"], key=meta["files"].get)
    f = tmp_path / "ck" / biggest
    f.write_bytes(f.read_bytes()[:10])
    with pytest.raises(CheckpointError, match=rf"incomplete looprl checkpoint: {biggest} has 10 "
                                              rf"bytes"):
        load_model_checkpoint(tmp_path / "ck")


def flip_bytes_in_place(ckpt, under="params"):
    """XOR 64 bytes in the middle of the largest file under `ckpt/under` (same size, so the
    size manifest passes); returns that file."""
    f = max((p for p in (ckpt / under).rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    raw = bytearray(f.read_bytes())
    mid = len(raw) // 2
    raw[mid:mid + 64] = bytes(b ^ 0x5A for b in raw[mid:mid + 64])
    f.write_bytes(bytes(raw))
    return f


def test_bytes_damaged_in_place_are_refused_naming_the_file_and_both_digests(tmp_path):
    params = random_params()
    save_model_checkpoint(tmp_path / "ck", params, CFG, TOK, train_state={"s": np.arange(3)})
    meta = json.loads((tmp_path / "ck" / "looprl_meta.json").read_text())
    from looprl.io.checkpoint import params_sha256
    assert meta["params_sha256"] == params_sha256(params)  # every checkpoint records it
    f = flip_bytes_in_place(tmp_path / "ck")
    rel = f.relative_to(tmp_path / "ck").as_posix()
    recorded = meta["file_sha256"][rel]
    found = hashlib.sha256(f.read_bytes()).hexdigest()
    with pytest.raises(CheckpointError, match=re.escape(f"{f}: damaged checkpoint file: SHA-256 "
                                                        f"{found} differs from {recorded}")):
        load_model_checkpoint(tmp_path / "ck")
    save_model_checkpoint(tmp_path / "ts", params, CFG, TOK, train_state={"s": np.arange(3)})
    g = flip_bytes_in_place(tmp_path / "ts", "train_state")
    with pytest.raises(CheckpointError, match=re.escape(f"{g}: damaged checkpoint file")):
        load_train_state(tmp_path / "ts")


def test_params_digest_checked_after_restore(tmp_path):
    """With the file digests out of the way (rewritten), the tree's params_sha256 still
    catches a changed value, naming params/ and both digests."""
    save_model_checkpoint(tmp_path / "ck", random_params(), CFG, TOK)
    meta_path = tmp_path / "ck" / "looprl_meta.json"
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps({**meta, "params_sha256": "0" * 64}))
    with pytest.raises(CheckpointError, match=r"ck/params: damaged parameters: params_sha256 "
                                              r"[0-9a-f]{64} differs from 0{64}"):
        load_model_checkpoint(tmp_path / "ck")


def test_checkpoint_without_digests_loads_with_a_one_line_warning(tmp_path, capsys):
    params = random_params()
    save_model_checkpoint(tmp_path / "ck", params, CFG, TOK)
    meta_path = tmp_path / "ck" / "looprl_meta.json"
    meta = json.loads(meta_path.read_text())
    del meta["params_sha256"], meta["file_sha256"]   # an older checkpoint: no digests
    meta_path.write_text(json.dumps(meta))
    got, _, _, _ = load_model_checkpoint(tmp_path / "ck")
    assert np.array_equal(u32(got["norm"]), u32(params["norm"]))
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "written before checkpoints recorded digests" in err[0]
    save_model_checkpoint(tmp_path / "new", params, CFG, TOK)
    load_model_checkpoint(tmp_path / "new")
    assert capsys.readouterr().err == ""
