"""The real-model configs (experiments/ouro_{1p4b,2p6b}_gsm8k_grpo.py): their documented settings,
their clear errors, and one GRPO step on the CPU from a tiny HF-format Ouro checkpoint (byte-level
BPE tokenizer) converted with `looprl convert`, everything else as the config says (bf16 compute,
deferred KV policy at q = 0.9, hybrid log-probs, GSM8K prompts from the real files)."""
import json
import math
from pathlib import Path

import pytest
from tiny_ouro import tiny_looprl_checkpoint

from looprl.cli import main
from looprl.config import apply_overrides, load_experiment, to_dict
from looprl.errors import ConfigError
from looprl.tasks.gsm8k import REPO_ROOT, GSM8KTask

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"
CFG_1P4B = EXPERIMENTS / "ouro_1p4b_gsm8k_grpo.py"
CFG_2P6B = EXPERIMENTS / "ouro_2p6b_gsm8k_grpo.py"
DATA = REPO_ROOT / ".." / "shared" / "data" / "gsm8k"
needs_data = pytest.mark.skipif(not (DATA / "train.jsonl").is_file(),
                                reason=f"GSM8K files not found in {DATA}: the data is not in the "
                                "repository (docs/GUIDE.md, 'Install')")
TINY_RUN = ["grpo_steps=1", "prompts_per_step=2", "group_size=4", "max_new_tokens=6",
            "minibatches=1", "microbatch_size=4", "eval.eval_problems=2", "eval_batch_size=2",
            "tensorboard=false", "progress_bar=false"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_looprl_checkpoint(tmp_path_factory.mktemp("ouro_cfg"))


def test_1p4b_config_states_the_documented_settings():
    cfg = load_experiment(CFG_1P4B)
    assert (cfg.model.preset, cfg.model.checkpoint, cfg.model.compute_dtype) == (
        "ouro-1.4b", None, "bfloat16")
    assert (cfg.task.name, cfg.task.data_dir, cfg.task.prompt_style) == (
        "gsm8k", "../shared/data/gsm8k", "chatml")
    assert cfg.warm_start.enabled is False
    r = cfg.rollout
    assert (r.kv_policy, r.exit_threshold, r.group_size, r.max_new_tokens, r.temperature) == (
        "deferred", 0.9, 8, 512, 1.0)
    assert cfg.learner.logprob_method == "hybrid"
    assert (cfg.grpo.eps_low, cfg.grpo.eps_high, cfg.grpo.loss_agg, cfg.grpo.kl_beta) == (
        0.2, 0.28, "token-mean", 0.001)
    assert cfg.optim.learning_rate == 1e-6 and cfg.eval.eval_problems == 1319


def test_2p6b_config_is_the_1p4b_one_with_the_48_layer_model():
    a, b = to_dict(load_experiment(CFG_1P4B)), to_dict(load_experiment(CFG_2P6B))
    assert b["model"]["preset"] == "ouro-2.6b" and b["learner"]["microbatch_size"] == 4
    for d in (a, b):
        del d["name"], d["model"]["preset"], d["learner"]["microbatch_size"], d["run"]["out_dir"]
    assert a == b


def test_without_checkpoint_the_run_stops_before_loading_anything(tmp_path, capsys):
    rc = main(["train", str(CFG_1P4B), f"out_dir={tmp_path / 'run'}"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "model.checkpoint" in err and "looprl convert" in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_gsm8k_with_warm_start_is_a_clear_error(tiny, tmp_path):
    from looprl.train.setup import build_tasks

    cfg = apply_overrides(load_experiment(CFG_1P4B), [f"model.checkpoint={tiny[0]}",
                                                      "warm_start.enabled=true"])
    with pytest.raises(ConfigError, match="warm_start.enabled"):
        build_tasks(cfg)


@needs_data
def test_gsm8k_task_keys_reach_the_task(tiny):
    from looprl.train.setup import build_tasks

    cfg = apply_overrides(load_experiment(CFG_1P4B), [f"model.checkpoint={tiny[0]}",
                                                      "task.prompt_style=thinking"])
    warm, rl = build_tasks(cfg)
    assert warm is rl and rl.resolved_dir == DATA.resolve()
    assert rl.format_prompt(rl.eval_problems(1)[0]).endswith("<|im_start|>assistant\n<think>\n")
    for bad in ("task.prompt_style=chat", "task.source=ftp", "task.data_dir=",
                "rollout.prompt_len_multiple=0"):
        with pytest.raises(ConfigError, match=bad.split("=")[0]):
            apply_overrides(cfg, [bad])


def run_one_step(cfg_path, ckpt, out, monkeypatch):
    from looprl.train.run import train

    # the random tiny model never answers a GSM8K question, so every group's rewards would be
    # equal and the gradient zero; a stand-in reward (the completion's length parity) varies
    # within groups so that the step's update is exercised
    monkeypatch.setattr(GSM8KTask, "reward", lambda self, p, c: float(len(c) % 2))
    cfg = apply_overrides(load_experiment(cfg_path),
                          [f"model.checkpoint={ckpt}", f"out_dir={out}"] + TINY_RUN)
    summary = train(cfg, quiet=True)
    return summary, [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def check_step(summary, metrics, out, tokenizer_json):
    assert [m["step"] for m in metrics] == [0]
    m = metrics[0]
    assert all(math.isfinite(v) for v in m.values() if isinstance(v, (int, float)))
    assert m["replay_exact_fraction"] == 1.0  # hybrid = replay of the recorded schedule, bf16
    assert m["ratio_min"] == m["ratio_max"] == 1.0  # so the first update's ratio is exactly 1
    assert 0.0 < m["stock_max_abs_diff"] < 0.1  # the stock baseline differs in low bits only
    assert m["grad_norm"] > 0.0 and m["degenerate_groups"] < 2
    assert 3.0 <= m["mean_exit_loop"] <= 4.0  # q = 0.9 with lambda ~ 0.6: loops 3 and 4
    assert summary["grpo_steps"] == 1 and summary["eval_problems"] == 2
    # the model's actual shape (the tiny checkpoint's, not the named preset's)
    assert summary["model_config"]["hidden_size"] != 2048
    from looprl.model.config import OuroConfig
    assert summary["num_params"] == OuroConfig.from_dict(summary["model_config"]).num_params
    assert 0.0 <= summary["eval_accuracy_after"] <= 1.0 and summary["exit_threshold"] == 0.9
    # the run's tokenizer is the model checkpoint's (GSM8K has none of its own)
    assert (out / "checkpoint" / "tokenizer.json").read_text() == tokenizer_json
    assert json.loads((out / "config.json").read_text())["model"]["compute_dtype"] == "bfloat16"
    # no warm start: the run points at the converted checkpoint instead of copying it
    assert not (out / "warm_start").exists()
    ref = json.loads((out / "reference.json").read_text())
    assert Path(ref["checkpoint"]).is_absolute() and len(ref["params_sha256"]) == 64


# in the default suite (35 s on a 2-core AMD EPYC): the only default test of the path users with
# real checkpoints take (bf16 training, the KL term, a start from model.checkpoint)
@needs_data
def test_1p4b_config_runs_one_grpo_step_on_cpu(tiny, tmp_path, monkeypatch):
    summary, metrics = run_one_step(CFG_1P4B, tiny[0], tmp_path / "run", monkeypatch)
    check_step(summary, metrics, tmp_path / "run", tiny[1])


@pytest.mark.slow  # 169 s on 2 cores; the 1.4B test above runs its first step by default
@needs_data
def test_2p6b_config_runs_one_grpo_step_on_cpu_and_resumes(tiny, tmp_path, monkeypatch):
    from looprl.errors import CheckpointError
    from looprl.train.run import train

    out = tmp_path / "run"
    summary, metrics = run_one_step(CFG_2P6B, tiny[0], out, monkeypatch)
    check_step(summary, metrics, out, tiny[1])
    # resume one more step: the reference policy comes back from reference.json's checkpoint
    cfg = apply_overrides(load_experiment(CFG_2P6B), [f"model.checkpoint={tiny[0]}",
                                                      f"resume={out}", f"out_dir={out}"]
                          + TINY_RUN[1:] + ["grpo_steps=2"])
    summary = train(cfg, quiet=True)
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1] and summary["resumed_from_step"] == 1
    # a reference checkpoint that changed since the run started is refused, by name
    ref = json.loads((out / "reference.json").read_text())
    ref["params_sha256"] = "0" * 64
    (out / "reference.json").write_text(json.dumps(ref))
    with pytest.raises(CheckpointError, match="reference checkpoint changed"):
        train(apply_overrides(cfg, ["grpo_steps=3"]), quiet=True)
