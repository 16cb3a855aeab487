"""GRPO trainer and `looprl train`: a short smoke run, config rejection, non-finite stop."""
import json
import math
from pathlib import Path

import numpy as np
import pytest

from looprl.cli import main
from looprl.config import apply_overrides, load_experiment
from looprl.errors import TrainingError
from looprl.io.checkpoint import params_sha256

SMOKE = Path(__file__).resolve().parents[2] / "experiments" / "tiny_arith_smoke.py"
# the evaluation sizes of tests/train/test_resume.py and tests/cli/test_run_checkpoint.py: their
# runs and this one share compiled programs through the run's persistent compilation cache
FAST = ["warm_start.max_steps=10", "eval.eval_problems=16", "warm_start.eval_problems=16",
        "grpo_steps=2", "progress_bar=false", "tensorboard=false"]


def test_params_sha256_matches_the_documented_recipe():
    import hashlib
    params = {"b": np.arange(3, dtype=np.float32), "a": {"k": np.ones((2, 1), np.float32)}}
    h = hashlib.sha256()
    h.update(b"a/k|float32|2,1|" + np.ones((2, 1), "<f4").tobytes())
    h.update(b"b|float32|3|" + np.arange(3, dtype="<f4").tobytes())
    assert params_sha256(params) == h.hexdigest()


def test_smoke_run_is_bit_exact_every_step_and_writes_the_run_directory(tmp_path,
                                                                        monkeypatch):
    from looprl.rl import learner as rl_learner
    from looprl.train.run import train
    real, stock_lens = rl_learner.batch_logprobs, []

    def spy(cfg, params, batch, method="replay", **kw):
        if method == "stock":
            stock_lens.append(kw.get("seq_len"))
        return real(cfg, params, batch, method, **kw)

    monkeypatch.setattr(rl_learner, "batch_logprobs", spy)
    cfg = apply_overrides(load_experiment(SMOKE), FAST + [f"out_dir={tmp_path / 'run'}"])
    summary = train(cfg, quiet=True)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    # the stock control runs on each step's bucketed live prefix, like the learner's passes
    assert stock_lens == [r["learner_seq_len"] for r in rows]
    for r in rows:
        assert r["replay_exact_fraction"] == 1.0, r
        assert all(math.isfinite(v) for v in r.values() if isinstance(v, float)), r
        assert 0 < r["stock_max_abs_diff"] < 1e-4
    for key in ("eval_accuracy_before", "eval_accuracy_after", "eval_problems", "grpo_steps",
                "resumed_from_step", "params_sha256", "wall_s"):
        assert key in summary
    assert summary["resumed_from_step"] is None and summary["grpo_steps"] == 2
    for name in ("config.json", "summary.json", "warm_start_curve.json", "checkpoint",
                 "eval_before.json", "checkpoints/step_00000002", "checkpoints/index.jsonl"):
        assert (tmp_path / "run" / name).exists()


def test_bad_config_key_and_non_empty_out_dir_are_rejected(tmp_path, capsys):
    assert main(["train", str(SMOKE), "grpo.not_a_key=1"]) == 2
    assert "unknown config key 'grpo.not_a_key'" in capsys.readouterr().err
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "f").write_text("")
    assert main(["train", str(SMOKE), f"out_dir={tmp_path / 'x'}"]) == 2
    assert "is not empty" in capsys.readouterr().err


def test_non_finite_loss_stops_with_a_diagnostic_and_writes_no_checkpoint(tmp_path,
                                                                         monkeypatch):
    from looprl.tasks.arithmetic import ArithmeticTask
    from looprl.train.run import train
    monkeypatch.setattr(ArithmeticTask, "reward", lambda self, p, c: float("nan"))
    cfg = apply_overrides(load_experiment(SMOKE), FAST + [f"out_dir={tmp_path / 'run'}"])
    with pytest.raises(TrainingError, match=r"GRPO step 0: non-finite loss"):
        train(cfg, quiet=True)
    failure = json.loads((tmp_path / "run" / "failure.json").read_text())
    assert failure["step"] == 0 and "non-finite" in failure["error"]
    assert not (tmp_path / "run" / "checkpoint").exists()
    assert not (tmp_path / "run" / "summary.json").exists()


