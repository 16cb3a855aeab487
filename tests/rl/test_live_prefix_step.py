"""A GRPO step whose completions end early runs its learner passes on the live prefix
(`learner.seq_bucket`; looprl.logprobs.methods, module doc): replay still equals the sampler bit
for bit, the first update's ratios are exactly 1, the KL reference pass (and, under `-m slow`,
the loop-credit passes) run on the same prefix, and the loss and gradient are the whole
layout's to fp32 rounding."""
import dataclasses
import zlib
from pathlib import Path

import numpy as np
import pytest

from looprl.config import apply_overrides, load_experiment
from looprl.model.config import from_model_section
from looprl.model.looped import init_params
from looprl.rl.learner import GRPOLearner
from looprl.train.setup import build_tasks

SMOKE = Path(__file__).resolve().parents[2] / "experiments" / "tiny_arith_smoke.py"
MAX_NEW, BUCKET = 12, 2


def _learner(*overrides):
    cfg = apply_overrides(load_experiment(SMOKE), [
        "prompts_per_step=2", "group_size=4", f"rollout.max_new_tokens={MAX_NEW}",
        "learner.minibatches=1", "learner.microbatch_size=4", "learner.measure_stock=false",
        "grpo.kl_beta=0.01",
        *overrides])
    mcfg = from_model_section(cfg.model)
    _, task = build_tasks(cfg)
    task.reward = lambda problem, text: float(zlib.crc32(text.encode()) % 2)
    tok = task.tokenizer()
    lrn = GRPOLearner(cfg, mcfg, init_params(mcfg, 0), task, tok)
    # the random model never stops: 3/4 of the vocabulary stops a row, so completions end early
    stop = tuple(i for i in range(tok.vocab_size) if i % 4)
    lrn.scfg = dataclasses.replace(lrn.scfg, stop_ids=stop)
    return lrn


@pytest.fixture(scope="module")
def steps():
    out = {}
    lrn = _learner(f"learner.seq_bucket={BUCKET}")
    out[BUCKET] = [lrn.step(0), lrn.step(1)]
    out[0] = [_learner("learner.seq_bucket=0").step(0)]  # the whole layout, for comparison
    return out


def test_learner_runs_on_the_live_prefix_with_exact_replay(steps):
    m0, m1 = steps[BUCKET]
    whole = steps[0][0]["learner_seq_len"]  # P + MAX_NEW
    for m in (m0, m1):
        assert m["learner_seq_len"] < whole and m["learner_seq_len"] % BUCKET == whole % BUCKET
        assert m["replay_exact_fraction"] == 1.0
        assert np.isfinite(m["loss"]) and m["grad_norm"] > 0
    assert m0["ratio_min"] == m0["ratio_max"] == 1.0  # hybrid's value is the sampler's bits
    assert m1["kl"] > 0  # the reference pass (after an update) ran on the prefix too


def test_live_prefix_changes_neither_the_samples_nor_the_objective(steps):
    # step 0 (the same parameters on both sides; after an update they differ in low bits, the
    # gradient's terms being summed in another order, so later steps may sample otherwise)
    a, b = steps[BUCKET][0], steps[0][0]
    assert a["rollout_sha256"] == b["rollout_sha256"]  # the same completions
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-7)
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    assert a["ratio_mean"] == b["ratio_mean"] == 1.0


@pytest.mark.slow  # 40 s more; the default tests above run the same slicing of the loss inputs
def test_loop_credit_old_and_new_passes_run_on_the_same_prefix():
    lrn = _learner(f"learner.seq_bucket={BUCKET}", "grpo.loop_credit=uniform")
    m = lrn.step(0)
    assert m["learner_seq_len"] < lrn.scfg.max_new_tokens + 6  # P = 6 here
    # old and new loop log-probs come from loop_logprobs at the same shapes: ratios exactly 1
    assert m["ratio_min"] == m["ratio_max"] == 1.0 and m["replay_exact_fraction"] == 1.0
