"""`looprl eval --num-samples N --temperature T`: mean@N and the unbiased pass@k (Chen et al.
2021, arXiv 2107.03374) against hand-computed values, and the command end to end."""
import json
from fractions import Fraction
from math import comb
from pathlib import Path

import pytest
from tiny_ouro import tiny_looprl_checkpoint

from looprl.cli import main
from looprl.cli.eval import summarize
from looprl.rl.evaluation import pass_at_k, pass_at_k_summary
from looprl.tasks.math_jsonl import MathTask

MATH_DATA = Path(__file__).resolve().parents[1] / "tasks" / "data" / "math"


@pytest.mark.parametrize("n, c, k, value", [
    (4, 1, 2, 0.5),          # 1 - C(3,2)/C(4,2) = 1 - 3/6
    (5, 2, 2, 0.7),          # 1 - C(3,2)/C(5,2) = 1 - 3/10
    (10, 3, 4, 5 / 6),       # 1 - C(7,4)/C(10,4) = 1 - 35/210
    (4, 0, 1, 0.0), (4, 0, 4, 0.0),
    (4, 4, 1, 1.0), (4, 3, 2, 1.0),  # n - c < k: every k-subset holds a correct sample
    (4, 1, 1, 0.25), (4, 1, 4, 1.0),
    (200, 1, 100, 0.5),      # 1 - C(199,100)/C(200,100) = 1 - 100/200
])
def test_pass_at_k_hand_computed(n, c, k, value):
    assert pass_at_k(n, c, k) == value


def test_pass_at_k_equals_the_binomial_formula_for_large_n():
    for n, c, k in ((1024, 7, 512), (1000, 999, 3), (333, 100, 200)):
        exact = 1 - Fraction(comb(n - c, k), comb(n, k))
        assert pass_at_k(n, c, k) == float(exact)
    for bad in ((4, 5, 1), (4, 1, 0), (4, 1, 5), (4, -1, 1)):
        with pytest.raises(ValueError, match="pass@k"):
            pass_at_k(*bad)


def test_pass_at_k_summary_hand_computed():
    s = pass_at_k_summary([0, 1, 4], 4)
    assert list(s) == ["mean@4", "pass@1", "pass@2", "pass@4"]
    assert s["mean@4"] == s["pass@1"] == pytest.approx(5 / 12, abs=0, rel=1e-15)
    assert s["pass@2"] == 0.5           # (0 + 1/2 + 1) / 3
    assert s["pass@4"] == 2 / 3         # (0 + 1 + 1) / 3
    assert list(pass_at_k_summary([3], 6)) == ["mean@6", "pass@1", "pass@2", "pass@4", "pass@6"]
    assert pass_at_k_summary([1, 0], 1) == {"mean@1": 0.5, "pass@1": 0.5}


def test_summarize_groups_consecutive_samples_per_problem():
    def row(ok):
        return {"correct": ok, "exit_loops": [4], "truncated": False, "kv_cache_bytes": 1}
    rows = [row(True), row(False), row(False), row(False)]  # problem 0: 1 of 2; problem 1: 0
    s = summarize(1.0, rows, wall_s=0.0, num_samples=2)
    assert (s["problems"], s["num_samples"], s["correct"]) == (2, 2, 1)
    assert s["pass_at_1"] == 0.25 and s["pass_at_k"] == {"mean@2": 0.25, "pass@1": 0.25,
                                                         "pass@2": 0.5}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_looprl_checkpoint(tmp_path_factory.mktemp("passk"))


def test_eval_num_samples_reports_pass_at_k(tiny, tmp_path, capsys, monkeypatch):
    """4 samples of 3 math problems at temperature 1; the reward is replaced by a rule on the
    completion (the tiny model solves nothing), so pass@k has something to count."""
    ckpt, _ = tiny
    monkeypatch.setattr(MathTask, "reward", lambda self, p, text: float(len(text) % 2 == 0))
    base = ["eval", "--checkpoint", str(ckpt), "--task", "math", "--data-dir", str(MATH_DATA),
            "--limit", "3", "--max-new-tokens", "5", "--batch-size", "2", "--temperature", "1",
            "--num-samples", "4"]
    assert main(base + ["--out", str(tmp_path / "ev"), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    res = json.loads((tmp_path / "ev" / "results.json").read_text())
    assert printed == res and res["settings"]["num_samples"] == 4
    (s,) = res["thresholds"]
    rows = [json.loads(line) for line in
            (tmp_path / "ev" / "problems.jsonl").read_text().splitlines()]
    per = [r["by_threshold"]["1"] for r in rows]
    assert [len(p["samples"]) for p in per] == [4, 4, 4]
    for p in per:
        assert [x["correct"] for x in p["samples"]] == [len(x["completion"]) % 2 == 0
                                                       for x in p["samples"]]
        assert p["num_correct"] == sum(x["correct"] for x in p["samples"])
    counts = [p["num_correct"] for p in per]
    # this seed's draws: 1, 2 and 1 of 4 correct; pass@2 = (1/2 + (1 - 1/6) + 1/2) / 3 = 11/18
    assert counts == [1, 2, 1]
    assert s["pass_at_k"]["pass@2"] == pytest.approx(11 / 18, abs=0, rel=1e-15)
    assert s["pass_at_k"]["pass@4"] == 1.0 and s["pass_at_k"]["mean@4"] == 4 / 12
    assert s["correct"] == sum(counts) and s["problems"] == 3
    assert s["pass_at_k"] == pass_at_k_summary(counts, 4)
    assert s["pass_at_1"] == sum(counts) / 12
    assert len({x["completion"] for p in per for x in p["samples"]}) > 3  # samples differ
    # the console table shows mean@4, pass@2 and pass@4
    assert main(base + ["--out", str(tmp_path / "ev2")]) == 0
    out = capsys.readouterr().out
    assert all(col in out for col in ("mean@4", "pass@2", "pass@4", "4 samples each"))
    # the same seed gives the same samples
    assert (tmp_path / "ev2" / "problems.jsonl").read_text() == \
        (tmp_path / "ev" / "problems.jsonl").read_text()


@pytest.mark.parametrize("extra, match", [
    (["--num-samples", "2"], "set --temperature > 0"),
    (["--num-samples", "0", "--temperature", "1"], "--num-samples: expected a positive int"),
])
def test_num_samples_bad_arguments(tiny, tmp_path, capsys, extra, match):
    ckpt, _ = tiny
    args = ["eval", "--checkpoint", str(ckpt), "--task", "math", "--data-dir", str(MATH_DATA),
            "--out", str(tmp_path / "ev"), *extra]
    assert main(args) == 2
    assert match in capsys.readouterr().err