def test_forced_replay_fallback_trains_on_a_stock_kernel_sampler(monkeypatch):
    """`rollout.kernels=stock` has no invariant replay; `learner.replay_impl` auto picks the
    forced re-run, whose bits equal the sampler's, so the first update's ratio is exactly 1 and
    the second minibatch (after an update) still trains on the forced re-run's values. One GRPO
    step of the learner from fresh parameters (was a whole `train()` with a warm start and two
    evaluations: 98 s, of which the step is a small part). The reward is the completion's CRC
    parity, so groups score differently and the step has a gradient."""
    import zlib

    from looprl.model.config import from_model_section
    from looprl.model.looped import init_params
    from looprl.rl.learner import GRPOLearner, resolve_replay_impl
    from looprl.train.setup import build_tasks

    cfg = apply_overrides(load_experiment(SMOKE), [
        "rollout.kernels=stock", "prompts_per_step=4", "group_size=4", "learner.minibatches=2",
        "learner.microbatch_size=0"])
    assert resolve_replay_impl(cfg) == "forced"
    assert resolve_replay_impl(apply_overrides(cfg, ["rollout.kernels=invariant"])) == "invariant"
    assert resolve_replay_impl(apply_overrides(cfg, ["rollout.kernels=invariant"]),
                               backend="gpu") == "forced"
    mcfg = from_model_section(cfg.model)
    _, task = build_tasks(cfg)
    task.reward = lambda problem, text: float(zlib.crc32(text.encode()) % 2)
    row = GRPOLearner(cfg, mcfg, init_params(mcfg, 0), task, task.tokenizer()).step(0)
    assert row["replay_impl"] == "forced" and row["replay_exact_fraction"] == 1.0
    assert 0 < row["stock_max_abs_diff"] < 1e-4 and row["grad_norm"] > 0
    assert row["ratio_min"] < 1.0 < row["ratio_max"]  # second minibatch: params moved


def test_stock_kernels_with_invariant_replay_is_rejected():
    from looprl.errors import ConfigError
    with pytest.raises(ConfigError, match="learner.replay_impl"):
        apply_overrides(load_experiment(SMOKE), ["rollout.kernels=stock",
                                                 "learner.replay_impl=invariant"])


def test_forced_hybrid_value_is_the_given_replay_and_gradient_is_dense():
    """The trainer's loss with `forced_replay`: the hybrid's value is mb['replay_lp'] bit for bit
    (old = replay gives a ratio of exactly 1 at every token), its gradient is dense's."""
    import jax
    import jax.numpy as jnp

    from looprl.logprobs import sequence_logprobs
    from looprl.model.config import preset
    from looprl.model.looped import init_params
    from looprl.rl.losses import LossSettings
    from looprl.rl.objective import LossSpec, policy_loss

    cfg = preset("tiny", vocab_size=16, hidden_size=32, intermediate_size=64, num_heads=2,
                 num_kv_heads=2, head_dim=16, num_layers=1)
    params = init_params(cfg, 0)
    B, S = 2, 8
    rng = np.random.default_rng(0)
    mb = {"tokens": jnp.asarray(rng.integers(3, 16, (B, S)), jnp.int32),
          "pad": jnp.zeros((B,), jnp.int32),
          "exit_loop": jnp.asarray(np.r_[[0, 0, 0], [1, 2, 3, 4, 2]][None].repeat(B, 0),
                                   jnp.int32),
          "kv_depth": jnp.full((B, S), 4, jnp.int32), "adv": jnp.asarray([1.0, -0.5])}
    dense, _ = jax.jit(lambda p: sequence_logprobs(
        cfg, p, mb["tokens"], mb["pad"], mb["exit_loop"], mb["kv_depth"], kv_policy="dense",
        compute_dtype="float32", temperature=1.0, method="dense"))(params)
    # a replay that differs from dense in the last bits, as a GPU sampler's would
    replay = np.asarray(dense) * np.float32(1 + 2 ** -20)
    spec = dict(cfg=cfg, kv_policy="dense", compute_dtype="float32", temperature=1.0, top_k=0,
                top_p=1.0, settings=LossSettings(eps_low=0.2, eps_high=0.28),
                loss_agg="token-mean", max_new_tokens=5, kl_beta=0.0, tis_cap=None, loop_credit="none",
                loop_credit_alpha=1.0, train_gate=False, gate_loss_coef=1.0)
    norm, gnorm = jnp.float32(10.0), jnp.float32(1.0)

    def run(mb_, **kw):
        return jax.jit(jax.value_and_grad(policy_loss, has_aux=True), static_argnums=4)(
            params, mb_, norm, gnorm, LossSpec(**spec, **kw))

    forced_mb = dict(mb, old_lp=jnp.asarray(replay), replay_lp=jnp.asarray(replay),
                     replay_lpp=jnp.asarray(replay))
    (_, st), g_forced = run(forced_mb, method="hybrid", forced_replay=True)
    assert float(st["ratio_min"]) == float(st["ratio_max"]) == 1.0
    (_, st_inv), _ = run(forced_mb, method="hybrid", forced_replay=False)
    assert float(st_inv["ratio_min"]) != 1.0 or float(st_inv["ratio_max"]) != 1.0
    # gradient: dense's, taken where dense's value is the replay's (old = replay, ratio 1)
    dense_mb = dict(mb, old_lp=dense, replay_lp=dense, replay_lpp=dense)
    (_, _), g_dense = run(dense_mb, method="dense")
    for a, b in zip(jax.tree.leaves(g_forced), jax.tree.leaves(g_dense)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-8)


