"""Every experiment file under experiments/ loads, and each of its variants' overrides applies
to its CONFIG (a renamed config key breaks the file here, not hours into a sweep)."""
from pathlib import Path

import pytest

from looprl.config import apply_overrides
from looprl.config.files import load_experiment_module

EXPERIMENTS = sorted((Path(__file__).resolve().parents[2] / "experiments").glob("*.py"))


def test_the_experiment_files_are_found():
    names = {p.stem for p in EXPERIMENTS}
    assert {"tiny_arith", "loss_study", "mismatch_horizon"} <= names


@pytest.mark.parametrize("path", EXPERIMENTS, ids=lambda p: p.stem)
def test_each_variant_of_each_experiment_file_applies(path):
    cfg, variants, shared = load_experiment_module(path)
    assert isinstance(shared, bool)
    built = {name: apply_overrides(cfg, list(over)) for name, over in (variants or {}).items()}
    # no two variants are the same run
    assert len({repr(c) for c in built.values()}) == len(built), path.name


def test_the_horizon_study_pairs_what_its_docstring_says():
    cfg, variants, shared = load_experiment_module(EXPERIMENTS[0].parent / "mismatch_horizon.py")
    assert shared and cfg.model.compute_dtype == "bfloat16" and cfg.rollout.kv_policy == "copy"
    assert (cfg.learner.minibatches, cfg.learner.ppo_epochs) == (4, 2)
    public = apply_overrides(cfg, variants["ouro_public"])
    assert public.rollout.exit_threshold == 1.0 and public.grpo.loss == "cispo"
    assert public.grpo.scale_rewards == "batch" and public.learner.logprob_method == "full_depth"
    assert apply_overrides(cfg, variants["hybrid"]).learner.old_logprobs != "recompute"


def test_the_replication_arms_differ_only_where_its_docstring_says():
    cfg, variants, shared = load_experiment_module(EXPERIMENTS[0].parent
                                                   / "mismatch_replication.py")
    assert shared and set(variants) == {"hybrid", "stock", "full_depth", "control"}
    arms = {name: apply_overrides(cfg, list(over)) for name, over in variants.items()}
    for arm in arms.values():  # the pre-registered setting, the same in every arm
        assert arm.model.compute_dtype == "bfloat16" and arm.grpo.loss == "ppo-clip"
        assert (arm.learner.minibatches, arm.learner.ppo_epochs) == (4, 1)
        assert (arm.optim.learning_rate, arm.run.grpo_steps) == (2e-4, 300)
        assert arm.eval.eval_problems == arm.task.eval_size >= 600
    for name in ("hybrid", "stock", "full_depth"):
        assert (arms[name].rollout.kv_policy, arms[name].rollout.exit_threshold) == ("copy", 0.6)
    control, full = arms["control"], arms["full_depth"]
    assert (control.rollout.kv_policy, control.rollout.exit_threshold) == ("dense", 1.0)
    assert control.learner == full.learner and full.learner.old_logprobs == "recompute"
    assert arms["stock"].learner.logprob_method == "stock"
