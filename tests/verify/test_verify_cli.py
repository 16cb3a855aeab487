"""`looprl verify --rollout` on a rollout saved by `looprl generate` (tiny model, one row): the
report labels forced replays, states unmet requirements, skips the one-row 'different' batching,
and announces a report it will replace."""
import json

import pytest

from looprl.cli import main
from looprl.verify.matrix import (VerifyOptions, batching_layouts, replay_impl_of,
                                  requirement_failures)
from looprl.verify.report import report_markdown
from looprl.model import init_params, preset
from looprl.sampling.schedule import RolloutBatch
from looprl.tokenizer import build_char_tokenizer
from looprl.io.checkpoint import save_model_checkpoint


@pytest.fixture(scope="module")
def stock_rollout(tmp_path_factory):
    """(checkpoint, rollout file) of `looprl generate --kernels stock --save-rollout`."""
    d = tmp_path_factory.mktemp("verify_cli")
    cfg = preset("tiny")
    ckpt = d / "ckpt"
    save_model_checkpoint(ckpt, init_params(cfg, 0), cfg, build_char_tokenizer().to_json())
    path = d / "stock.npz"
    assert main(["generate", "--checkpoint", str(ckpt), "--prompt", "1 + 2", "--prompt-style",
                 "compact", "--max-new-tokens", "4", "--exit-threshold", "0.5", "--kernels",
                 "stock", "--save-rollout", str(path), "--json"]) == 0
    return ckpt, path


@pytest.fixture(scope="module")
def verified(stock_rollout, tmp_path_factory):
    """(exit status, stderr, out dir) of `looprl verify --rollout` on the stock rollout."""
    import contextlib
    import io

    ckpt, path = stock_rollout
    out = tmp_path_factory.mktemp("verify_out") / "report"
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(["verify", "--rollout", str(path), "--checkpoint", str(ckpt), "--quick",
                   "--out", str(out)])
    return rc, err.getvalue(), out


def test_stock_rollout_replay_cells_are_labelled_forced(verified):
    rc, err, out = verified
    report = json.loads((out / "report.json").read_text())
    replay = [c for c in report["cells"] if c["method"] == "replay"]
    assert replay and all(c["replay_impl"] == "forced" for c in replay)
    assert all(c["exact_fraction"] == 1.0 for c in replay)
    assert report["summary"]["replay_forced_cells"] == len(replay)
    md = (out / "report.md").read_text()
    assert f"({len(replay)} via forced replay)" in md


def test_unmet_requirements_are_stated_on_console_and_in_report(verified):
    rc, err, out = verified
    assert rc == 1  # replay exact, but a 4-token rollout cannot meet DESIGN §5's sizes
    report = json.loads((out / "report.json").read_text())
    unmet = report["summary"]["requirements_unmet"]
    assert any("sampled tokens < 512" in r for r in unmet)
    assert "FAIL: requirements not met:" in err and "sampled tokens < 512" in err
    md = (out / "report.md").read_text()
    assert "**not met**" in md and "sampled tokens < 512" in md
    assert "| req |" in md and all(c["requirements_unmet"] == unmet for c in report["cells"])


def test_batch_of_one_skips_the_different_batching_with_a_note(verified):
    rc, err, out = verified
    report = json.loads((out / "report.json").read_text())
    assert {c["batching"] for c in report["cells"]} == {"same"}
    assert any("batch size 1" in n for n in report["notes"])
    assert "batch size 1" in (out / "report.md").read_text()


def test_existing_report_survives_a_failed_run_and_is_announced(verified, stock_rollout, capsys,
                                                                 tmp_path):
    rc, err, out = verified
    ckpt, path = stock_rollout
    before = (out / "report.json").read_text()
    bad = tmp_path / "bad.npz"
    bad.write_bytes(path.read_bytes()[:100])
    assert main(["verify", "--rollout", str(bad), "--checkpoint", str(ckpt), "--quick",
                 "--out", str(out)]) == 2
    e = capsys.readouterr().err
    assert "will be replaced" in e and str(out) in e
    assert (out / "report.json").read_text() == before
    assert "bad.npz: cannot read rollout file" in e


def test_requirement_failures_name_each_reason(stock_rollout):
    sch = RolloutBatch.load(stock_rollout[1]).schedule
    opts = VerifyOptions.quick()
    assert requirement_failures(600, 0.5, sch, opts) == []
    r = requirement_failures(24, 0.0, sch, opts)
    assert r == ["24 sampled tokens < 512", "0% early exit < 20%"]
    import dataclasses
    fixed = dataclasses.replace(sch, exit_threshold=None, fixed_depth=2)
    assert any("fixed depth 2" in x for x in requirement_failures(600, 1.0, fixed, opts))
    q1 = dataclasses.replace(sch, exit_threshold=1.0)
    assert any("q=1.0" in x for x in requirement_failures(600, 0.5, q1, opts))


def test_layouts_and_replay_impl(stock_rollout):
    layouts, notes = batching_layouts(1, 1)
    assert layouts == [("same", 1)] and "batch size 1" in notes[0]
    assert batching_layouts(4, 1) == ([("same", 1), ("different", 1)], [])
    # a rollout sampled on 2 devices: its learner on the same split (rows padded to 2)
    assert batching_layouts(4, 2) == ([("same", 2)], [])
    assert batching_layouts(3, 2) == ([("same", 2)], [])
    rb = RolloutBatch.load(stock_rollout[1])
    assert replay_impl_of(rb) == "forced"


