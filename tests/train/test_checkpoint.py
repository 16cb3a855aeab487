"""The looprl checkpoint directory (DESIGN.md §2): exact round trip, atomic writes, refusals."""
import json

import jax
import ml_dtypes
import numpy as np
import pytest

from looprl.errors import CheckpointError
from looprl.model.config import preset
from looprl.model.hf import expected_param_shapes
from looprl.train.checkpoint import (load_model_checkpoint, load_train_state,
                                     save_model_checkpoint)

CFG = preset("tiny")
TOK = '{"version": "1.0", "note": "opaque to the checkpoint"}'


def random_params(seed=0):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda s: rng.standard_normal(s.shape).astype(np.float32),
                        expected_param_shapes(CFG))


def u32(a):
    return np.asarray(a).view(np.uint32)


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
    with pytest.raises(CheckpointError, match=r"\['layers'\]\['down_proj'\].*expected \[3,"):
        load_model_checkpoint(tmp_path / "ok")
