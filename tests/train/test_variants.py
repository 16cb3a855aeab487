"""Experiment files with VARIANTS / SHARED_WARM_START (the ablation's runner), and sweeps that
resume in place (the slow test trains a tiny sweep twice)."""
import json
from pathlib import Path

import pytest

from looprl.config import apply_overrides, load_experiment, load_experiment_module
from looprl.errors import ConfigError

EXP = Path(__file__).resolve().parents[2] / "experiments"


def test_ablation_declares_four_variants_over_a_shared_warm_start():
    cfg, variants, shared = load_experiment_module(EXP / "tiny_arith_ablation.py")
    assert shared is True
    assert set(variants) == {"hybrid_dense", "hybrid_deferred", "stock_dense", "stock_deferred"}
    main = load_experiment(EXP / "tiny_arith.py")
    assert cfg.model == main.model and cfg.task == main.task and cfg.run.seed == main.run.seed
    for name, over in variants.items():
        v = apply_overrides(cfg, over)
        method, policy = name.split("_")
        assert (v.learner.logprob_method, v.rollout.kv_policy) == (method, policy)


def test_plain_experiment_has_no_variants():
    _, variants, shared = load_experiment_module(EXP / "tiny_arith.py")
    assert variants is None and shared is False


@pytest.mark.parametrize("body, match", [
    ("VARIANTS = ['a']", "VARIANTS must be a non-empty dict"),
    ("VARIANTS = {'a/b': []}", "VARIANTS must be a non-empty dict"),
    ("VARIANTS = {'a': ['grpo.nope=1']}", "variant 'a'.*unknown config key 'grpo.nope'"),
    ("SHARED_WARM_START = 'yes'", "SHARED_WARM_START must be a bool"),
])
def test_malformed_variants_are_rejected(tmp_path, body, match):
    f = tmp_path / "exp.py"
    f.write_text("from looprl.config import ExperimentConfig\nCONFIG = ExperimentConfig()\n"
                 + body + "\n")
    with pytest.raises(ConfigError, match=match):
        load_experiment_module(f)


def test_a_fresh_sweep_refuses_a_used_directory_and_a_resume_elsewhere(tmp_path):
    from looprl.train.variants import train_variants
    cfg = load_experiment(EXP / "tiny_arith_smoke.py")
    used = tmp_path / "used"
    used.mkdir()
    (used / "x").write_text("")
    with pytest.raises(ConfigError, match="not empty.*resume="):
        train_variants(apply_overrides(cfg, [f"out_dir={used}"]), {"a": []}, [])
    with pytest.raises(ConfigError, match="resume must be out_dir"):
        train_variants(apply_overrides(cfg, [f"out_dir={used}", f"resume={tmp_path}"]),
                       {"a": []}, [])
    with pytest.raises(ConfigError, match="nothing to continue"):
        train_variants(apply_overrides(cfg, [f"out_dir={tmp_path / 'no'}",
                                             f"resume={tmp_path / 'no'}"]), {"a": []}, [])


@pytest.mark.slow
def test_a_stopped_sweep_resumes_to_the_bits_of_one_run_through(tmp_path):
    """Sweep A runs through; sweep B stops every variant after 2 of 4 steps, loses its second
    variant's directory, then `resume=B`: the warm start is kept, variant a resumes from its
    checkpoint, variant b runs again from the start, and both end with A's parameter bits."""
    import shutil

    from looprl.train.variants import train_variants
    shrink = ["warm_start.max_steps=20", "warm_start.eval_every_steps=20", "eval.eval_problems=8",
              "warm_start.eval_problems=8", "progress_bar=false", "tensorboard=false",
              "checkpoint_every_steps=1", "grpo_steps=4"]
    cfg = apply_overrides(load_experiment(EXP / "tiny_arith_smoke.py"), shrink)
    variants = {"a": ["learner.logprob_method=hybrid"], "b": ["optim.learning_rate=1e-3"]}
    a, b = tmp_path / "A", tmp_path / "B"
    whole = train_variants(apply_overrides(cfg, [f"out_dir={a}"]), variants, [],
                           shared_warm_start=True, quiet=True)
    train_variants(apply_overrides(cfg, [f"out_dir={b}", "stop_after=2"]), variants,
                   ["stop_after=2"], shared_warm_start=True, quiet=True)
    ws_before = (b / "warm_start_run" / "summary.json").read_bytes()
    shutil.rmtree(b / "b")
    resumed = train_variants(apply_overrides(cfg, [f"out_dir={b}", f"resume={b}"]), variants,
                             [f"resume={b}"], shared_warm_start=True, quiet=True)
    assert (b / "warm_start_run" / "summary.json").read_bytes() == ws_before
    for name in variants:
        sa = json.loads((a / name / "summary.json").read_text())
        sb = json.loads((b / name / "summary.json").read_text())
        assert sb["params_sha256"] == sa["params_sha256"] and sb["grpo_steps"] == 4
    assert json.loads((b / "a" / "summary.json").read_text())["resumed_from_step"] == 2
    assert set(resumed["variants"]) == set(whole["variants"]) == {"a", "b"}
