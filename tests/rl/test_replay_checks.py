"""The forced-replay fallback re-runs the sampler only where it must: at the sampler's own parameters the replay
value is the recorded log-prob, so the first update needs no re-run; `learner.replay_check_every`
sets how often the replay is really re-run and compared, and `replay_exact_fraction` is logged
only on those steps (never computed from recorded values alone)."""
import zlib
from pathlib import Path

from looprl.config import apply_overrides, load_experiment
from looprl.model.config import from_model_section
from looprl.model.looped import init_params
from looprl.rl import learner as learner_module
from looprl.train.setup import build_tasks

SMOKE = Path(__file__).resolve().parents[2] / "experiments" / "tiny_arith_smoke.py"


def _learner(monkeypatch, calls, *overrides):
    cfg = apply_overrides(load_experiment(SMOKE), [
        # the rollout shape of tests/rl/test_train_gate.py (8 rows, 4 new tokens): one sampler
        # program for both through the run's compilation cache
        "prompts_per_step=2", "group_size=4", "rollout.max_new_tokens=4",
        "learner.minibatches=2", "learner.ppo_epochs=2",
        "learner.microbatch_size=0", "learner.measure_stock=false", "learner.replay_impl=forced",
        *overrides])
    mcfg = from_model_section(cfg.model)
    _, task = build_tasks(cfg)
    task.reward = lambda problem, text: float(zlib.crc32(text.encode()) % 2)
    real = learner_module.forced_replay_logprobs

    def counting(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(learner_module, "forced_replay_logprobs", counting)
    return learner_module.GRPOLearner(cfg, mcfg, init_params(mcfg, 0), task, task.tokenizer())


def test_forced_replay_re_runs_fewer_times_and_logs_exactness_only_when_measured(monkeypatch):
    calls: list[int] = []
    lrn = _learner(monkeypatch, calls, "learner.replay_check_every=2")
    m0 = lrn.step(0)  # a check step: 1 re-run at the sampler's params + 3 at updated params
    assert len(calls) == 4 and m0["replay_exact_fraction"] == 1.0
    calls.clear()
    m1 = lrn.step(1)  # no check: the first update uses the recorded values, 3 re-runs
    assert len(calls) == 3 and m1["replay_exact_fraction"] is None
    assert m1["mismatch_abs_max"] is None  # hybrid's own log-probs were not measured either
    calls.clear()
    lrn.step(2)
    assert len(calls) == 4  # checked again


def test_every_step_is_checked_by_default(monkeypatch):
    calls: list[int] = []
    lrn = _learner(monkeypatch, calls)
    for step in (0, 1):
        calls.clear()
        assert lrn.step(step)["replay_exact_fraction"] == 1.0
        assert len(calls) == 4
