"""experiments/analysis/seed_stats.py: its statistics against hand-computed values, and its table
on the committed fixture (4 seeds x 10 problems, counts chosen so every figure is by hand);
collect_replication.py: its checks and the files it writes."""
import gzip
import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = Path(__file__).resolve().parent / "fixtures" / "mismatch_replication"


def _module(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "experiments" / "analysis"
                                                  / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


ss = _module("seed_stats")
T_975_DF3 = 3.182446305284263  # the t table's 97.5 % point at df = 3


def test_t_interval_is_the_hand_computed_one():
    # mean 20, sd sqrt(200 / 3), n = 4
    lo, hi = ss.t_interval(np.array([20.0, 20.0, 30.0, 10.0]))
    half = T_975_DF3 * math.sqrt(200 / 3) / 2
    assert abs(lo - (20 - half)) < 1e-9 and abs(hi - (20 + half)) < 1e-9  # table: 16 digits
    assert ss.effect_size_dz(np.array([20.0, 20.0, 30.0, 10.0])) == 20 / math.sqrt(200 / 3)


def test_t_interval_needs_two_seeds():
    with pytest.raises(ValueError, match="at least 2"):
        ss.t_interval(np.array([1.0]))


def test_sign_flip_p_counts_the_patterns():
    # |11 - 2F| >= 9 for a flipped magnitude sum F <= 1 or >= 10: 3 + 3 of 32 patterns
    assert ss.sign_flip_p(np.array([1, 2, 3, 4, -1])) == 6 / 32
    assert ss.sign_flip_p(np.array([1, 1, 1, 1, 1, 1, 1, 1, 1, 1])) == 2 / 1024  # the floor
    assert ss.sign_flip_p(np.array([0, -1, 0, 1])) == 1.0


def test_holm_steps_down_and_keeps_the_order_monotone():
    # sorted 0.005, 0.01, 0.03, 0.04 -> x4, x3, x2, x1 = 0.02, 0.03, 0.06, 0.04 -> 0.06 kept
    assert ss.holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02],
                                                                abs=1e-15)
    assert ss.holm([0.5, 0.9]) == [1.0, 1.0]


def test_power_matches_the_published_value():
    # R: power.t.test(n = 10, delta = 1, type = "one.sample") -> 0.8030962 (upper tail; the
    # lower tail adds about 6e-7)
    assert abs(ss.t_power(1.0, 10) - 0.8030962) < 2e-6
    dz = ss.detectable_dz(10)
    assert abs(ss.t_power(dz, 10) - 0.8) < 1e-8 and 0.99 < dz < 1.0


def test_the_table_on_the_fixture():
    text = ss.report(ss.load(FIXTURE), FIXTURE)
    lines = text.splitlines()
    # hybrid - warm start: 20 / 20 / 30 / 10 points; every seed positive -> 2 / 16
    assert ("| hybrid - warm start | 4 | +20.0 / +20.0 / +30.0 / +10.0 | +20.0 | [+7.0, +33.0] "
            "| 0.0163 | +2.45 | 0.1250 | 0.6250 | 17.4 |") in lines
    # control trains and is scored at q = 1, full_depth at q = 0.6
    assert ("| full_depth - control | 4 | -20.0 / -20.0 / -30.0 / -10.0 | -20.0 | [-33.0, -7.0] "
            "| 0.0163 | -2.45 | 0.1250 | 0.6250 | 17.4 |") in lines
    # one tie at 0 leaves three signs free: 4 of 16 patterns; Holm: 0.125 x 5 for the three
    # smallest, max(0.625, 0.25 x 2) for this one
    assert any(x.startswith("| control - hybrid | 4 | -10.0 / -10.0 / -10.0 / +0.0 | -7.5 |")
               and x.endswith("| 0.2500 | 0.6250 | 10.6 |") for x in lines)
    assert "| hybrid | 4 | 0.6 | 0.500 / 0.400 / 0.700 / 0.400 | 0.500 | 0.475 |" in text
    assert "| control | 4 | 1 | 0.400 / 0.300 / 0.600 / 0.400 | 0.425 | 0.425 |" in text
    assert "8/8 | 2.00 |" in text  # replay exact steps; s/step 0.5 + 1.5 (step 0 compiles)
    assert "`tests/experiments/fixtures/mismatch_replication/`" in text


