"""GRPO with a thinking budget: forced tokens leave the loss, replay stays exact at every step
(`learner.require_exact` is on for the CPU), and a run stopped halfway and resumed ends with
the parameter bits and metrics of the run trained through (`slow`: three short runs of
`experiments/tiny_arith_smoke.py`, shrunk as in tests/train/test_resume.py)."""
import json
from pathlib import Path

import numpy as np
import pytest

from looprl.config import apply_overrides, load_experiment
from looprl.rl.rollout import interrupted_fraction, loss_exit_loops
from looprl.sampling.schedule import RolloutBatch, Schedule

ROOT = Path(__file__).resolve().parents[2]
SMOKE = ROOT / "experiments" / "tiny_arith_smoke.py"
# the completion closes its "thinking" with "=" (the smoke task's answers start with it)
THINK = ["rollout.max_new_tokens=10", "rollout.thinking_budget=2,3", "rollout.answer_budget=4",
         "rollout.forced_answer_text==", "rollout.think_close_text==",
         "warm_start.max_steps=10", "warm_start.eval_every_steps=10", "eval.eval_problems=16",
         "warm_start.eval_problems=16", "progress_bar=false", "tensorboard=false",
         "checkpoint_every_steps=1", "keep_checkpoints=10", "grpo_steps=4"]
TIMING = {"rollout_s", "learner_s"}


def test_loss_exit_loops_zero_the_forced_positions_only():
    sched = Schedule("dense", 0.9, None, 0, 1, 2, 6, 2, 4, "float32", 1.0, 0, 1.0, 0, 0, "x")
    el = np.array([[0, 3, 4, 1, 2, 0], [0, 2, 2, 0, 0, 0]], np.int32)
    z = np.zeros((2, 6), np.float32)
    forced = np.zeros((2, 6), bool)
    forced[0, 2:4] = True
    rb = RolloutBatch(np.zeros((2, 6), np.int32), np.zeros(2, np.int32), el, z, z, forced,
                      np.zeros(2, np.int32), np.zeros(2, np.int32), np.array([5, 2]), sched,
                      forced_BxS=forced)
    np.testing.assert_array_equal(loss_exit_loops(rb), [[0, 3, 0, 0, 2, 0], [0, 2, 2, 0, 0, 0]])
    np.testing.assert_array_equal(rb.sampled_mask_BxS, (el > 0) & ~forced)
    assert interrupted_fraction(rb) == 0.5
    plain = RolloutBatch(*(getattr(rb, k) for k in ("tokens_BxS", "pad_B", "exit_loop_BxS",
                                                    "logprob_BxS", "logprob_processed_BxS",
                                                    "flush_BxS", "prompt_index_B",
                                                    "sample_index_B", "completion_len_B")),
                         schedule=sched)
    assert loss_exit_loops(plain) is not None and interrupted_fraction(plain) == 0.0
    np.testing.assert_array_equal(loss_exit_loops(plain), el)


def _rows(path):
    return [{k: v for k, v in json.loads(x).items() if k not in TIMING}
            for x in Path(path).read_text().splitlines() if x.strip()]


@pytest.mark.slow
def test_a_run_with_interruptions_resumes_bit_identically(tmp_path, monkeypatch):
    from looprl.rl import learner as rl_learner
    from looprl.train.run import train
    real, fractions = rl_learner.generate, []

    def spy(*a, **kw):
        rb = real(*a, **kw)
        if kw.get("forced") is None and rb.schedule.thinking_budget is not None:
            fractions.append(interrupted_fraction(rb))
        return rb

    monkeypatch.setattr(rl_learner, "generate", spy)
    base = apply_overrides(load_experiment(SMOKE), THINK)
    whole = train(apply_overrides(base, [f"out_dir={tmp_path / 'a'}"]), quiet=True)
    assert len(fractions) == 4 and min(fractions) >= 1 / 3 and max(fractions) < 1, fractions
    train(apply_overrides(base, [f"out_dir={tmp_path / 'b'}", "stop_after=2"]), quiet=True)
    resumed = train(apply_overrides(base, [f"out_dir={tmp_path / 'b'}",
                                          f"resume={tmp_path / 'b'}"]), quiet=True)
    assert resumed["params_sha256"] == whole["params_sha256"]
    assert resumed["resumed_from_step"] == 2
    a, b = _rows(tmp_path / "a" / "metrics.jsonl"), _rows(tmp_path / "b" / "metrics.jsonl")
    assert [r["step"] for r in a] == [0, 1, 2, 3] and a == b
    assert all(r["replay_exact_fraction"] == 1.0 for r in a if r["replay_exact_fraction"]
               is not None)


def test_the_run_tokenises_the_texts_once_for_the_rollout_not_the_evaluation():
    from looprl.config import ExperimentConfig
    from looprl.errors import ConfigError
    from looprl.rl.rollout import sampling_config
    from looprl.tokenizer import build_char_tokenizer, chat_prompt
    tok = build_char_tokenizer()
    cfg = ExperimentConfig()
    cfg = cfg.replace(rollout=cfg.rollout.replace(
        max_new_tokens=96, thinking_budget=(24, 32), answer_budget=8,
        forced_answer_text="\n</think>\n\nthe final answer is "))
    scfg = sampling_config(cfg, tokenizer=tok)
    assert scfg.thinking_budget == (24, 32) and scfg.answer_budget == 8
    assert scfg.forced_answer_ids == tuple(tok.encode("\n</think>\n\nthe final answer is "))
    assert scfg.think_close_ids == tuple(tok.encode("</think>")) and len(scfg.think_close_ids) == 8
    scfg.validate(4)
    # the thinking prompt style opens the thinking the close ends
    assert chat_prompt("2+3", "thinking").endswith("<think>\n")
    assert sampling_config(cfg, greedy=True).thinking_budget is None
    with pytest.raises(ConfigError, match="tokenizer"):
        sampling_config(cfg)
    upper = cfg.replace(rollout=cfg.rollout.replace(forced_answer_text="The answer is "))
    with pytest.raises(ConfigError, match="rollout.forced_answer_text"):
        sampling_config(upper, tokenizer=tok)
    with pytest.raises(ConfigError, match="thinking_budget"):
        cfg.rollout.replace(thinking_budget=(5, 4))
