"""Dynamic sampling through the sampler interface (`looprl.rl.dynamic_sampling.StepSampler`):
a scripted sampler without a model, so each round's choice is checked by hand."""
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np

from looprl.rl.dynamic_sampling import dynamic_rollout
from looprl.rl.signal import step_advantages
from looprl.tasks.base import TRAIN, Problem

N, G = 2, 2


class ScriptedSampler:
    """Problem k's G rewards are `rewards[k]`; each row's one completion token is its reward."""

    def __init__(self, rewards, max_batches=3):
        self.rewards = rewards
        self.exp_cfg = SimpleNamespace(
            rollout=SimpleNamespace(prompts_per_step=N, group_size=G),
            grpo=SimpleNamespace(dynamic_sampling_max_batches=max_batches))
        self.task = SimpleNamespace(reward=lambda problem, text: float(text))
        self.tokenizer = SimpleNamespace(decode_completion=lambda ids: str(ids[0]))
        self.position, self.calls = 0, []

    def rollout(self, step):
        problems = [Problem(i, TRAIN, f"q{i}", "0") for i in range(self.position,
                                                                   self.position + N)]
        self.position += N
        self.calls.append(("rollout", step))
        return problems, self._batch(problems)

    def sample(self, problems, step):
        self.calls.append(("sample", step, [p.id for p in problems]))
        return self._batch(problems)

    def advantages(self, rewards_B):
        return step_advantages(jnp.asarray(rewards_B.reshape(N, G)), "group")

    def _batch(self, problems):
        tokens = np.array([[r] for p in problems for r in self.rewards[p.id]], np.int32)
        return SimpleNamespace(tokens_BxS=tokens, schedule=SimpleNamespace(prompt_len=0),
                               completion_len_B=np.ones(len(tokens), np.int32),
                               ids=[p.id for p in problems])


def test_groups_with_signal_from_two_rounds_are_sampled_again_as_one_batch():
    s = ScriptedSampler({0: [0, 0], 1: [1, 0], 2: [0, 1], 3: [1, 1]})
    problems, batch, figures = dynamic_rollout(s, step=7)
    assert [p.id for p in problems] == [1, 2] and batch.ids == [1, 2]
    assert s.calls == [("rollout", 7), ("rollout", 7), ("sample", 7, [1, 2])]
    assert figures == {"dynamic_sampling_rounds": 2, "dynamic_sampling_kept": 2,
                       "dynamic_sampling_resampled": True}


def test_round_one_with_signal_is_its_own_rollout():
    s = ScriptedSampler({0: [1, 0], 1: [0, 1]})
    problems, batch, figures = dynamic_rollout(s, step=0)
    assert [p.id for p in problems] == [0, 1] and s.calls == [("rollout", 0)]
    assert figures["dynamic_sampling_resampled"] is False


def test_too_few_groups_with_signal_are_topped_up_in_stream_order():
    """Rounds run out with one group kept: the first dropped group (problem 0) fills the batch;
    stream order puts it first, and the pair is not round one's, so it is sampled again."""
    s = ScriptedSampler({0: [0, 0], 1: [1, 1], 2: [1, 1], 3: [0, 1]}, max_batches=2)
    problems, _, figures = dynamic_rollout(s, step=3)
    assert [p.id for p in problems] == [0, 3]
    assert figures == {"dynamic_sampling_rounds": 2, "dynamic_sampling_kept": 1,
                       "dynamic_sampling_resampled": True}
