"""A run that learns nothing says so. The smoke config without its warm start: the random
model answers no problem, so every group's rewards are equal (0), every GRPO step has gradient
norm 0 and the parameters stay the reference policy's; the run used to report only "replay
exact 2/2 ... bit for bit"."""
import json
from pathlib import Path

from looprl.cli import main

ROOT = Path(__file__).resolve().parents[2]
SMOKE = ROOT / "experiments" / "tiny_arith_smoke.py"


def test_a_run_with_zero_gradients_says_it_learned_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", str(SMOKE), "warm_start.enabled=false", "grpo_steps=2",
                 "eval.eval_problems=4", "rollout.prompts_per_step=2", "rollout.group_size=2",
                 "learner.minibatches=1", "learner.microbatch_size=4", "tensorboard=false",
                 "progress_bar=false", f"out_dir={out}"]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["steps_with_zero_grad"] == 2 and s["params_changed"] is False
    ref = json.loads((out / "warm_start" / "looprl_meta.json").read_text())["params_sha256"]
    assert s["params_sha256"] == ref
    cap = capsys.readouterr()
    assert ("looprl train: warning: the run learned nothing: every one of the 2 GRPO steps had "
            "gradient norm 0" in cap.err)
    assert "learning" in cap.out and "the run learned nothing" in cap.out  # the summary table
