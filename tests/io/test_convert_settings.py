"""A converted checkpoint answers as the original: the prompt style, stop ids, task and the
evaluation's settings (exit threshold, KV policy, ...) travel through `looprl convert` both
ways, so `generate` prints the same completion, exit loops and log-probs from the original,
the HF directory and the checkpoint converted back, and `eval` needs no `--task`."""
import json
from pathlib import Path

import pytest

from looprl.cli import main
from looprl.config import apply_overrides, load_experiment
from looprl.io.checkpoint import read_checkpoint_meta, save_model_checkpoint
from looprl.model import init_params, preset
from looprl.tokenizer import build_char_tokenizer, coverage_note
from looprl.train.setup import build_tasks, checkpoint_task_meta

ROOT = Path(__file__).resolve().parents[2]
SMOKE = ROOT / "experiments" / "tiny_arith_smoke.py"


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(original, HF directory, converted back, the original's usage meta)."""
    tmp = tmp_path_factory.mktemp("convert_settings")
    exp = apply_overrides(load_experiment(SMOKE), ["rollout.exit_threshold=0.5",
                                                   "rollout.kv_policy=deferred"])
    task, _ = build_tasks(exp)
    meta = checkpoint_task_meta(exp, task, 4)
    cfg = preset("tiny")
    save_model_checkpoint(tmp / "orig", init_params(cfg, 3), cfg,
                          build_char_tokenizer().to_json(), extra_meta=meta)
    assert main(["convert", "--checkpoint", str(tmp / "orig"), "--to-hf", str(tmp / "hf")]) == 0
    assert main(["convert", "--hf", str(tmp / "hf"), "--out", str(tmp / "back")]) == 0
    return tmp / "orig", tmp / "hf", tmp / "back", meta


def _generate(ckpt, capsys) -> dict:
    assert main(["generate", "--checkpoint", str(ckpt), "--prompt", "3+4+5",
                 "--max-new-tokens", "12", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    out.pop("timings")
    for s in out["samples"]:
        s.pop("timings", None)
    return out


def test_the_settings_travel_both_ways(converted):
    orig, hf, back, meta = converted
    kept = json.loads((hf / "config.json").read_text())["looprl"]
    assert kept["prompt_style"] == "compact" and kept["eval"]["exit_threshold"] == 0.5
    assert kept["eval"]["kv_policy"] == "deferred" and kept["task"]["name"] == "arithmetic"
    back_meta = read_checkpoint_meta(back)
    for key in ("prompt_style", "stop_ids", "task", "eval"):
        assert back_meta[key] == meta[key], key


def test_generate_answers_the_same_from_the_converted_checkpoints(converted, capsys):
    orig, hf, back, _ = converted
    want = _generate(orig, capsys)
    assert want["settings"]["exit_threshold"] == 0.5 and want["settings"]["kv_policy"] == "deferred"
    assert _generate(hf, capsys) == want
    assert _generate(back, capsys) == want


def test_eval_of_a_converted_checkpoint_needs_no_task(converted, tmp_path, capsys):
    _, _, back, _ = converted
    assert main(["eval", "--checkpoint", str(back), "--limit", "2", "--max-new-tokens", "4",
                 "--out", str(tmp_path / "ev"), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["task"] == "arithmetic" and res["settings"]["kv_policy"] == "deferred"
    assert [t["exit_threshold"] for t in res["thresholds"]] == [0.5]


def test_the_tiny_tokenizer_note_explains_the_unused_ids():
    note = coverage_note(build_char_tokenizer().to_json(), preset("tiny").vocab_size)
    assert note.startswith("the tokenizer covers 58 ids, the model's vocabulary has 64: ids "
                           "58..63 cannot be decoded (embedding rows no token uses")
