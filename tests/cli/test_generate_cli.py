"""`looprl generate` on a tiny checkpoint: prints the completion with one exit loop per token."""
import json

import pytest

from looprl.cli import main
from looprl.model import init_params, preset
from looprl.tokenizer import build_char_tokenizer
from looprl.io.checkpoint import save_model_checkpoint


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
    assert "--exit-threshold must lie in (0, 1]" in capsys.readouterr().err


def test_generate_missing_checkpoint_names_the_path(tmp_path, capsys):
    rc = main(["generate", "--checkpoint", str(tmp_path / "nope"), "--prompt", "1"])
    assert rc == 2
    assert "nope" in capsys.readouterr().err


def _gen(ckpt, *extra):
    return main(["generate", "--checkpoint", str(ckpt), "--prompt", "1 + 2", "--prompt-style",
                 "compact", "--max-new-tokens", "3", *extra])


def test_generate_json_also_saves_the_rollout(ckpt, tmp_path, capsys):
    from looprl.sampling.schedule import RolloutBatch
    path = tmp_path / "r.npz"
    assert _gen(ckpt, "--json", "--save-rollout", str(path)) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["rollout_file"] == str(path)
    rb = RolloutBatch.load(path)
    assert rb.schedule.batch_size == 1


def test_generate_save_rollout_into_missing_dir_fails_before_sampling(ckpt, tmp_path, capsys,
                                                                      monkeypatch):
    import looprl.sampling.sampler as sampler

    def boom(*a, **k):
        raise AssertionError("sampled before checking --save-rollout")
    monkeypatch.setattr(sampler, "generate", boom)
    rc = _gen(ckpt, "--save-rollout", str(tmp_path / "missing" / "x.npz"))
    assert rc == 2
    err = capsys.readouterr().err
    assert "--save-rollout" in err and "missing" in err and "does not exist" in err


@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_generate_rejects_non_finite_or_negative_temperature(ckpt, capsys, value):
    assert _gen(ckpt, "--temperature", value) == 2
    assert "temperature" in capsys.readouterr().err


def test_sampling_config_rejects_non_finite_temperature():
    from looprl.errors import SamplingError
    from looprl.sampling.sampler import SamplingConfig
    for t in (float("nan"), float("inf")):
        with pytest.raises(SamplingError, match="temperature"):
            SamplingConfig(temperature=t).validate(4)


def test_generate_fixed_depth_with_exit_threshold_is_an_error(ckpt, capsys):
    assert _gen(ckpt, "--fixed-depth", "2", "--exit-threshold", "0.5") == 2
    err = capsys.readouterr().err
    assert "--fixed-depth" in err and "--exit-threshold" in err


def test_generate_fixed_depth_alone_exits_at_that_depth(ckpt, capsys):
    assert _gen(ckpt, "--fixed-depth", "2", "--json") == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(out["exit_loops"]) == {2}


def test_generate_on_bytes_damaged_in_place_fails_naming_the_file(ckpt, tmp_path, capsys):
    """Issue 15: flipped bytes (same size) made generate print 64 tokens of id 0 with NaN
    log-probs and exit 0."""
    import shutil
    damaged = tmp_path / "damaged"
    shutil.copytree(ckpt, damaged)
    f = max((p for p in (damaged / "params").rglob("*") if p.is_file()),
            key=lambda p: p.stat().st_size)
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2:len(raw) // 2 + 64] = bytes(64)
    f.write_bytes(bytes(raw))
    assert main(["generate", "--checkpoint", str(damaged), "--prompt", "1", "--json"]) == 2
    cap = capsys.readouterr()
    assert cap.out == ""
    assert f"{f}: damaged checkpoint file: SHA-256" in cap.err and len(cap.err.splitlines()) == 1


def test_generate_with_non_finite_weights_is_an_error_naming_the_token(tmp_path, capsys):
    import numpy as np
    cfg = preset("tiny")
    params = init_params(cfg, 0)
    params["lm_head"] = np.full_like(np.asarray(params["lm_head"]), np.nan)
    path = tmp_path / "nan"
    save_model_checkpoint(path, params, cfg, build_char_tokenizer().to_json())  # digests match
    assert main(["generate", "--checkpoint", str(path), "--prompt", "1", "--prompt-style",
                 "compact", "--max-new-tokens", "3", "--json"]) == 2
    cap = capsys.readouterr()
    assert cap.out == ""
    assert "completion token 0 (id " in cap.err and "log-prob nan" in cap.err


