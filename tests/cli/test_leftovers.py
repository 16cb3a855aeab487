"""Inputs a new user gave that ended in a traceback or left files behind: each is now one clear
line, and the directories involved are as they were (or empty, ready for the same command)."""
import hashlib
import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest

from looprl.cli import main
from looprl.config import apply_overrides, load_experiment, to_json
from looprl.io.checkpoint import save_model_checkpoint
from looprl.model import init_params, preset
from looprl.tokenizer import build_char_tokenizer

ROOT = Path(__file__).resolve().parents[2]
SMOKE = ROOT / "experiments" / "tiny_arith_smoke.py"


def tree_digest(path: Path) -> str:
    """SHA-256 over every file (name and bytes) under `path`."""
    h = hashlib.sha256()
    for p in sorted(path.rglob("*")):
        if p.is_file():
            h.update(p.relative_to(path).as_posix().encode() + p.read_bytes())
    return h.hexdigest()


def one_error_line(capsys, command, match):
    lines = [x for x in capsys.readouterr().err.replace("\r", "\n").splitlines()
             if x.strip() and "%|" not in x]
    assert len(lines) == 1 and lines[0].startswith(f"looprl {command}: error:"), lines
    assert match in lines[0], lines[0]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    cfg = preset("tiny")
    path = tmp_path_factory.mktemp("leftovers") / "ckpt"
    save_model_checkpoint(path, init_params(cfg, 0), cfg, build_char_tokenizer().to_json(),
                          extra_meta={"prompt_style": "compact"})
    return path


def fake_run(tmp_path, n=40):
    d = tmp_path / "myrun"
    d.mkdir()
    rows = [{"step": s, "reward_mean": s / n, "accuracy": s / n, "mean_exit_loop": 2.0,
             "rollout_s": 0.5, "learner_s": 0.4} for s in range(n)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d, rows


def _main_job():
    spec = importlib.util.spec_from_file_location(
        "main_job", ROOT / "reproducibility" / "main_job.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_save_rollout_into_an_existing_directory_is_refused_before_sampling(
        ckpt, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("looprl.cli.generate.generate", lambda *a, **k: pytest.fail("sampled"))
    (tmp_path / "rollouts").mkdir()
    before = tree_digest(tmp_path)
    assert main(["generate", "--checkpoint", str(ckpt), "--prompt", "1+2", "--save-rollout",
                 str(tmp_path / "rollouts")]) == 2
    one_error_line(capsys, "generate", "rollout.npz")
    assert tree_digest(tmp_path) == before and sorted(os.listdir(tmp_path)) == ["rollouts"]


def _unwritable(d: Path) -> bool:
    """Make directory `d` unwritable (chmod; as root, the immutable attribute); True when the
    OS now refuses a new file there."""
    d.chmod(0o555)
    if os.access(d, os.W_OK) and os.geteuid() == 0:
        subprocess.run(["chattr", "+i", str(d)], capture_output=True)
    try:
        (d / "probe").write_text("")
    except OSError:
        return True
    (d / "probe").unlink()
    return False


def test_train_into_an_existing_directory_it_cannot_write_is_one_line(tmp_path, capsys):
    d = tmp_path / "locked"
    d.mkdir()
    try:
        if not _unwritable(d):
            pytest.skip("this user writes into any directory (root without chattr)")
        assert main(["train", str(SMOKE), f"out_dir={d}"]) == 2
        one_error_line(capsys, "train", f"cannot write into directory {str(d)!r}")
    finally:
        subprocess.run(["chattr", "-i", str(d)], capture_output=True)
        d.chmod(0o755)
    assert os.listdir(d) == []


def test_a_failed_start_leaves_no_config_and_the_same_command_runs_again(tmp_path, capsys):
    argv = ["train", str(SMOKE), f"model.checkpoint={tmp_path / 'nope'}",
            f"out_dir={tmp_path / 'run'}", "progress_bar=false", "tensorboard=false"]
    for _ in range(2):  # the second time: the same error, not "out_dir is not empty"
        assert main(argv) == 2
        one_error_line(capsys, "train", "not a looprl checkpoint directory")
        assert not (tmp_path / "run").exists() or os.listdir(tmp_path / "run") == []


@pytest.mark.parametrize("make", ["missing", "empty"])
def test_main_job_run_dir_missing_or_empty_is_one_line(make, tmp_path, capsys):
    d = tmp_path / "run"
    if make == "empty":
        d.mkdir()
    assert _main_job().main(["--run-dir", str(d)]) == 2
    cap = capsys.readouterr()
    lines = cap.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("main_job.py: error: --run-dir") and (
        "no such directory" if make == "missing" else "no warm_start/looprl_meta.json") in lines[0]
    assert cap.out == ""


def test_main_job_names_the_config_keys_of_a_run_of_another_config(tmp_path, capsys):
    d = tmp_path / "run"
    (d / "warm_start").mkdir(parents=True)
    (d / "warm_start" / "looprl_meta.json").write_text(json.dumps({"params_sha256": "x"}))
    (d / "metrics.jsonl").write_text(json.dumps({"params_fingerprint": "y"}) + "\n")
    (d / "summary.json").write_text(json.dumps({"params_sha256": "z", "eval_accuracy_before": 0,
                                                "eval_accuracy_after": 0}))
    other = apply_overrides(load_experiment(ROOT / "experiments" / "tiny_arith.py"),
                            ["seed=7", f"out_dir={d}"])
    (d / "config.json").write_text(to_json(other))
    assert _main_job().main(["--run-dir", str(d)]) == 1
    out = capsys.readouterr().out
    assert "warm start's parameters differ" in out and "run.seed (0 -> 7)" in out
    assert "run.out_dir" not in out


def test_plot_skips_a_last_metrics_line_cut_short_with_a_warning(tmp_path, capsys):
    d, rows = fake_run(tmp_path)
    with open(d / "metrics.jsonl", "a") as f:
        f.write('{"step": 40, "reward_me')
    assert main(["plot", str(d), "--out", str(tmp_path / "plots")]) == 0
    err = capsys.readouterr().err
    assert f"{d / 'metrics.jsonl'}:41: the last line is cut short" in err and "40 rows" in err
    assert (tmp_path / "plots" / "reward.png").read_bytes()[:4] == b"\x89PNG"


def test_plot_a_damaged_line_before_the_last_is_one_line(tmp_path, capsys):
    d, rows = fake_run(tmp_path)
    lines = (d / "metrics.jsonl").read_text().splitlines()
    lines[3] = lines[3][:10]
    (d / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    assert main(["plot", str(d), "--out", str(tmp_path / "plots")]) == 2
    one_error_line(capsys, "plot", f"{d / 'metrics.jsonl'}:4: not JSON")
