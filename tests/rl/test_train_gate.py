"""The trainer's gate-training branch (`learner.train_gate`), one GRPO step on the tiny smoke
config (experiments/tiny_arith_smoke.py, shrunk as tests/distributed/grpo_step_worker.py does).

What the code does (looprl/rl/optimizer.py `make_optimizer`, looprl/rl/objective.py
`policy_loss`): the optimizer zeroes the exit gate's update (`optax.set_to_zero`) unless
`train_gate`; with `train_gate` the loss gains the stage-II gate loss and the gate trains with
the same AdamW and learning rate as the LM, while the LM keeps training by the PPO loss. So the claims that hold:
- train_gate=false: the gate stays bit-identical, the LM moves;
- train_gate=true: the gate moves, and the LM moves as well (there is no LM-only-frozen mode:
  `optim.learning_rate` must be > 0 and is shared).
The one setting where only the gate *should* train is a step whose policy term is exactly 0
(every group degenerate: equal rewards, advantages 0, `kl_beta` 0): the stage-II loss is
documented to train only the gate (docs/DESIGN.md §1, `grpo.gate_stage2_loss`: CE
stop-gradient), so the LM stays bit-identical there: the gate logit `z = w . h(t) + b` is taken
on a stop-gradient of the LM's hidden state (`looprl.logprobs` `loop_logprobs`), so the gate
loss's gradient reaches no LM parameter.
"""
from pathlib import Path

import jax
import numpy as np
import pytest

from looprl.config import apply_overrides, load_experiment
from looprl.model.config import from_model_section
from looprl.model.looped import init_params
from looprl.rl.learner import GRPOLearner
from looprl.train.setup import build_tasks

SMOKE = Path(__file__).resolve().parents[2] / "experiments" / "tiny_arith_smoke.py"

BASE = ["rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=4",
        "learner.minibatches=1", "learner.microbatch_size=0", "measure_stock=false"]


def _one_step(train_gate: bool, reward):
    cfg = apply_overrides(load_experiment(SMOKE), BASE + [f"learner.train_gate={train_gate}"])
    _, task = build_tasks(cfg)
    task.reward = reward
    mcfg = from_model_section(cfg.model)
    params = init_params(mcfg, 0)
    learner = GRPOLearner(cfg, mcfg, params, task, task.tokenizer())
    before = jax.tree.map(lambda a: np.asarray(a).copy(), learner.params)
    metrics = learner.step(0)
    after = jax.tree.map(np.asarray, learner.params)
    return before, after, metrics


def _moved(before, after):
    """{param path: whether any bit changed}, split into the gate and the LM."""
    flat_b = jax.tree_util.tree_leaves_with_path(before)
    flat_a = jax.tree.leaves(after)
    out = {}
    for (path, b), a in zip(flat_b, flat_a):
        out[jax.tree_util.keystr(path)] = not np.array_equal(b.view(np.uint32),
                                                             a.view(np.uint32))
    gate = {k: v for k, v in out.items() if "early_exit_gate" in k}
    lm = {k: v for k, v in out.items() if "early_exit_gate" not in k}
    return gate, lm


def _len_reward(problem, text):  # varies within groups: non-zero advantages (worker's trick)
    return float(len(text))


def test_without_train_gate_the_gate_stays_bit_identical_and_the_lm_moves():
    before, after, m = _one_step(False, _len_reward)
    gate, lm = _moved(before, after)
    assert m["grad_norm"] > 0 and m["degenerate_groups"] < 2 and "gate_loss" not in m
    assert not any(gate.values()), gate
    assert all(lm.values()), [k for k, v in lm.items() if not v]


@pytest.mark.slow  # 28 s; the gate trains under train_gate in the zero-policy test below
def test_with_train_gate_the_gate_moves_and_the_lm_still_trains():
    before, after, m = _one_step(True, _len_reward)
    gate, lm = _moved(before, after)
    assert m["gate_loss"] > 0
    assert all(gate.values()), gate
    assert all(lm.values()), [k for k, v in lm.items() if not v]


def test_with_train_gate_and_a_zero_policy_term_only_the_gate_moves():
    before, after, m = _one_step(True, lambda problem, text: 0.0)
    gate, lm = _moved(before, after)
    assert m["degenerate_groups"] == 2 and m["gate_loss"] > 0   # advantages are all exactly 0
    assert all(gate.values()), gate
    assert not lm["['lm_head']"]  # holds: the policy term is exactly 0, only h(t) leaks
    assert not any(lm.values()), [k for k, v in lm.items() if v]
