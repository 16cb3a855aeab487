"""`looprl generate` and `looprl eval` on a run's own checkpoint (issue 15): the checkpoint
records the task config, prompt style, stop ids and evaluation settings, and both commands
default to them. One shrunk smoke run (2 GRPO steps) is trained in this process."""
import json
import shutil
from pathlib import Path

import pytest

from looprl.cli import main
from looprl.io.checkpoint import read_checkpoint_meta

ROOT = Path(__file__).resolve().parents[2]
SMOKE = ROOT / "experiments" / "tiny_arith_smoke.py"
SHRINK = ["warm_start.max_steps=40", "warm_start.eval_every_steps=20", "eval.eval_problems=16",
          "warm_start.eval_problems=16", "progress_bar=false", "tensorboard=false",
          "grpo_steps=2"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "r"
    assert main(["train", str(SMOKE), *SHRINK, f"out_dir={out}"]) == 0
    return out


def test_run_checkpoints_record_task_prompt_style_stop_ids_and_eval_settings(run):
    for name in ("warm_start", "checkpoint", "checkpoints/step_00000002"):
        meta = read_checkpoint_meta(run / name)
        assert meta["prompt_style"] == "compact" and meta["stop_ids"] == [2]
        assert meta["task"]["name"] == "arithmetic"
        assert meta["task"]["config"]["eval_terms"] == [3, 3]
        assert meta["eval"]["problems"] == 16 and meta["eval"]["exit_threshold"] == 0.6
        assert meta["eval"]["kv_policy"] == "deferred" and meta["eval"]["max_new_tokens"] == 5


def test_generate_on_the_runs_checkpoint_uses_its_prompt_style(run, tmp_path, capsys):
    """It printed an empty completion: the prompt was framed as ChatML, which the tiny model
    answers with an immediate end of turn. (The warm-started checkpoint: its greedy answer does
    not depend on the sampled GRPO steps, whose noise keying may change.)"""
    assert main(["generate", "--checkpoint", str(run / "warm_start"), "--prompt", "5-7+3+1",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["completion"].startswith("=") and len(out["completion"]) >= 2
    assert out["tokens"][-1] == 2          # stopped at the recorded stop id
    old = tmp_path / "old"                 # as written before the style was recorded
    shutil.copytree(run / "checkpoint", old)
    meta = json.loads((old / "looprl_meta.json").read_text())
    for k in ("prompt_style", "stop_ids", "task", "eval"):
        del meta[k]
    (old / "looprl_meta.json").write_text(json.dumps(meta))
    assert main(["generate", "--checkpoint", str(old), "--prompt", "5-7+3+1", "--json"]) == 0
    cap = capsys.readouterr()
    assert "records no prompt style" in cap.err and "framing the prompt as ChatML" in cap.err


def test_eval_arithmetic_reproduces_the_runs_eval_after(run, tmp_path, capsys):
    summary = json.loads((run / "summary.json").read_text())
    assert main(["eval", "--checkpoint", str(run / "checkpoint"), "--task", "arithmetic",
                 "--out", str(tmp_path / "ev")]) == 0
    res = json.loads((tmp_path / "ev" / "results.json").read_text())
    (row,) = res["thresholds"]
    assert row["exit_threshold"] == 0.6 and row["problems"] == summary["eval_problems"] == 16
    assert row["pass_at_1"] == summary["eval_accuracy_after"]
    assert row["mean_exit_loop"] == summary["eval_after"]["mean_exit_loop"]  # exact, all tokens
    assert res["settings"]["task_config"]["prompt_style"] == "compact"
    # the task is the recorded one by default, too
    assert main(["eval", "--checkpoint", str(run / "warm_start"), "--out",
                 str(tmp_path / "ev0")]) == 0
    res0 = json.loads((tmp_path / "ev0" / "results.json").read_text())
    assert res0["task"] == "arithmetic"
    assert res0["thresholds"][0]["pass_at_1"] == summary["eval_accuracy_before"]
    assert res0["thresholds"][0]["mean_exit_loop"] == summary["eval_before"]["mean_exit_loop"]


@pytest.mark.parametrize("command", [["generate", "--prompt", "1+2"],
                                     ["eval", "--out", "EVAL_OUT"],
                                     ["convert", "--to-hf", "HF_OUT"]])
def test_a_run_directory_given_as_checkpoint_names_its_checkpoint(run, tmp_path, capsys,
                                                                  command):
    """The run directory's config.json is the experiment's: it was read as a model's
    ("model_type must be 'ouro'"; `eval` first asked for --task)."""
    argv = [a.replace("EVAL_OUT", str(tmp_path / "ev")).replace("HF_OUT", str(tmp_path / "hf"))
            for a in command]
    assert main([argv[0], "--checkpoint", str(run), *argv[1:]]) == 2
    err = capsys.readouterr().err
    assert f"{run} is a run directory; its checkpoint is {run / 'checkpoint'}" in err


def test_generate_on_a_runs_checkpoint_takes_its_evaluation_settings(run, capsys):
    assert main(["generate", "--checkpoint", str(run / "checkpoint"), "--prompt", "5-7+3+1",
                 "--json"]) == 0
    settings = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["settings"]
    rec = read_checkpoint_meta(run / "checkpoint")["eval"]
    assert settings == {"exit_threshold": rec["exit_threshold"], "fixed_depth": None,
                        "kv_policy": rec["kv_policy"], "dtype": rec["compute_dtype"],
                        "kernels": rec["kernels"]}
    assert settings["exit_threshold"] == 0.6 and settings["kv_policy"] == "deferred"