def _force_inexact_replay(monkeypatch):
    """Make the trainer's replay the `stock` learner pass (same math, other bits: the
    negative control), so replay_exact_fraction < 1. (`rollout.kernels=stock` with
    `learner.replay_impl=invariant` cannot: the config refuses it, and a stock rollout's replay
    is the forced re-run, which is exact.)"""
    from looprl.rl import learner as rl_learner
    real = rl_learner.batch_logprobs

    def stock_replay(cfg, params, batch, method="replay", **kw):
        return real(cfg, params, batch, "stock" if method == "replay" else method, **kw)

    monkeypatch.setattr(rl_learner, "batch_logprobs", stock_replay)


def test_inexact_replay_warns_on_the_console_and_is_counted_in_the_summary(tmp_path, capsys,
                                                                           monkeypatch):
    from looprl.train.run import train
    _force_inexact_replay(monkeypatch)
    cfg = apply_overrides(load_experiment(SMOKE), FAST + [
        f"out_dir={tmp_path / 'run'}", "grpo_steps=1", "learner.require_exact=false"])
    summary = train(cfg, quiet=True)
    (row,) = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert row["replay_impl"] == "invariant" and row["replay_exact_fraction"] < 1.0
    err = capsys.readouterr().err
    assert (f"GRPO step 0: replay_exact_fraction {row['replay_exact_fraction']:.4f} < 1" in err
            and "looprl verify" in err)
    assert "1 of 1 GRPO steps replayed inexactly" in err
    assert summary["replay_exact_fraction_min"] == row["replay_exact_fraction"]
    assert summary["inexact_replay_steps"] == 1
    on_disk = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert on_disk["inexact_replay_steps"] == 1


def test_require_exact_stops_the_run_at_the_first_inexact_step(tmp_path, capsys, monkeypatch):
    """On XLA CPU with invariant kernels require_exact is on by default (no key given)."""
    _force_inexact_replay(monkeypatch)
    args = FAST + [f"out_dir={tmp_path / 'run'}", "grpo_steps=1"]
    assert main(["train", str(SMOKE), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("looprl train: error: GRPO step 0: "
                                               "replay_exact_fraction 0.")
    assert "looprl verify" in err[0]
    failure = json.loads((tmp_path / "run" / "failure.json").read_text())
    assert failure["step"] == 0 and "replay_exact_fraction" in failure["error"]
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_require_exact_defaults_on_only_where_exactness_is_claimed():
    from looprl.rl.learner import resolve_require_exact
    cfg = load_experiment(SMOKE)
    assert resolve_require_exact(cfg, "invariant", backend="cpu") is True
    assert resolve_require_exact(cfg, "forced", backend="cpu") is False
    assert resolve_require_exact(cfg, "invariant", backend="gpu") is False
    stock = apply_overrides(cfg, ["rollout.kernels=stock"])
    assert resolve_require_exact(stock, "forced", backend="cpu") is False
    off = apply_overrides(cfg, ["learner.require_exact=false"])
    assert resolve_require_exact(off, "invariant", backend="cpu") is False
    on = apply_overrides(cfg, ["learner.require_exact=true"])
    assert resolve_require_exact(on, "forced", backend="gpu") is True
