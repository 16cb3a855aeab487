"""`SamplingConfig`: how the sampler samples, and its one mapping from an experiment's rollout
section and from a recorded schedule."""
from __future__ import annotations

import dataclasses

from looprl.config.sections import KERNELS
from looprl.errors import SamplingError
from looprl.sampling.kv_policies import policy_named
from looprl.sampling.processing import NOISE_KEYING, NOISE_KEYINGS


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How to sample. `exit_threshold` is q of the Q-exit rule (q = 1.0: always loop T);
    `fixed_depth` (1..T) overrides it. RL rollouts are untruncated by default (top_k 0 = off,
    top_p 1.0 = off) so that the recorded log-prob is the behaviour probability."""
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    exit_threshold: float = 1.0
    fixed_depth: int | None = None
    kv_policy: str = "dense"  # a name of `kv_policies.POLICIES`
    deferred_max_pending: int | None = None  # None: kv_policies.auto_max_pending(rows per device)
    stop_ids: tuple[int, ...] = (2,)
    compute_dtype: str = "float32"
    max_seq_len: int | None = None  # cache length S; default P + max_new_tokens
    kernels: str = "invariant"  # "invariant" (row-tiled, replayable by the learner's dense pass)
    #                             or "stock" (plain matmuls: faster at small batch; its bits are
    #                             reproduced only by re-running the sampler in forced mode)
    prompt_len_multiple: int = 1    # P = the longest prompt rounded up to a multiple of this
    noise_keying: str = NOISE_KEYING  # "completion" (token index in its completion) or "layout"
    #                                   (padded position: the older keying)
    row_compaction: bool = True  # each decode loop runs only the rows that need it, gathered
    #                              into a sub-batch of a size from `compaction.row_menu` or, for
    #                              a deferred window, in blocks of rows
    # the thinking budget (`looprl.sampling.thinking`; None: off): (lo, hi) completion tokens,
    # one budget per step drawn in [lo, hi]; then the forced answer's ids, teacher-forced, and
    # at most `answer_budget` sampled tokens; the close's ids end the thinking
    thinking_budget: tuple[int, int] | None = None
    answer_budget: int = 0
    forced_answer_ids: tuple[int, ...] = ()
    think_close_ids: tuple[int, ...] = ()

    @classmethod
    def from_rollout_config(cls, rollout, compute_dtype: str, *, greedy: bool = False,
                            stop_ids: tuple[int, ...] = (2,), **overrides) -> "SamplingConfig":
        """The sampler settings of an experiment's `rollout` section (`looprl.config.
        RolloutConfig`) at the model's `compute_dtype`: the one mapping from the experiment
        config (the trainer's rollouts, the run's evaluations, what checkpoints record).
        `greedy`: temperature 0 and untruncated (the held-out evaluation). `overrides` replace
        fields (e.g. `exit_threshold=` for an evaluation at another q)."""
        kw = dict(max_new_tokens=rollout.max_new_tokens,
                  temperature=0.0 if greedy else rollout.temperature,
                  top_k=0 if greedy else rollout.top_k, top_p=1.0 if greedy else rollout.top_p,
                  exit_threshold=rollout.exit_threshold, fixed_depth=rollout.fixed_depth,
                  kv_policy=rollout.kv_policy, deferred_max_pending=rollout.deferred_max_pending,
                  stop_ids=tuple(stop_ids), compute_dtype=compute_dtype,
                  prompt_len_multiple=rollout.prompt_len_multiple, kernels=rollout.kernels,
                  noise_keying=rollout.noise_keying)
        return cls(**{**kw, **overrides})

    @classmethod
    def from_schedule(cls, schedule, **overrides) -> "SamplingConfig":
        """The settings a recorded rollout was sampled with, from its `Schedule`: what re-running
        it (forced mode) needs. The cache length is the recorded S (`max_seq_len`) and
        `max_new_tokens` = S - P; q is 1.0 when the schedule records a fixed depth instead.
        `prompt_len_multiple` is not recorded (the forced re-run takes the recorded layout)."""
        kw = dict(max_new_tokens=schedule.seq_len - schedule.prompt_len,
                  temperature=schedule.temperature, top_k=schedule.top_k, top_p=schedule.top_p,
                  exit_threshold=(1.0 if schedule.exit_threshold is None
                                  else schedule.exit_threshold),
                  fixed_depth=schedule.fixed_depth, kv_policy=schedule.kv_policy,
                  deferred_max_pending=schedule.deferred_max_pending,
                  stop_ids=tuple(schedule.stop_ids), compute_dtype=schedule.compute_dtype,
                  max_seq_len=schedule.seq_len, kernels=schedule.kernels,
                  noise_keying=schedule.noise_keying)
        if schedule.thinking_budget is not None:  # the drawn budget of the recorded step
            kw.update(thinking_budget=(schedule.thinking_budget,) * 2,
                      answer_budget=schedule.answer_budget,
                      forced_answer_ids=tuple(schedule.forced_answer_ids),
                      think_close_ids=tuple(schedule.think_close_ids))
        return cls(**{**kw, **overrides})

    def validate(self, T: int) -> None:
        """Raises SamplingError naming the bad field."""
        policy_named(self.kv_policy)
        if not (0.0 < self.exit_threshold <= 1.0):
            raise SamplingError(f"exit_threshold q must lie in (0, 1], got {self.exit_threshold}")
        if not (0.0 < self.top_p <= 1.0):
            raise SamplingError(f"top_p must lie in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise SamplingError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 <= self.temperature < float("inf"):  # also rejects nan
            raise SamplingError(f"temperature must be finite and >= 0, got {self.temperature}")
        if self.max_new_tokens < 1:
            raise SamplingError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.fixed_depth is not None and not (1 <= self.fixed_depth <= T):
            raise SamplingError(f"fixed_depth must lie in 1..{T}, got {self.fixed_depth}")
        if self.deferred_max_pending is not None and self.deferred_max_pending < 0:
            raise SamplingError(f"deferred_max_pending must be >= 0 (or None: automatic), "
                                f"got {self.deferred_max_pending}")
        if self.kernels not in KERNELS:
            raise SamplingError(f"kernels must be one of {list(KERNELS)}, got {self.kernels!r}")
        if self.noise_keying not in NOISE_KEYINGS:
            raise SamplingError(f"noise_keying must be one of {list(NOISE_KEYINGS)}, got "
                                f"{self.noise_keying!r}")
        if self.prompt_len_multiple < 1:
            raise SamplingError(f"prompt_len_multiple must be >= 1, got {self.prompt_len_multiple}")
        if self.compute_dtype not in ("float32", "bfloat16"):
            raise SamplingError(f"compute_dtype must be float32 or bfloat16, "
                                f"got {self.compute_dtype!r}")
        if self.thinking_budget is not None:
            self._validate_thinking()

    def _validate_thinking(self) -> None:
        lo, hi = self.thinking_budget
        F = len(self.forced_answer_ids)
        if not 1 <= lo <= hi:
            raise SamplingError(f"thinking_budget (lo, hi) needs 1 <= lo <= hi, got "
                                f"{self.thinking_budget}")
        if F == 0 or not self.think_close_ids:
            raise SamplingError("thinking_budget needs forced_answer_ids and think_close_ids "
                                "(the tokenised forced answer text and thinking close)")
        if self.answer_budget < 1:
            raise SamplingError(f"answer_budget must be >= 1 with a thinking budget, got "
                                f"{self.answer_budget}")
        if set(self.forced_answer_ids) & set(self.stop_ids):
            raise SamplingError(f"forced_answer_ids {self.forced_answer_ids} hold a stop id "
                                f"{self.stop_ids}: the forced answer would end the completion")
        if hi + F + self.answer_budget > self.max_new_tokens:
            raise SamplingError(f"thinking_budget {hi} + forced answer {F} + answer_budget "
                                f"{self.answer_budget} tokens exceed max_new_tokens "
                                f"{self.max_new_tokens}")
