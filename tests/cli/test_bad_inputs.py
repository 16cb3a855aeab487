"""What a user hits first (issue 15): bad inputs of every kind are one clear line on stderr, a
non-zero exit status and nothing lost. In-process (`looprl.cli.main`), no training step."""
import hashlib
import json
import shutil
from pathlib import Path

import pytest

from looprl.cli import main
from looprl.io.checkpoint import save_model_checkpoint
from looprl.model import init_params, preset
from looprl.tokenizer import build_char_tokenizer

ROOT = Path(__file__).resolve().parents[2]
SMOKE = ROOT / "experiments" / "tiny_arith_smoke.py"
GSM8K_OK = {"question": "How many?", "answer": "2 + 2 = 4\n#### 4"}


def tree_digest(path: Path) -> str:
    """SHA-256 over every file (name and bytes) under `path`: equal before and after means
    nothing there was lost or changed."""
    h = hashlib.sha256()
    for p in sorted(path.rglob("*")):
        if p.is_file():
            h.update(p.relative_to(path).as_posix().encode() + p.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    cfg = preset("tiny")
    path = tmp_path_factory.mktemp("bad") / "ckpt"
    save_model_checkpoint(path, init_params(cfg, 0), cfg, build_char_tokenizer().to_json(),
                          extra_meta={"prompt_style": "compact"})
    return path


def message_lines(err: str) -> list[str]:
    """stderr without progress-bar frames and blank lines."""
    return [x for x in err.replace("\r", "\n").splitlines() if x.strip() and "%|" not in x]


def one_error_line(capsys, command, match):
    lines = message_lines(capsys.readouterr().err)
    assert len(lines) == 1, lines
    err = lines[0]
    assert err.startswith(f"looprl {command}: error:") and match in err, err
    assert "Traceback" not in err
    return err


# --- config ------------------------------------------------------------------------------------

def _bad_json(tmp):
    (tmp / "config.json").write_text("{not json")
    return [str(tmp / "config.json")]


def _non_empty_out(tmp):
    (tmp / "run").mkdir()
    (tmp / "run" / "keep.txt").write_text("precious")
    return [str(SMOKE), f"out_dir={tmp / 'run'}"]


def _file_as_out(tmp, sub=""):
    (tmp / "afile").write_text("not a directory")
    return [str(SMOKE), f"out_dir={tmp / 'afile' / sub}".rstrip("/")]


CONFIG_CASES = {
    "typo in a key": (lambda t: [str(SMOKE), "lerning_rate=1"],
                      "did you mean ['learning_rate'"),
    "value of the wrong type": (lambda t: [str(SMOKE), "seed=abc"], "run.seed"),
    "missing experiment file": (lambda t: [str(t / "nope.py")], "not found"),
    "not an experiment file": (lambda t: [str(ROOT / "README.md")], "not an experiment file"),
    "config.json that is not JSON": (_bad_json, "not valid JSON"),
    "fresh run into a non-empty out_dir": (_non_empty_out, "is not empty"),
    "out_dir is a file": (_file_as_out, "is a file"),
    "out_dir under a file": (lambda t: _file_as_out(t, "run"), "cannot create"),
}


@pytest.mark.parametrize("case", CONFIG_CASES)
def test_bad_config(case, tmp_path, capsys):
    make, match = CONFIG_CASES[case]
    argv = make(tmp_path)
    before = tree_digest(tmp_path)
    assert main(["train", *argv, f"out_dir={tmp_path / 'run'}"] if "out_dir" not in " ".join(argv)
                else ["train", *argv]) == 2
    err = one_error_line(capsys, "train", match)
    assert len(err) < 400                      # the full key list is behind --list-keys
    assert tree_digest(tmp_path) == before     # no run directory created, nothing touched


def test_list_keys_prints_every_key_with_value_and_type(capsys):
    assert main(["train", str(SMOKE), "seed=3", "--list-keys"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "run.seed = 3  (int)" in lines
    assert any(line.startswith("optim.learning_rate = 0.001") for line in lines)
    assert len(lines) > 50


# --- checkpoint --------------------------------------------------------------------------------

def _damage(c):
    f = max((p for p in (c / "params").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    f.write_bytes(bytes(raw))


def _truncate(c):
    f = max((p for p in (c / "params").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    f.write_bytes(f.read_bytes()[:100])


def _foreign_meta(c):
    (c / "looprl_meta.json").write_text(json.dumps({"format": "something-else"}))


CHECKPOINT_CASES = {
    "no such directory": (lambda c: shutil.rmtree(c), "no such checkpoint directory"),
    "interrupted save (no meta)": (lambda c: (c / "looprl_meta.json").unlink(),
                                   "looprl_meta.json missing"),
    "bytes damaged in place": (_damage, "damaged checkpoint file: SHA-256"),
    "a file cut short": (_truncate, "incomplete looprl checkpoint"),
    "a foreign meta file": (_foreign_meta, "format must be 'looprl-checkpoint'"),
    "a part missing": (lambda c: (c / "tokenizer.json").unlink(), "tokenizer.json missing"),
}


@pytest.mark.parametrize("case", CHECKPOINT_CASES)
def test_bad_checkpoint(case, ckpt, tmp_path, capsys):
    spoil, match = CHECKPOINT_CASES[case]
    c = tmp_path / "c"
    shutil.copytree(ckpt, c)
    spoil(c)
    before = tree_digest(tmp_path)
    assert main(["generate", "--checkpoint", str(c), "--prompt", "1+2", "--json"]) == 2
    assert capsys.readouterr().out == ""       # no output that looks like a result
    # (the error line was printed to stderr; read it again through the eval command)
    assert main(["eval", "--checkpoint", str(c), "--task", "arithmetic", "--out",
                 str(tmp_path / "ev")]) == 2
    one_error_line(capsys, "eval", match)
    assert not (tmp_path / "ev" / "results.json").exists()
    assert tree_digest(tmp_path) == before


# --- data file ---------------------------------------------------------------------------------

DATA_CASES = {
    "no test.jsonl": (None, "no directory with"),
    "a line that is not JSON": ('{"question": "x", "answer": "#### 1"}\n{oops\n', "test.jsonl:2: "
                                                                                  "invalid JSON"),
    "a missing key": (json.dumps({"question": "x"}) + "\n", "test.jsonl:1: missing key 'answer'"),
    "no #### line": (json.dumps({"question": "x", "answer": "4"}) + "\n",
                     "answer has no '#### N' line"),
    "a gold that is not a number": (json.dumps({"question": "x", "answer": "#### four"}) + "\n",
                                    "is not a number"),
    "an empty file": ("", "no records"),
    "invalid UTF-8": (b'{"question": "\xff", "answer": "#### 1"}\n', "invalid UTF-8"),
}


@pytest.mark.parametrize("case", DATA_CASES)
def test_bad_data_file(case, ckpt, tmp_path, capsys):
    content, match = DATA_CASES[case]
    data = tmp_path / "data"
    data.mkdir()
    if content is not None:
        f = data / "test.jsonl"
        f.write_bytes(content if isinstance(content, bytes) else content.encode())
    before = tree_digest(tmp_path)
    assert main(["eval", "--checkpoint", str(ckpt), "--task", "gsm8k", "--data-dir", str(data),
                 "--out", str(tmp_path / "ev")]) == 2
    one_error_line(capsys, "eval", match)
    assert tree_digest(tmp_path) == before and not (tmp_path / "ev").exists()


# --- signal (Ctrl-C outside the GRPO loop; the GRPO loop and a second Ctrl-C are checked with
# real signals in tests/train/test_resume.py) -----------------------------------------------------

def _interrupt(*a, **k):
    raise KeyboardInterrupt


SIGNAL_CASES = {
    "train, in the warm start": (["train", str(SMOKE)], "looprl.train.run.warm_start",
                                 "resume="),
    "train, in the evaluation before GRPO": (["train", str(SMOKE), "warm_start.enabled=false"],
                                             "looprl.train.console.evaluate", "resume="),
    "generate, while sampling": (["generate", "--prompt", "1+2"],
                                 "looprl.cli.generate.generate", "looprl generate: interrupted"),
    "eval, while sampling": (["eval", "--task", "arithmetic", "--limit", "2",
                              "--max-new-tokens", "8"],
                             "looprl.rl.evaluation.generate", "looprl eval: interrupted"),
    "convert, while writing": (["convert", "--to-hf", "HF"], "looprl.io.convert.save_hf",
                               "looprl convert: interrupted"),
}


@pytest.mark.parametrize("case", SIGNAL_CASES)
def test_ctrl_c_is_one_line_and_exit_130(case, ckpt, tmp_path, capsys, monkeypatch):
    argv, where, match = SIGNAL_CASES[case]
    monkeypatch.setattr(where, _interrupt)
    argv = [a.replace("HF", str(tmp_path / "hf")) for a in argv]
    if argv[0] == "train":
        argv += ["progress_bar=false", "tensorboard=false", f"out_dir={tmp_path / 'run'}"]
    elif argv[0] == "eval":
        argv += ["--checkpoint", str(ckpt), "--out", str(tmp_path / "ev")]
    else:
        argv += ["--checkpoint", str(ckpt)]
    assert main(argv) == 130
    cap = capsys.readouterr()
    lines = message_lines(cap.err)
    assert len(lines) == 1 and match in lines[0] and "Traceback" not in cap.err, lines
    if argv[0] == "train":   # the run directory can be resumed (the start runs again)
        assert (tmp_path / "run" / "config.json").is_file()
        assert not (tmp_path / "run" / "checkpoints").exists()
    assert not (tmp_path / "hf").exists() and not (tmp_path / "ev" / "results.json").exists()


# --- command-line arguments --------------------------------------------------------------------

ARG_CASES = {
    "threshold above 1": (["generate", "--prompt", "1", "--exit-threshold", "1.5"],
                          "--exit-threshold must lie in"),
    "fixed depth with a threshold": (["generate", "--prompt", "1", "--fixed-depth", "2",
                                      "--exit-threshold", "0.5"], "both given"),
    "negative temperature": (["generate", "--prompt", "1", "--temperature", "-1"],
                             "temperature"),
    "eval limit 0": (["eval", "--task", "arithmetic", "--limit", "0", "--out", "EV"],
                     "--limit: expected a positive int"),
    "unknown eval task": (["eval", "--task", "nosuch", "--out", "EV"], "--task: expected one of"),
    "data dir for a task without data files": (
        ["eval", "--task", "arithmetic", "--data-dir", "x", "--out", "EV"],
        "only the gsm8k and math tasks"),
    "config with a rollout": (["verify", "--rollout", "r.npz", "--config", str(SMOKE), "--out",
                               "EV"], "--config has no effect with --rollout"),
    "verify without --out": (["verify", "--quick"], "--out DIR is required"),
    "the device check on a CPU": (["verify", "--device", "EV"], "no GPU or TPU here"),
    "the device check without OUT": (["verify", "--device"], "name OUT"),
    "an unknown device group": (["verify", "--device", "EV", "--dry-run", "--groups", "nope"],
                                "--groups: unknown ['nope']"),
}


@pytest.mark.parametrize("case", ARG_CASES)
def test_bad_arguments(case, ckpt, tmp_path, capsys):
    argv, match = ARG_CASES[case]
    argv = [a.replace("EV", str(tmp_path / "ev")) for a in argv]
    if argv[0] != "verify":
        argv += ["--checkpoint", str(ckpt)]
    before = tree_digest(ckpt)
    assert main(argv) == 2
    one_error_line(capsys, argv[0], match)
    assert tree_digest(ckpt) == before and not (tmp_path / "ev" / "results.json").exists()


def test_train_without_arguments_prints_usage_naming_config(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: looprl train") and "CONFIG is required" in err
    assert "KEY=VALUE" not in err.splitlines()[-1]


def test_train_parser_keeps_its_multi_host_flags():
    """The CONFIG/--list-keys change must not drop the flags after it (a misplaced return did)."""
    from looprl.cli.main import build_parser
    args = build_parser().parse_args(["train", "--coordinator", "h:1", "--num-processes", "2",
                                      "--process-id", "1", "--distributed", str(SMOKE), "seed=1"])
    assert (args.coordinator, args.num_processes, args.process_id, args.distributed) == (
        "h:1", 2, 1, True)
    assert args.config == str(SMOKE) and args.overrides == ["seed=1"]
