"""`looprl plot` figures (issue 15): titled with the run's setting, smoothed curves over faint raw
values, held-out accuracy before/after marked, reward not drawn twice, compile step off scale."""
import json

import matplotlib
import numpy as np
import pytest

from looprl.errors import ConfigError
from looprl.train.plots import _accuracy_panel, _timing_panel, plot_runs, setting_title, smooth

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def fake_run(tmp_path, n=40):
    d = tmp_path / "myrun"
    d.mkdir()
    rows = [{"step": s, "reward_mean": s / n, "accuracy": s / n, "mean_exit_loop": 2.0,
             "replay_exact_fraction": 1.0, "stock_max_abs_diff": 1e-6, "grad_norm": 1.0,
             "clip_frac": 0.0, "kl": 0.0, "rollout_s": 20.0 if s == 0 else 0.5,
             "learner_s": 0.4} for s in range(n)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "summary.json").write_text(json.dumps({"eval_accuracy_before": 0.5,
                                                "eval_accuracy_after": 0.7, "grpo_steps": n}))
    (d / "config.json").write_text(json.dumps({
        "name": "tiny_arith", "rollout": {"exit_threshold": 0.6, "kv_policy": "deferred"},
        "learner": {"logprob_method": "hybrid"}, "run": {"grpo_steps": n, "seed": 0}}))
    return d, rows


def test_smooth_is_a_centred_running_mean():
    assert np.array_equal(smooth([1.0, 5.0]), [1.0, 5.0])            # n < 20: window 1
    y = smooth(list(range(30)))                                        # window 3
    assert y[0] == 0.5 and y[1] == 1.0 and y[15] == 15.0 and y[-1] == 28.5


def test_title_accuracy_marks_and_timing_scale(tmp_path):
    d, rows = fake_run(tmp_path)
    assert setting_title([d]) == ("myrun (tiny_arith: q=0.6, deferred, hybrid, 40 GRPO steps, "
                                  "seed 0)")
    fig, ax = plt.subplots()
    _accuracy_panel(ax, {"myrun": rows}, {"myrun": json.loads((d / "summary.json").read_text())},
                    ["C0"])
    (line,) = ax.lines        # rollout accuracy == reward: not drawn again; held-out marked
    assert list(line.get_xdata()) == [0, 40] and list(line.get_ydata()) == [0.5, 0.7]
    fig, ax = plt.subplots()
    _timing_panel(ax, "rollout_s", {"myrun": rows}, ["C0"])
    assert ax.get_ylim()[1] < 1.0    # the 20 s compile step is off the scale
    assert all(20.0 not in line.get_ydata() for line in ax.lines)
    written = plot_runs([d], tmp_path / "plots")
    assert {p.name for p in written} >= {"reward.png", "accuracy.png", "timing.png"}
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in written)



def test_plot_output_directory_errors_name_it_and_create_nothing(tmp_path):
    """An output directory the OS refuses is a ConfigError naming it (not a traceback), and a
    directory that is not a run leaves no plots directory behind."""
    d, _ = fake_run(tmp_path)
    (tmp_path / "afile").write_text("not a directory")
    with pytest.raises(ConfigError, match="plot output directory: cannot create directory .*afile"):
        plot_runs([d], tmp_path / "afile" / "plots")
    with pytest.raises(ConfigError, match="no metrics.jsonl"):
        plot_runs([tmp_path / "nope"], tmp_path / "nope" / "plots")
    assert not (tmp_path / "nope").exists()
