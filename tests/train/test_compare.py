"""`looprl plot --compare`: variant groups across seeds (the mismatch study's figures/table)."""
import json

import numpy as np

from looprl.cli import main
from looprl.train.compare import collapse_step, comparison_table, load_groups, split_name


def _run(d, rewards, before, after, evals=None, delta=None):
    d.mkdir(parents=True)
    rows = []
    for i, r in enumerate(rewards):
        row = {"step": i, "reward_mean": r, "mismatch_abs_mean": 0.01 * (i + 1),
               "mismatch_abs_max": 0.1 * (i + 1),
               "mismatch_k3_kl": 1e-4, "rollout_s": 1.0, "learner_s": 0.5}
        if evals and i in evals:
            row["eval_accuracy"] = evals[i]
        rows.append(row)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "summary.json").write_text(json.dumps({"eval_accuracy_before": before,
                                                "eval_accuracy_after": after,
                                                "grpo_steps": len(rewards)}))
    if delta is not None:
        np.save(d / "mismatch_step0.npy", np.asarray(delta, np.float32))


def test_collapse_is_the_first_step_below_half_the_peak_moving_mean(tmp_path):
    rewards = [0.8] * 12 + [0.1] * 10
    # 10-step means: after 17 steps (5 x 0.8 + 5 x 0.1) / 10 = 0.45, after 18 steps 0.38 < 0.4
    _run(tmp_path / "s0" / "deferred_fp32_stock", rewards, 0.5, 0.2)
    rec = load_groups([tmp_path / "s0"])["deferred_fp32_stock"][0]
    assert collapse_step(rec) == 18
    _run(tmp_path / "s1" / "deferred_fp32_stock", [0.5] * 22, 0.5, 0.6, evals={4: 0.4})
    assert collapse_step(load_groups([tmp_path / "s1"])["deferred_fp32_stock"][0]) == 5
    _run(tmp_path / "s2" / "deferred_fp32_stock", [0.5] * 22, 0.5, 0.6)
    assert collapse_step(load_groups([tmp_path / "s2"])["deferred_fp32_stock"][0]) is None


def test_compare_writes_figures_and_the_table(tmp_path, capsys):
    for s, after in ((0, 0.6), (1, 0.7)):
        _run(tmp_path / f"seed{s}" / "copy_fp32_hybrid", [0.5] * 12, 0.5, after,
             evals={5: 0.55}, delta=[0.0, 0.0, 0.0])
        _run(tmp_path / f"seed{s}" / "copy_fp32_full_depth", [0.5] * 12, 0.5, 0.4,
             delta=[1e-3, 0.2, 0.0])
    groups = load_groups([tmp_path / "seed0", tmp_path / "seed1"])
    assert split_name("copy_fp32_full_depth") == ("copy_fp32", "full_depth")
    assert split_name("cispo_full_depth") == ("all", "cispo_full_depth")
    assert split_name("hybrid") == ("all", "hybrid")
    table = comparison_table(groups)
    assert "| copy_fp32_hybrid | 2 | 0.500 (0.500-0.500) | 0.650 (0.600-0.700) | none, none |" \
        in table
    assert "| copy_fp32_full_depth | 2 | 0.500 (0.500-0.500) | 0.400 (0.400-0.400) | 12, 12 |" \
        in table  # below the warm start at the final evaluation
    assert "| 1.00e-02 / 1.20e-01 | 1.20e+00 |" in table and "| 1.50 |" in table
    out = tmp_path / "cmp"
    assert main(["plot", "--compare", str(tmp_path / "seed0"), str(tmp_path / "seed1"),
                 "--out", str(out)]) == 0
    for name in ("compare_copy_fp32.png", "compare_copy_fp32_delta0.png", "comparison.md"):
        assert (out / name).stat().st_size > 1000 or name.endswith(".md")