def test_report_markdown_of_an_old_report_without_requirement_fields():
    """Reports written before `requirements_unmet` existed still render."""
    cell = {"dtype": "float32", "kv_policy": "dense", "weights": "random", "batching": "same",
            "params": "sampler", "devices": 1, "method": "replay", "replay_impl": "invariant",
            "tokens": 640, "early_exit_fraction": 0.3, "exact_fraction": 1.0,
            "max_abs_diff": 0.0, "mean_abs_diff": 0.0, "k3_kl": 0.0, "passed": True,
            "requirements_met": True}
    report = {"env": {}, "setup": {}, "cells": [cell],
              "summary": {"passed": True, "replay_exact_cells": 1, "replay_cells": 1,
                          "replay_forced_cells": 0, "negative_control_mismatching": 0,
                          "negative_control_cells": 0, "requirements_met": True}}
    md = report_markdown(report)
    assert "Requirements" in md and "met." in md


def test_forced_learner_logprobs_are_one_array_matching_the_sampler(stock_rollout):
    """`replay_impl="forced"` (the `--replay-impl auto` fallback) returns [B, S] log-probs, not
    the (logprob, processed) pair of `forced_replay_logprobs`."""
    import numpy as np

    from looprl.verify.matrix import learner_logprobs
    from looprl.io.checkpoint import load_model_checkpoint

    ckpt, path = stock_rollout
    params, cfg, _, _ = load_model_checkpoint(ckpt)
    rb = RolloutBatch.load(path)
    lp = learner_logprobs(cfg, params, rb, "replay", "same", np.arange(1), 1,
                          replay_impl="forced")
    assert isinstance(lp, np.ndarray) and lp.shape == rb.logprob_BxS.shape
    np.testing.assert_array_equal(lp.view(np.uint32), np.asarray(rb.logprob_BxS).view(np.uint32))


def test_verify_config_builds_the_model_train_builds(tmp_path):
    """`looprl verify --config` and `looprl train` build one model from one config (they once
    differed: verify left `head_dim` and `num_kv_heads` at the preset's when `hidden_size` or
    `num_heads` was overridden)."""
    from looprl.cli.verify import verify_model_config
    from looprl.config import load_experiment
    from looprl.model.config import from_model_section

    exp = tmp_path / "exp.py"
    exp.write_text("from looprl.config import ExperimentConfig, ModelConfig\n"
                   "CONFIG = ExperimentConfig(model=ModelConfig(preset='tiny', hidden_size=64, "
                   "num_heads=2, num_layers=1))\n")
    verify_cfg = verify_model_config(str(exp), vocab_size=58)
    train_cfg = from_model_section(load_experiment(exp).model)
    assert (verify_cfg.hidden_size, verify_cfg.num_heads, verify_cfg.num_kv_heads,
            verify_cfg.head_dim, verify_cfg.num_layers) == (64, 2, 2, 32, 1)
    assert verify_cfg.vocab_size == 58
    assert verify_cfg.replace(vocab_size=train_cfg.vocab_size) == train_cfg


def test_verify_console_shows_cells_only_with_v_and_ends_with_a_verdict_table():
    from looprl.cli.verify import is_cell_detail, verdict_rows
    assert is_cell_detail("    sampler same      dev=1 replay exact=1.0000 max=0.00e+00")
    assert not is_cell_detail("  trained float32 dense: rollout 1.2s")
    assert not is_cell_detail("    note: the rollout was sampled on 4 devices")

    def cell(w, d, p, method, exact, diff, passed):
        return {"weights": w, "dtype": d, "kv_policy": p, "method": method,
                "exact_fraction": exact, "max_abs_diff": diff, "passed": passed}
    cells = [cell("random", "float32", "dense", "replay", 1.0, 0.0, True),
             cell("random", "float32", "dense", "replay", 1.0, 0.0, True),
             cell("random", "float32", "dense", "stock", 0.4, 3e-6, True),
             cell("random", "float32", "dense", "dense", 1.0, 0.0, None),
             cell("trained", "bfloat16", "copy", "replay", 0.9, 1e-3, False),
             cell("trained", "bfloat16", "copy", "stock", 1.0, 0.0, False)]
    assert verdict_rows(cells) == [
        ("random", "float32", "dense", "2/2", "1/1", "3.0e-06", "PASS"),
        ("trained", "bfloat16", "copy", "0/1", "0/1", "0.0e+00", "FAIL")]


def test_a_non_finite_cell_figure_is_an_error_naming_the_cell():
    from looprl.cli.verify import check_finite_cells
    from looprl.errors import SamplingError
    good = {"weights": "trained", "dtype": "float32", "kv_policy": "copy", "batching": "same",
            "params": "sampler", "method": "replay", "max_abs_diff": 0.0, "k3_kl": 0.0}
    check_finite_cells([good])
    with pytest.raises(SamplingError, match=r"cell trained/float32/copy/same/sampler/replay: "
                                            r"max_abs_diff is nan"):
        check_finite_cells([good, {**good, "max_abs_diff": float("nan")}])
