"""GRPO trainer and `looprl train`: a short smoke run, config rejection, non-finite stop."""
import json
import math
from pathlib import Path

import numpy as np
import pytest

from looprl.cli import main
from looprl.config import apply_overrides, load_experiment
from looprl.errors import TrainingError
from looprl.train.checkpoint import params_sha256

SMOKE = Path(__file__).resolve().parents[2] / "experiments" / "tiny_arith_smoke.py"
FAST = ["warm_start.max_steps=10", "eval.eval_problems=16", "warm_start.eval_problems=8",
        "grpo_steps=2", "progress_bar=false", "tensorboard=false"]


def test_params_sha256_matches_the_documented_recipe():
    import hashlib
    params = {"b": np.arange(3, dtype=np.float32), "a": {"k": np.ones((2, 1), np.float32)}}
    h = hashlib.sha256()
    h.update(b"a/k|float32|2,1|" + np.ones((2, 1), "<f4").tobytes())
    h.update(b"b|float32|3|" + np.arange(3, dtype="<f4").tobytes())
    assert params_sha256(params) == h.hexdigest()


def test_smoke_run_is_bit_exact_every_step_and_writes_the_run_directory(tmp_path):
    from looprl.train.run import train
    cfg = apply_overrides(load_experiment(SMOKE), FAST + [f"out_dir={tmp_path / 'run'}"])
    summary = train(cfg, quiet=True)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert r["replay_exact_fraction"] == 1.0, r
        assert all(math.isfinite(v) for v in r.values() if isinstance(v, float)), r
        assert 0 < r["stock_max_abs_diff"] < 1e-4
    for key in ("eval_accuracy_before", "eval_accuracy_after", "eval_problems", "grpo_steps",
                "resumed_from_step", "params_sha256", "wall_s"):
        assert key in summary
    assert summary["resumed_from_step"] is None and summary["grpo_steps"] == 2
    for name in ("config.json", "summary.json", "warm_start_curve.json", "checkpoint",
                 "eval_before.json", "checkpoints/step_00000002", "checkpoints/index.jsonl"):
        assert (tmp_path / "run" / name).exists()


def test_bad_config_key_and_non_empty_out_dir_are_rejected(tmp_path, capsys):
    assert main(["train", str(SMOKE), "grpo.not_a_key=1"]) == 2
    assert "unknown config key 'grpo.not_a_key'" in capsys.readouterr().err
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "f").write_text("")
    assert main(["train", str(SMOKE), f"out_dir={tmp_path / 'x'}"]) == 2
    assert "is not empty" in capsys.readouterr().err


def test_non_finite_loss_stops_with_a_diagnostic_and_writes_no_checkpoint(tmp_path,
                                                                         monkeypatch):
    from looprl.tasks.arithmetic import ArithmeticTask
    from looprl.train.run import train
    monkeypatch.setattr(ArithmeticTask, "reward", lambda self, p, c: float("nan"))
    cfg = apply_overrides(load_experiment(SMOKE), FAST + [f"out_dir={tmp_path / 'run'}"])
    with pytest.raises(TrainingError, match=r"GRPO step 0: non-finite loss"):
        train(cfg, quiet=True)
    failure = json.loads((tmp_path / "run" / "failure.json").read_text())
    assert failure["step"] == 0 and "non-finite" in failure["error"]
    assert not (tmp_path / "run" / "checkpoint").exists()
    assert not (tmp_path / "run" / "summary.json").exists()
