"""Messages that misled a new user: each now names the user's flag or file and what to do; a
stopped run's output ends with the line that continues it; the first kernel build says so."""
import json
import subprocess
from pathlib import Path

import pytest

from looprl.cli import main
from looprl.errors import ConfigError
from looprl.io.checkpoint import save_model_checkpoint
from looprl.kernels.cpu import ffi as ordered_gemm
from looprl.model import init_params, preset
from looprl.tasks.gsm8k import REPO_ROOT, resolve_data_dir
from looprl.tokenizer import build_char_tokenizer


def error_line(capsys, command) -> str:
    lines = [x for x in capsys.readouterr().err.replace("\r", "\n").splitlines()
             if x.strip() and "%|" not in x]
    assert len(lines) == 1 and lines[0].startswith(f"looprl {command}: error:"), lines
    return lines[0]


@pytest.fixture(scope="module")
def short_ckpt(tmp_path_factory):
    """The tiny model with 64 positions, recording the arithmetic task."""
    cfg = preset("tiny", max_position_embeddings=64)
    path = tmp_path_factory.mktemp("messages") / "ckpt"
    save_model_checkpoint(path, init_params(cfg, 0), cfg, build_char_tokenizer().to_json(),
                          extra_meta={"prompt_style": "compact",
                                      "task": {"name": "arithmetic", "config": {}}})
    return path


def test_eval_on_a_file_says_it_is_no_checkpoint(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("hello")
    assert main(["eval", "--checkpoint", str(tmp_path / "notes.txt"), "--out",
                 str(tmp_path / "ev")]) == 2
    err = error_line(capsys, "eval")
    assert "notes.txt: not a checkpoint directory" in err and "records no task" not in err


def test_eval_checks_the_prompt_length_like_generate(short_ckpt, tmp_path, capsys):
    assert main(["eval", "--checkpoint", str(short_ckpt), "--task", "arithmetic", "--limit", "2",
                 "--max-new-tokens", "60", "--out", str(tmp_path / "ev")]) == 2
    err = error_line(capsys, "eval")
    assert "--max-new-tokens is 60" in err and "more than the 64" in err
    assert not (tmp_path / "ev").exists()


@pytest.mark.parametrize("make, match", [
    (lambda d: d / "nope.npz", "nope.npz: no such rollout file"),
    (lambda d: (d / "notes.txt").write_text("hi") and d / "notes.txt",
     "notes.txt: not a looprl rollout file"),
])
def test_verify_rollout_of_a_missing_or_text_file(make, match, tmp_path, capsys):
    path = make(tmp_path)
    assert main(["verify", "--rollout", str(path), "--out", str(tmp_path / "rep")]) == 2
    err = error_line(capsys, "verify")
    assert match in err and "pickle" not in err and "corrupt" not in err


def test_gsm8k_without_data_lists_each_path_once_and_says_how_to_link(monkeypatch):
    monkeypatch.chdir(REPO_ROOT)
    with pytest.raises(ConfigError) as e:
        resolve_data_dir("no/such/gsm8k", ["test.jsonl"])
    msg = str(e.value)
    assert msg.count(str(REPO_ROOT / "no" / "such" / "gsm8k")) == 2  # the list, the ln -s hint
    assert "ln -s DIR" in msg and "--data-dir" in msg


@pytest.mark.parametrize("flags, match", [
    (["--exit-threshold", "1.5", "--max-new-tokens", "8"],
     "--exit-threshold must lie in (0, 1], got 1.5"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
    (["--top-p", "2", "--max-new-tokens", "8"], "--top-p must lie in (0, 1], got 2.0"),
])
def test_generate_names_its_flags_not_internal_fields(flags, match, short_ckpt, capsys):
    assert main(["generate", "--checkpoint", str(short_ckpt), "--prompt", "1+2", *flags]) == 2
    assert match in error_line(capsys, "generate")


def test_a_stopped_run_ends_with_its_resume_line(monkeypatch, tmp_path, capsys):
    line = "stopped after GRPO step 2 of 5 (stop_after); continue with: looprl train X resume=X"
    summary = {"stopped": line, "complete": False, "eval_accuracy_before": 0.1,
               "eval_accuracy_after": 0.2, "eval_problems": 4, "grpo_steps": 2,
               "replay_exact_steps": 2, "wall_s": 1.0, "params_sha256": "ab"}
    monkeypatch.setattr("looprl.cli.train.train", lambda cfg, **k: summary)
    monkeypatch.setattr("looprl.cli.train.HEADLINE_KEYS", ("grpo_steps", "params_sha256"))
    smoke = REPO_ROOT / "experiments" / "tiny_arith_smoke.py"
    assert main(["train", str(smoke), f"out_dir={tmp_path / 'run'}", "stop_after=2"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == line and json.loads(out[-2]) == {"grpo_steps": 2, "params_sha256": "ab"}
    assert len(out) == 2  # no summary table: it reads as a finished run


def test_the_first_kernel_build_says_it_compiles(monkeypatch, tmp_path, capsys):
    real = subprocess.run

    def fake_compiler(cmd, **kw):
        if "--version" in cmd:
            return real(cmd, **kw)
        Path(cmd[-1]).write_bytes(b"")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setenv("LOOPRL_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(ordered_gemm.subprocess, "run", fake_compiler)
    lib = ordered_gemm.build()
    err = capsys.readouterr().err
    assert err.startswith("looprl: compiling looprl's CPU kernels (first run, about ")
    assert str(tmp_path / "cache") in err and lib.is_file()
    assert ordered_gemm.build() == lib and capsys.readouterr().err == ""  # cached: silent
