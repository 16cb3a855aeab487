"""`looprl eval` on a tiny Ouro checkpoint (byte-level BPE tokenizer, converted from HF format) and
the real GSM8K test file: per-threshold pass@1 and exit depth, per-problem records, bad input."""
import json

import numpy as np
import pytest
from tiny_ouro import tiny_looprl_checkpoint

from looprl.cli import main
from looprl.errors import ConfigError
from looprl.cli.eval import parse_thresholds, summarize
from looprl.tasks.grading import extract_answer, grade_answer
from looprl.tasks.gsm8k import REPO_ROOT

TEST_FILE = REPO_ROOT / ".." / "shared" / "data" / "gsm8k" / "test.jsonl"
needs_data = pytest.mark.skipif(not TEST_FILE.is_file(),
                                reason=f"GSM8K test file not found at {TEST_FILE}: the data is "
                                "not in the repository (docs/GUIDE.md, 'Install')")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_looprl_checkpoint(tmp_path_factory.mktemp("eval"))


def eval_args(ckpt, out, *extra):
    return ["eval", "--checkpoint", str(ckpt), "--task", "gsm8k", "--out", str(out), *extra]


@needs_data
def test_eval_two_thresholds_writes_results_problems_and_plot(tiny, tmp_path, capsys):
    ckpt, _ = tiny
    out = tmp_path / "ev"
    rc = main(eval_args(ckpt, out, "--limit", "2", "--max-new-tokens", "6", "--batch-size", "2",
                        "--exit-threshold", "0.5,1.0", "--kv-policy", "deferred"))
    assert rc == 0
    printed = capsys.readouterr()
    assert "pass@1" in printed.out and "eval q=0.5" in printed.err  # table; progress bar on stderr
    res = json.loads((out / "results.json").read_text())
    by_q = {s["exit_threshold"]: s for s in res["thresholds"]}
    assert sorted(by_q) == [0.5, 1.0] and res["settings"]["problems"] == 2
    # the tiny model's gate gives lambda ~ 0.6 at every loop: CDF(1) >= 0.5, so q = 0.5 exits at
    # loop 1; q = 1.0 always runs all T = 4 loops
    assert by_q[0.5]["mean_exit_loop"] == 1.0 and by_q[1.0]["mean_exit_loop"] == 4.0
    rows = [json.loads(line) for line in (out / "problems.jsonl").read_text().splitlines()]
    test_lines = TEST_FILE.read_text().splitlines()
    assert [r["id"] for r in rows] == [0, 1]
    assert [r["gold"] for r in rows] == ["18", "3"]  # test.jsonl records 0, 1: `#### 18`, `#### 3`
    assert rows[1]["question"] == json.loads(test_lines[1])["question"].strip()
    for q, s in by_q.items():
        per = [r["by_threshold"][f"{q:g}"] for r in rows]
        assert s["pass_at_1"] == np.mean([p["correct"] for p in per])
        assert s["tokens"] == sum(p["tokens"] for p in per) == 12  # 6 new tokens each, no stop
        for r, p in zip(rows, per):
            assert p["extracted"] == extract_answer(p["completion"])
            assert p["correct"] == (grade_answer(p["completion"], r["gold"]) == 1.0)
    assert (out / "accuracy_vs_depth.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow  # 28 s; tests/sampling/test_needle.py
@needs_data
def test_eval_completion_does_not_depend_on_the_batch(tiny, tmp_path):
    """Problem 1's greedy completion is the same alone (batch 1) and batched with problem 0 (the
    sampler's row-invariant kernels; XLA CPU)."""
    ckpt, _ = tiny
    common = ["--max-new-tokens", "5", "--exit-threshold", "0.9"]
    assert main(eval_args(ckpt, tmp_path / "b2", "--limit", "2", "--batch-size", "2", *common)) == 0
    assert main(eval_args(ckpt, tmp_path / "b1", "--limit", "2", "--batch-size", "1", *common)) == 0
    rows = {b: [json.loads(line)["by_threshold"]["0.9"] for line in
                (tmp_path / b / "problems.jsonl").read_text().splitlines()] for b in ("b1", "b2")}
    assert rows["b1"] == rows["b2"]
    assert not (tmp_path / "b1" / "accuracy_vs_depth.png").exists()  # one threshold: no plot


def test_summarize_hand_computed():
    rows = [{"correct": True, "exit_loops": [4, 4], "truncated": False, "kv_cache_bytes": 7},
            {"correct": False, "exit_loops": [1], "truncated": True, "kv_cache_bytes": 9},
            {"correct": True, "exit_loops": [2, 2, 2], "truncated": False, "kv_cache_bytes": 7}]
    s = summarize(0.7, rows, wall_s=1.0)
    assert s["pass_at_1"] == 2 / 3 and s["correct"] == 2 and s["problems"] == 3
    assert s["mean_exit_loop"] == 15 / 6 and s["tokens"] == 6 and s["truncated"] == 1
    assert s["kv_cache_bytes"] == 9  # the largest batch's


def test_parse_thresholds():
    assert parse_thresholds("0.5, 0.9,1") == [0.5, 0.9, 1.0]
    for bad in ("0", "1.5", "-0.1", "0.5,x", "0.9,0.9", ""):
        with pytest.raises(ConfigError, match="exit-threshold"):
            parse_thresholds(bad)


@pytest.mark.parametrize("extra, match", [
    (["--exit-threshold", "1.5"], "exit-threshold"),
    (["--exit-threshold", "0"], "exit-threshold"),
    (["--limit", "0"], "--limit"),
    (["--batch-size", "0"], "--batch-size"),
    (["--task", "nosuch"], "--task"),
])
def test_eval_bad_arguments_are_clear_errors(tiny, tmp_path, capsys, extra, match):
    ckpt, _ = tiny
    args = eval_args(ckpt, tmp_path / "ev")
    if "--task" in extra:
        args[args.index("--task") + 1] = extra[1]
    else:
        args += extra
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("looprl eval: error:") and match in err
    assert not (tmp_path / "ev" / "results.json").exists()


def test_eval_missing_checkpoint_names_the_path(tmp_path, capsys):
    assert main(eval_args(tmp_path / "nope", tmp_path / "ev", "--limit", "1")) == 2
    assert "nope" in capsys.readouterr().err


@needs_data
def test_eval_checkpoint_without_tokenizer_is_refused(tmp_path, capsys):
    from looprl.model import init_params, preset
    from looprl.io.checkpoint import save_model_checkpoint

    cfg = preset("tiny")
    save_model_checkpoint(tmp_path / "ckpt", init_params(cfg, 0), cfg, None)
    assert main(eval_args(tmp_path / "ckpt", tmp_path / "ev", "--limit", "1")) == 2
    assert "no tokenizer.json" in capsys.readouterr().err


def test_eval_refuses_to_overwrite_results(tiny, tmp_path, capsys):
    ckpt, _ = tiny
    (tmp_path / "ev").mkdir()
    (tmp_path / "ev" / "results.json").write_text("{}")
    assert main(eval_args(ckpt, tmp_path / "ev", "--limit", "1")) == 2
    assert "already holds results.json" in capsys.readouterr().err


def test_eval_needs_only_test_jsonl_and_records_the_resolved_data_dir(tiny, tmp_path, capsys,
                                                                      monkeypatch):
    ckpt, _ = tiny
    data = tmp_path / "data"
    data.mkdir()  # no train.jsonl
    (data / "test.jsonl").write_text(json.dumps({"question": "What is 2 + 3?",
                                                 "answer": "2+3=5\n#### 5"}) + "\n")
    monkeypatch.chdir(tmp_path)
    rc = main(eval_args(ckpt, tmp_path / "ev", "--data-dir", "data", "--max-new-tokens", "2"))
    assert rc == 0, capsys.readouterr().err
    res = json.loads((tmp_path / "ev" / "results.json").read_text())
    assert res["settings"]["data_dir"] == str(data.resolve())
    assert res["settings"]["task_config"]["data_dir"] == "data"  # as typed
    assert res["settings"]["problems"] == 1
    problems = (tmp_path / "ev" / "problems.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in problems]
    assert [(r["id"], r["gold"], r["question"]) for r in rows] == [(0, "5", "What is 2 + 3?")]


@pytest.mark.parametrize("where", ["file", "under_file"])
def test_eval_out_that_is_a_file_is_a_clear_error(tiny, tmp_path, capsys, where):
    ckpt, _ = tiny
    (tmp_path / "f").write_text("not a directory")
    out = tmp_path / "f" if where == "file" else tmp_path / "f" / "ev"
    assert main(eval_args(ckpt, out, "--limit", "1")) == 2
    err = capsys.readouterr().err
    assert err.startswith("looprl eval: error: --out:") and "is a file" in err and str(out) in err
    assert (tmp_path / "f").read_text() == "not a directory"
