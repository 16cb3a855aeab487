"""Experiment files with VARIANTS / SHARED_WARM_START (the ablation's runner), no training."""
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
