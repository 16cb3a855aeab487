"""DAPO's dynamic sampling (arXiv 2503.14476, §3.2): a GRPO step's groups whose rewards are all
equal carry no signal, so they are dropped and the batch is refilled from further prompts.

`dynamic_rollout` samples rounds of `rollout.prompts_per_step` new train problems (G samples
each, the step's noise keys) until `prompts_per_step` groups with unequal rewards are found or
`grpo.dynamic_sampling_max_batches` rounds are spent; the step then trains on the first such
groups in stream order, topped up with dropped ones (stream order) when too few were found. When
those are not round one's problems, they are sampled once more as one batch: every row's noise
is keyed by (seed, step, problem id, sample, position) and its bits do not depend on its
batch-mates (docs/NUMERICS.md), so the rows are the ones the rounds drew, and the rollout the
learner trains on is an ordinary sampler output (its schedule, replay and `prompt_index_B`
record which problems were kept). The problems consumed advance `data_position`, which a
checkpoint stores: a resumed run draws the same rounds.
"""
from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from looprl.config import ExperimentConfig
from looprl.rl.grpo import GroupAdvantages
from looprl.rl.rollout import completion_rewards
from looprl.sampling.schedule import RolloutBatch
from looprl.tasks.base import Problem, Task


class StepSampler(Protocol):
    """What dynamic sampling asks of a learner (`looprl.rl.learner.GRPOLearner` is one)."""
    exp_cfg: ExperimentConfig
    task: Task
    tokenizer: Any

    def rollout(self, step: int) -> tuple[list[Problem], RolloutBatch]:
        """The next `prompts_per_step` train problems and their rollout; advances the stream."""

    def sample(self, problems: list[Problem], step: int) -> RolloutBatch:
        """The rollout of `problems` (G samples each) at GRPO step `step`."""

    def advantages(self, rewards_B: np.ndarray) -> GroupAdvantages:
        """The step's group advantages of rewards `[B]`."""


def dynamic_rollout(learner: StepSampler, step: int
                    ) -> tuple[list[Problem], RolloutBatch, dict[str, Any]]:
    """(problems, RolloutBatch, figures) of step `step` with dynamic sampling. Each round is
    `learner.rollout`; kept groups not all from round one are sampled again (`learner.sample`).
    Figures: `dynamic_sampling_rounds` (rounds sampled), `dynamic_sampling_kept` (groups with
    signal found, at most N) and `dynamic_sampling_resampled` (whether the kept groups were
    sampled again as one batch)."""
    cfg = learner.exp_cfg
    N, G = cfg.rollout.prompts_per_step, cfg.rollout.group_size
    kept, dropped, first = [], [], None
    rounds = 0
    while rounds < cfg.grpo.dynamic_sampling_max_batches and len(kept) < N:
        problems, batch = learner.rollout(step)
        rounds += 1
        first = first or (problems, batch)
        rewards, _ = completion_rewards(learner.task, learner.tokenizer, problems, batch, G)
        degenerate = learner.advantages(rewards).degenerate_N
        for i, (p, d) in enumerate(zip(problems, [bool(x) for x in degenerate])):
            (dropped if d else kept).append(((rounds - 1) * N + i, p))  # (stream order, problem)
    chosen = sorted((kept + dropped)[:N], key=lambda x: x[0])
    figures = {"dynamic_sampling_rounds": rounds, "dynamic_sampling_kept": min(len(kept), N)}
    if [i for i, _ in chosen] == list(range(N)):  # round one's problems: its rollout
        return first[0], first[1], {**figures, "dynamic_sampling_resampled": False}
    chosen = [p for _, p in chosen]
    return chosen, learner.sample(chosen, step), {**figures, "dynamic_sampling_resampled": True}
