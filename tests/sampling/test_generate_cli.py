"""`looprl generate` on a tiny checkpoint: prints the completion with one exit loop per token."""
import json

import pytest

from looprl.cli import main
from looprl.model import init_params, preset
from looprl.tokenizer import build_char_tokenizer
from looprl.train.checkpoint import save_model_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    cfg = preset("tiny")
    path = tmp_path_factory.mktemp("gen") / "ckpt"
    save_model_checkpoint(path, init_params(cfg, 0), cfg, build_char_tokenizer().to_json())
    return path


def test_generate_json_reports_one_exit_loop_per_token(ckpt, capsys):
    rc = main(["generate", "--checkpoint", str(ckpt), "--prompt", "1 + 2", "--prompt-style",
               "compact", "--max-new-tokens", "6", "--exit-threshold", "0.5", "--kv-policy",
               "deferred", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert 1 <= len(out["tokens"]) <= 6
    assert len(out["exit_loops"]) == len(out["tokens"])
    assert all(1 <= k <= 4 for k in out["exit_loops"])
    assert all(lp <= 0.0 for lp in out["logprobs"])


def test_generate_bad_threshold_is_a_clear_error(ckpt, capsys):
    rc = main(["generate", "--checkpoint", str(ckpt), "--prompt", "1", "--exit-threshold", "1.5"])
    assert rc == 2
    assert "exit_threshold" in capsys.readouterr().err


def test_generate_missing_checkpoint_names_the_path(tmp_path, capsys):
    rc = main(["generate", "--checkpoint", str(tmp_path / "nope"), "--prompt", "1"])
    assert rc == 2
    assert "nope" in capsys.readouterr().err