def test_generate_prints_its_timings_on_stderr_and_in_json(ckpt, capsys):
    """Issue 19: prefill seconds and decode tokens/s, on stderr and under --json "timings"."""
    import re
    assert _gen(ckpt, "--json") == 0
    cap = capsys.readouterr()
    t = json.loads(cap.out.strip().splitlines()[-1])["timings"]
    n = len(json.loads(cap.out.strip().splitlines()[-1])["tokens"])
    assert t["prefill_s"] > 0 and t["decode_s"] >= 0
    if n > 1:
        assert t["decode_tokens_per_s"] == (n - 1) / t["decode_s"]
    m = re.search(r"# prefill ([0-9.]+) s \((\d+) prompt tokens, 1 rows\), decode ([0-9.]+) "
                  r"s, ([0-9.]+) tokens/s per row; KV cache ([0-9.]+) MB", cap.err)
    assert m and float(m.group(4)) == round(t["decode_tokens_per_s"], 2)
    assert t["kv_cache_bytes"] > 0 and float(m.group(5)) == round(t["kv_cache_bytes"] / 1e6, 1)


def test_generation_timings_without_decode_steps_is_zero_rate():
    from looprl.cli.generate import generation_timings
    assert generation_timings({"prefill_s": 0.5}, 1) == {"prefill_s": 0.5, "decode_s": 0.0,
                                                         "decode_tokens_per_s": 0.0,
                                                         "kv_cache_bytes": 0}
    assert generation_timings({"prefill_s": 0.5, "decode_s": 2.0}, 5)["decode_tokens_per_s"] == 2.0


def test_num_samples_writes_a_rollout_that_verify_accepts(tmp_path, capsys):
    """Issue 14: `generate --num-samples 3` samples 3 completions in one batch; with q < 1,
    --ignore-eos and 3 x 171 >= 512 new tokens its rollout meets `verify --rollout`'s
    requirements, and every replay cell is exact."""
    cfg = preset("tiny", num_layers=1)
    ck = tmp_path / "ck"
    save_model_checkpoint(ck, init_params(cfg, 0), cfg, build_char_tokenizer().to_json())
    rollout = tmp_path / "r.npz"
    assert main(["generate", "--checkpoint", str(ck), "--prompt", "1+2", "--prompt-style",
                 "compact", "--num-samples", "3", "--max-new-tokens", "171", "--temperature",
                 "1.0", "--exit-threshold", "0.6", "--ignore-eos", "--save-rollout",
                 str(rollout), "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(out["samples"]) == 3 and all(len(s["tokens"]) == 171 for s in out["samples"])
    assert out["tokens"] == out["samples"][0]["tokens"]
    assert out["samples"][0]["tokens"] != out["samples"][1]["tokens"]  # 3 different draws
    assert main(["verify", "--rollout", str(rollout), "--checkpoint", str(ck), "--out",
                 str(tmp_path / "rep")]) == 0
    report = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert report["summary"]["requirements_met"] and report["summary"]["passed"]
    assert {c["rollout_rows"] for c in report["cells"]} == {3}


def test_a_prompt_beyond_the_models_positions_is_an_error_naming_the_counts(tmp_path, capsys):
    cfg = preset("tiny", max_position_embeddings=32)
    path = tmp_path / "short"
    save_model_checkpoint(path, init_params(cfg, 0), cfg, build_char_tokenizer().to_json())
    rc = main(["generate", "--checkpoint", str(path), "--prompt", "1 + 2 + 3 + 4 + 5 + 6",
               "--prompt-style", "raw", "--max-new-tokens", "30"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "the prompt has 21 tokens and --max-new-tokens is 30: 51 positions, more than the " \
           "32" in err


def test_generate_takes_the_sampling_settings_the_checkpoint_records(tmp_path, capsys):
    """As `looprl eval` does: a run's checkpoint records its evaluation's q, KV policy, dtype
    and kernels; flags still win, and a --fixed-depth drops the recorded threshold."""
    cfg = preset("tiny")
    path = tmp_path / "run_ckpt"
    save_model_checkpoint(path, init_params(cfg, 0), cfg, build_char_tokenizer().to_json(),
                          extra_meta={"eval": {"exit_threshold": 0.5, "fixed_depth": None,
                                               "kv_policy": "deferred",
                                               "compute_dtype": "float32",
                                               "kernels": "invariant"}})

    def settings(*extra):
        assert _gen(path, "--json", *extra) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["settings"]

    assert settings() == {"exit_threshold": 0.5, "fixed_depth": None, "kv_policy": "deferred",
                          "dtype": "float32", "kernels": "invariant"}
    s = settings("--kv-policy", "copy", "--fixed-depth", "2")
    assert (s["kv_policy"], s["fixed_depth"], s["exit_threshold"]) == ("copy", 2, 1.0)


def test_generate_shows_ids_the_tokenizer_cannot_decode(capsys):
    from looprl.cli.generate import shown_token
    tok = build_char_tokenizer()
    assert shown_token(tok, tok.vocab_size + 3) == f"<id {tok.vocab_size + 3}: not in the " \
                                                   f"tokenizer>"
    assert shown_token(tok, tok.encode("7")[0]) == "'7'"
