"""Learner modes and old log-probs of the mismatch study: one GRPO step per learner
mode, the TIS weight under `recompute`, and the mismatch metrics on a hand-checked case."""
import math
import zlib
from pathlib import Path

import numpy as np
import pytest

from looprl.config import apply_overrides, load_experiment
from looprl.model.config import from_model_section
from looprl.model.looped import init_params
from looprl.rl.learner import GRPOLearner, mismatch_stats
from looprl.train.setup import build_tasks

SMOKE = Path(__file__).resolve().parents[2] / "experiments" / "tiny_arith_smoke.py"
SMALL = ["prompts_per_step=4", "group_size=4", "rollout.temperature=1.5",
         "rollout.kv_policy=deferred", "learner.minibatches=2", "learner.microbatch_size=0",
         "learner.measure_stock=false"]


def _learner(*overrides):
    """A GRPO learner on the smoke config from random weights, with a reward that varies within
    groups (the completion's CRC parity), so that advantages and gradients are nonzero."""
    cfg = apply_overrides(load_experiment(SMOKE), SMALL + list(overrides))
    mcfg = from_model_section(cfg.model)
    _, rl_task = build_tasks(cfg)
    rl_task.reward = lambda problem, text: float(zlib.crc32(text.encode()) % 2)
    return GRPOLearner(cfg, mcfg, init_params(mcfg, 0), rl_task, rl_task.tokenizer())


def test_mismatch_stats_on_a_hand_checked_case():
    learner = np.array([[0.0, -1.0, np.log(0.5), 9.0]])
    sampler = np.array([[0.0, -1.0 - np.log(2.0), 0.0, 9.0]])
    mask = np.array([[False, True, True, False]])
    s = mismatch_stats(learner, sampler, mask, eps_low=0.2, eps_high=0.28)
    # tokens: r = 2 (x = log 2) and r = 0.5 (x = -log 2); k3 = r - 1 - log r
    k3 = ((2 - 1 - np.log(2)) + (0.5 - 1 + np.log(2))) / 2
    assert s["mismatch_k3_kl"] == pytest.approx(k3, rel=1e-12)
    assert s["mismatch_abs_mean"] == pytest.approx(np.log(2), rel=1e-12)
    assert s["mismatch_abs_max"] == pytest.approx(np.log(2), rel=1e-12)
    assert s["ratio_outside_clip_frac"] == 1.0
    assert mismatch_stats(learner, learner, mask, 0.2, 0.28)["mismatch_abs_max"] == 0.0


# hybrid trains in tests/rl/test_learner.py, expected in tests/logprobs/test_schedule_unaware.py;
# stock (the unreplayed baseline) has its log-probs measured in every GRPO step of those
@pytest.mark.parametrize("method", [pytest.param("hybrid", marks=pytest.mark.slow),
                                    pytest.param("stock", marks=pytest.mark.slow), "full_depth",
                                    pytest.param("expected", marks=pytest.mark.slow)])
def test_one_grpo_step_per_learner_mode(method):
    """fp32, deferred KV, 2 updates: a finite step; `hybrid` has zero mismatch and ratio 1 at
    the first update, the schedule-unaware modes are off the sampler."""
    learner = _learner(f"learner.logprob_method={method}")
    gate0 = np.asarray(learner.params["early_exit_gate"]["kernel"]).copy()
    m = learner.step(0)
    assert all(math.isfinite(v) for k, v in m.items()
               if isinstance(v, float) and k != "stock_max_abs_diff"), m  # nan: not measured
    assert m["grad_norm"] > 0
    gate_moved = not np.array_equal(
        gate0.view(np.uint32), np.asarray(learner.params["early_exit_gate"]["kernel"]).view(
            np.uint32))
    assert gate_moved == (method == "expected")  # only `expected` trains the gate
    if method == "hybrid":
        assert m["mismatch_abs_max"] == 0.0 and m["mismatch_k3_kl"] == 0.0
        assert m["replay_exact_fraction"] == 1.0
    elif method == "stock":
        assert 0 < m["mismatch_abs_max"] < 1e-4 and m["mismatch_k3_kl"] < 1e-8
    else:
        assert m["mismatch_abs_mean"] > 1e-3


@pytest.mark.slow  # 19 s
def test_recompute_gives_a_tis_weight_other_than_one_for_full_depth():
    """With old log-probs recomputed by a `full_depth` learner, the TIS weight
    min(pi_old / pi_sampler, cap) is not 1; with the sampler's own log-probs it is exactly 1."""
    rec = _learner("learner.logprob_method=full_depth", "learner.old_logprobs=recompute",
                   "grpo.tis_cap=2.0").step(0)
    assert abs(rec["tis_weight_mean"] - 1.0) > 1e-3
    # the first update's ratio is taken against the recomputed values: exactly 1 at the start
    samp = _learner("learner.logprob_method=hybrid", "grpo.tis_cap=2.0").step(0)
    assert samp["tis_weight_mean"] == 1.0