def test_the_script_writes_the_same_bytes_twice(tmp_path):
    a, b = tmp_path / "a.md", tmp_path / "b.md"
    ss.main(["--data", str(FIXTURE), "--out", str(a)])
    ss.main(["--data", str(FIXTURE), "--out", str(b)])
    assert a.read_bytes() == b.read_bytes() and a.read_text() == ss.report(ss.load(FIXTURE),
                                                                          FIXTURE)


def test_a_missing_file_is_named(tmp_path):
    (tmp_path / "seed0").mkdir()
    with pytest.raises(SystemExit, match="need at least 2"):
        ss.load(tmp_path)
    (tmp_path / "seed1").mkdir()
    with pytest.raises(SystemExit, match="missing warm_start_problems.csv.gz"):
        ss.load(tmp_path)


def test_collect_gzips_without_a_time_stamp():
    cr = _module("collect_replication")
    assert cr.gzip_bytes(b"x\n") == cr.gzip_bytes(b"x\n")
    assert cr.gzip_bytes(b"x\n")[4:8] == b"\0\0\0\0"  # mtime field of the gzip header
    rows = [{"id": 7, "by_threshold": {"0.6": {"correct": True, "tokens": 25,
                                               "mean_exit_loop": 2.5, "truncated": False},
                                       "1": {"correct": False, "tokens": 32,
                                             "mean_exit_loop": 4.0, "truncated": True}}}]
    assert cr.outcome_csv(rows) == (f"{cr.HEADER}\n7,0.6,1,25,2.500000,0\n"
                                    f"7,1,0,32,4.000000,1\n")


def _fake_seed(root, after=0.5, steps=300):
    """A seed directory whose evaluations are already there (collect reads them, runs none):
    2 problems; the warm start gets 1 of 2 right at both q, every arm 1 of 2 at both q."""
    by_q = {q: {"correct": True, "tokens": 25, "mean_exit_loop": 3.0, "truncated": False}
            for q in ("0.6", "1")}
    wrong = {q: dict(v, correct=False) for q, v in by_q.items()}
    problems = "".join(json.dumps({"id": i, "by_threshold": by_q if i == 0 else wrong}) + "\n"
                       for i in range(2))
    for name in ("warm_start", "hybrid", "stock", "full_depth", "control"):
        ev = root / "evals" / name
        ev.mkdir(parents=True)
        (ev / "results.json").write_text("{}\n")
        (ev / "problems.jsonl").write_text(problems)
        if name == "warm_start":
            continue
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps({"run": {"seed": 0}}))
        (root / name / "metrics.jsonl").write_text('{"step": 0}\n')
        (root / name / "summary.json").write_text(json.dumps(
            {"grpo_steps": steps, "complete": True, "eval_accuracy_before": 0.5,
             "eval_accuracy_after": after}))


def test_collect_checks_the_runs_and_writes_the_files(tmp_path):
    cr = _module("collect_replication")
    _fake_seed(tmp_path / "seed")
    out = cr.collect(tmp_path / "seed", 0, tmp_path / "data")
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["warm_start_problems.csv.gz"] + [f"{a}_{k}" for a in cr.ARMS for k in
                                          ("problems.csv.gz", "metrics.jsonl.gz", "summary.json")])
    assert gzip.decompress((out / "hybrid_metrics.jsonl.gz").read_bytes()) == b'{"step": 0}\n'
    with pytest.raises(SystemExit, match="not --seed 1"):
        cr.collect(tmp_path / "seed", 1, tmp_path / "data")
    with pytest.raises(SystemExit, match="not --steps 30"):
        cr.collect(tmp_path / "seed", 0, tmp_path / "data", steps=30)


def test_collect_stops_when_a_re_evaluation_is_not_the_run(tmp_path):
    cr = _module("collect_replication")
    _fake_seed(tmp_path / "seed", after=0.25)
    with pytest.raises(SystemExit, match="re-evaluated accuracy at q = 0.6 is 0.5"):
        cr.collect(tmp_path / "seed", 0, tmp_path / "data")
    assert not (tmp_path / "data").exists()  # nothing half-written


def test_the_committed_table_is_made_from_the_committed_data():
    """experiments/figures/mismatch_replication/seed_stats.md is what the script makes of
    experiments/data/mismatch_replication/, byte for byte (the seeds run so far)."""
    assert ss.OUT.is_file() and ss.DATA.is_dir()
    assert ss.OUT.read_text() == ss.report(ss.load(ss.DATA), ss.DATA)
