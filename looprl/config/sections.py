"""The experiment config's sections: typed, frozen dataclasses that check their fields when
constructed (`looprl.config` has the whole story)."""
from __future__ import annotations

import dataclasses
from typing import Literal, Optional, get_args

from looprl.config.fields import convert_value, field_types
from looprl.errors import ConfigError

KVPolicy = Literal["dense", "deferred", "copy"]  # the policies of looprl.sampling.kv_policies
ComputeDtype = Literal["float32", "bfloat16"]
LogprobMethod = Literal["hybrid", "replay", "dense", "stock", "full_depth", "expected"]
OldLogprobs = Literal["sampler", "recompute"]
Kernels = Literal["invariant", "stock"]
NoiseKeying = Literal["completion", "layout"]
ReplayImpl = Literal["auto", "invariant", "forced"]
LossAgg = Literal["token-mean", "seq-mean-token-mean", "dr-grpo"]
LoopCredit = Literal["none", "uniform", "progressive", "exit_dist"]
LrSchedule = Literal["constant", "cosine", "linear"]
PromptStyle = Literal["chatml", "thinking", "compact"]
TaskSource = Literal["jsonl", "hub"]
# the same choices as tuples, for the code that checks or lists them
KERNELS = get_args(Kernels)
AGG_MODES = get_args(LossAgg)
LOOP_CREDIT_MODES = get_args(LoopCredit)


class _Section:
    """Base of every config section: type-checks (and int -> float coerces) its fields, then
    runs `_validate` for value ranges. Subclasses are frozen dataclasses."""

    def __post_init__(self):
        hints = field_types(type(self))
        for f in dataclasses.fields(self):
            key = f"{self._section_name()}{f.name}"
            value = convert_value(hints[f.name], getattr(self, f.name), key)
            object.__setattr__(self, f.name, value)
        self._validate()

    def _section_name(self) -> str:
        return getattr(type(self), "SECTION", "") + "." if getattr(type(self), "SECTION", "") else ""

    def _require(self, ok: bool, name: str, expected: str):
        if not ok:
            raise ConfigError(f"config key '{self._section_name()}{name}': expected {expected}, "
                              f"found {getattr(self, name)!r}")

    def _validate(self):
        pass

    def replace(self, **kw):
        return dataclasses.replace(self, **kw)


@dataclasses.dataclass(frozen=True)
class ModelConfig(_Section):
    """The policy network: a preset (`looprl.model.config.PRESETS`) with optional overrides, or
    a looprl checkpoint to start from (then the warm start can be skipped)."""
    SECTION = "model"
    preset: str = "tiny"
    checkpoint: Optional[str] = None      # looprl checkpoint directory to start from
    hidden_size: Optional[int] = None     # None: the preset's value
    num_layers: Optional[int] = None
    num_heads: Optional[int] = None
    intermediate_size: Optional[int] = None
    total_ut_steps: Optional[int] = None  # T, the number of loops
    compute_dtype: ComputeDtype = "float32"  # sampler and every learner pass (params stay fp32)

    def _validate(self):
        for name in ("hidden_size", "num_layers", "num_heads", "intermediate_size",
                     "total_ut_steps"):
            v = getattr(self, name)
            self._require(v is None or v >= 1, name, "a positive int or none")


@dataclasses.dataclass(frozen=True)
class TaskConfig(_Section):
    """Verifiable-reward task; train and held-out problems never overlap."""
    SECTION = "task"
    name: str = "arithmetic"
    train_datasets: tuple[str, ...] = ("chain_sum", "basic_arithmetic")
    eval_datasets: tuple[str, ...] = ("chain_sum", "basic_arithmetic")
    difficulty: str = "easy"              # task-defined difficulty label of the training mix
    eval_difficulty: str = "easy"         # the held-out mix may be harder than training's
    data_seed: int = 0                    # problem generation (the run seed is run.seed)
    train_size: int = 20_000              # problems in the training pool
    max_prompt_tokens: int = 64
    # arithmetic knobs (inclusive lo,hi ranges; see looprl.tasks.arithmetic): the warm start
    # trains on train_terms/train_digits, the held-out set is eval_terms/eval_digits, and GRPO
    # trains on rl_terms/rl_digits (none: the held-out mix, never its problems)
    train_terms: tuple[int, ...] = (2, 3)
    train_digits: tuple[int, ...] = (1, 2)
    eval_terms: tuple[int, ...] = (2, 4)
    eval_digits: tuple[int, ...] = (1, 2)
    rl_terms: Optional[tuple[int, ...]] = None
    rl_digits: Optional[tuple[int, ...]] = None
    eval_size: int = 1000                 # held-out set size (train streams exclude all of it)
    solution_style: Optional[str] = None  # arithmetic: 'steps' (chain_sum) or 'answer'; none:
                                          # the task's default ('steps' for chain_sum)
    spaces: bool = True                   # arithmetic: `12 + 7` (true) or `12+7` (false)
    prompt_style: Optional[PromptStyle] = None  # none: the task's default (arithmetic 'compact',
                                          # gsm8k 'chatml'; 'thinking' for Ouro Thinking models)
    # gsm8k knobs (looprl.tasks.gsm8k): held-out set = test.jsonl in file order (its first
    # eval.eval_problems), train stream = train.jsonl in seeded epochs (seed data_seed)
    data_dir: str = "../shared/data/gsm8k"  # relative: to the working directory, else the repo root
    source: TaskSource = "jsonl"          # 'hub': openai/gsm8k through the `datasets` package
    # math knobs (looprl.tasks.math_jsonl; data_dir as above): file names (none: train.jsonl,
    # test.jsonl), record field names, inclusive level bounds (none: no bound)
    train_file: Optional[str] = None
    eval_file: Optional[str] = None
    problem_key: str = "problem"
    answer_key: str = "answer"
    level_key: str = "level"
    min_level: Optional[float] = None
    max_level: Optional[float] = None

    def _validate(self):
        self._require(len(self.train_datasets) > 0, "train_datasets", "at least one dataset")
        self._require(len(self.eval_datasets) > 0, "eval_datasets", "at least one dataset")
        self._require(self.train_size >= 1, "train_size", "a positive int")
        self._require(self.max_prompt_tokens >= 1, "max_prompt_tokens", "a positive int")
        for name in ("train_terms", "train_digits", "eval_terms", "eval_digits", "rl_terms",
                     "rl_digits"):
            v = getattr(self, name)
            self._require(v is None or (len(v) == 2 and 1 <= v[0] <= v[1]), name,
                          "two ints lo,hi with 1 <= lo <= hi")
        self._require(self.eval_size >= 1, "eval_size", "a positive int")
        self._require(self.solution_style in (None, "steps", "answer"), "solution_style",
                      "'steps', 'answer' or none")
        self._require(len(self.data_dir) > 0, "data_dir", "a non-empty path")
        self._require(self.min_level is None or self.max_level is None
                      or self.min_level <= self.max_level, "min_level", "<= max_level")


@dataclasses.dataclass(frozen=True)
class WarmStartConfig(_Section):
    """Supervised warm start: Ouro stage I (LM + gate) until held-out accuracy plateaus, then
    stage II (gate only). Skipped when `enabled` is false (e.g. model.checkpoint given)."""
    SECTION = "warm_start"
    enabled: bool = True
    max_steps: int = 3000                 # stage-I optimizer steps at most
    batch_size: int = 64                  # sequences per stage-I/II step
    learning_rate: float = 1e-3
    entropy_beta: float = 0.0             # beta of stage I: sum_t p_t CE_t - beta H(p)
    eval_every_steps: int = 200
    eval_problems: int = 200              # held-out problems per plateau check
    plateau_last_fraction: float = 0.2    # plateaued when the last fifth of the curve ...
    plateau_min_gain: float = 0.02        # ... gains less than this accuracy (a fraction)
    plateau_min_evals: int = 5            # judged once the curve has this many points
    gate_steps: int = 300                 # stage-II steps (LM frozen)
    gate_learning_rate: float = 1e-3

    def _validate(self):
        for name in ("max_steps", "batch_size", "eval_every_steps", "eval_problems",
                     "plateau_min_evals"):
            self._require(getattr(self, name) >= 1, name, "a positive int")
        self._require(self.gate_steps >= 0, "gate_steps", "an int >= 0")
        self._require(self.learning_rate > 0, "learning_rate", "a float > 0")
        self._require(self.gate_learning_rate > 0, "gate_learning_rate", "a float > 0")
        self._require(self.entropy_beta >= 0, "entropy_beta", "a float >= 0")
        self._require(0 < self.plateau_last_fraction < 1, "plateau_last_fraction",
                      "a float in (0, 1)")


@dataclasses.dataclass(frozen=True)
class RolloutConfig(_Section):
    """The sampler: groups of `group_size` samples for each of `prompts_per_step` prompts."""
    SECTION = "rollout"
    prompts_per_step: int = 16            # prompts (groups) per GRPO step
    group_size: int = 8                   # G, samples per prompt
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0                    # 1.0: off (RL samples untruncated by default)
    top_k: int = 0                        # 0: off
    exit_threshold: float = 0.9           # q of the Q-exit rule; 1.0 = always loop T
    fixed_depth: Optional[int] = None     # exit at this loop instead of the Q-exit rule (the
                                          # old key `fixed_exit_loop` is read as this: RENAMED)
    kv_policy: KVPolicy = "dense"
    kernels: Kernels = "invariant"        # sampler kernels; "stock" needs learner.replay_impl
                                          # forced (or auto): its bits have no invariant replay
    deferred_max_pending: Optional[int] = None  # deferred: pending positions before a flush;
                                          # none: automatic (by rows per device, 0 from 16 rows:
                                          # sampling/kv_policies.auto_max_pending)
    prompt_len_multiple: int = 1          # left-pad prompts to a multiple of this many tokens, so
                                          # steps with different prompts share compiled shapes
    noise_keying: NoiseKeying = "completion"  # sampling noise keyed by the token's index in its
                                          # completion ("layout": by padded position, the keying
                                          # of older runs; a config file without this key means
                                          # "layout", and a resumed run keeps its own)
    # the thinking budget (looprl/sampling/thinking.py; none: off): completion tokens before the
    # forced answer, one int or lo,hi (one budget per step drawn in [lo, hi] from the run seed);
    # a completion that has not emitted think_close_text by then gets forced_answer_text
    # teacher-forced, then at most answer_budget sampled tokens
    thinking_budget: Optional[tuple[int, ...]] = None
    answer_budget: int = 32
    forced_answer_text: str = "\n</think>\n\nThe final answer is "
    think_close_text: str = "</think>"

    @property
    def sequences_per_step(self) -> int:
        return self.prompts_per_step * self.group_size

    def _validate(self):
        for name in ("prompts_per_step", "group_size", "max_new_tokens", "prompt_len_multiple"):
            self._require(getattr(self, name) >= 1, name, "a positive int")
        self._require(self.deferred_max_pending is None or self.deferred_max_pending >= 0,
                      "deferred_max_pending", "an int >= 0 or none (automatic)")
        self._require(self.temperature > 0, "temperature", "a float > 0")
        self._require(0 < self.top_p <= 1, "top_p", "a float in (0, 1]")
        self._require(self.top_k >= 0, "top_k", "an int >= 0 (0 = off)")
        self._require(0 < self.exit_threshold <= 1, "exit_threshold", "a float in (0, 1]")
        self._require(self.fixed_depth is None or self.fixed_depth >= 1,
                      "fixed_depth", "an int >= 1 or none")
        tb = self.thinking_budget
        self._require(tb is None or (len(tb) in (1, 2) and 1 <= tb[0] <= tb[-1]),
                      "thinking_budget", "none, an int >= 1, or lo,hi with 1 <= lo <= hi")
        self._require(tb is None or (self.answer_budget >= 1 and self.forced_answer_text != ""
                                     and self.think_close_text != ""), "answer_budget",
                      "an int >= 1, with non-empty forced_answer_text and think_close_text")


@dataclasses.dataclass(frozen=True)
class LearnerConfig(_Section):
    """How the learner computes log-probs and splits the rollout batch into updates."""
    SECTION = "learner"
    logprob_method: LogprobMethod = "hybrid"  # replay alone has no gradient: not for training;
    # full_depth / expected ignore the schedule: baselines of what common frameworks compute
    # (looprl.logprobs.methods; experiments/mismatch_study.py)
    # the PPO ratio's old log-probs: "sampler" = the rollout's recorded ones; "recompute" = the
    # learner's own method at the rollout's parameters, once per rollout (as veRL/TRL do; TIS,
    # grpo.tis_cap, then reweights by min(pi_old / pi_sampler, cap))
    old_logprobs: OldLogprobs = "sampler"
    # where the replay value (hybrid's value, replay_exact_fraction) comes from: "invariant" =
    # the row-invariant dense pass (free; exact on XLA CPU); "forced" = the sampler re-run in
    # forced mode on the recorded schedule (one re-run per extra update; exact wherever the
    # sampler is deterministic); "auto" = invariant on CPU with invariant sampler kernels and
    # on a device kind whose committed report shows it exact (`looprl.rl.replay_choice`),
    # forced otherwise (docs/DESIGN.md §4)
    replay_impl: ReplayImpl = "auto"
    ppo_epochs: int = 1                   # passes over each rollout batch
    minibatches: int = 1                  # optimizer updates per epoch
    microbatch_size: int = 0              # sequences per forward/backward; 0 = whole minibatch
    train_gate: bool = False              # add the stage-II gate loss (gate frozen otherwise)
    gate_loss_coef: float = 1.0
    measure_stock: bool = True            # also run `stock` to log stock_max_abs_diff
    # stop the run (TrainingError) at the first GRPO step whose replay_exact_fraction < 1.0;
    # none = auto: true where exactness is claimed (XLA CPU, rollout.kernels=invariant and
    # replay_impl resolving to invariant: `looprl.rl.replay_choice.resolve_require_exact`), else false
    # (an inexact step then only warns on the console and is counted in summary.json)
    require_exact: Optional[bool] = None
    # GRPO steps between replay checks: a check re-runs the replay at the sampler's parameters
    # and compares it with the recorded log-probs bit for bit (replay_exact_fraction, logged only
    # on the steps it was measured). Between checks the first update's replay value is the
    # recorded log-prob itself (what replay means at the sampler's own parameters), which saves
    # the forced re-run of `replay_impl=forced` there; 0 = never check
    replay_check_every: int = 1
    # the learner's passes run on the rollout batch's live prefix: P + its longest completion
    # rounded up to a multiple of this many positions (at most P + max_new_tokens), the same
    # bits at every emitting position (`looprl.logprobs.methods.live_seq_len`); the stock
    # control runs there too (its bits may change with the length); bounds the compiled
    # lengths to max_new_tokens / seq_bucket + 1; 0 = always the whole layout
    seq_bucket: int = 64

    def _validate(self):
        self._require(self.logprob_method != "replay", "logprob_method",
                      "'hybrid', 'dense', 'stock', 'full_depth' or 'expected' ('replay' is "
                      "stop-gradient: no gradient)")
        self._require(self.ppo_epochs >= 1, "ppo_epochs", "a positive int")
        self._require(self.minibatches >= 1, "minibatches", "a positive int")
        self._require(self.microbatch_size >= 0, "microbatch_size", "an int >= 0")
        self._require(self.replay_check_every >= 0, "replay_check_every", "an int >= 0")
        self._require(self.seq_bucket >= 0, "seq_bucket", "an int >= 0 (0 = off)")
        self._require(self.gate_loss_coef >= 0, "gate_loss_coef", "a float >= 0")


GRPOLoss = Literal["ppo-clip", "cispo", "gspo", "gspo-token"]
ScaleRewards = Literal["group", "batch", "none"]


@dataclasses.dataclass(frozen=True)
class GRPOConfig(_Section):
    """The objective (`looprl.rl.grpo`, `looprl.rl.losses`, `looprl.rl.signal`)."""
    SECTION = "grpo"
    loss: GRPOLoss = "ppo-clip"           # the policy loss (looprl.rl.losses)
    eps_low: float = 0.2                  # ratio clipped to [1 - eps_low, 1 + eps_high]
    eps_high: float = 0.28
    cispo_clip_low: Optional[float] = None  # cispo: importance weight >= this; none = no bound
    cispo_clip_high: float = 5.0          # cispo: importance weight <= this
    loss_agg: LossAgg = "token-mean"
    scale_rewards: ScaleRewards = "group"  # advantage divided by the group's std, batch's, none
    scale_adv_by_std: bool = True         # false = scale_rewards none (Dr.GRPO with dr-grpo)
    adv_std_floor: float = 1e-6
    mask_truncated: bool = False          # completions cut by the length limit leave the loss
    skip_zero_advantage_steps: bool = True  # no signal: params and optimizer state untouched
    dynamic_sampling: bool = False        # DAPO: equal-reward groups dropped, batch refilled
    dynamic_sampling_max_batches: int = 3  # rounds of prompts_per_step prompts at most
    token_entropy: bool = True            # metric token_entropy: one more pass per step
    kl_beta: float = 0.0                  # k3 KL to the frozen reference (warm-started) policy
    tis_cap: Optional[float] = None       # truncated importance sampling cap C; none = off
    loop_credit: LoopCredit = "none"      # RLTT loop credit
    loop_credit_alpha: float = 1.0        # exponent of `progressive`

    def _validate(self):
        self._require(self.dynamic_sampling_max_batches >= 1, "dynamic_sampling_max_batches",
                      "an int >= 1")
        self._require(self.cispo_clip_high > 0, "cispo_clip_high", "a float > 0")
        self._require(self.cispo_clip_low is None or 0 <= self.cispo_clip_low
                      < self.cispo_clip_high, "cispo_clip_low",
                      "none or a float in [0, cispo_clip_high)")
        self._require(self.scale_adv_by_std or self.scale_rewards == "group", "scale_adv_by_std",
                      "true unless scale_rewards is group (false means scale_rewards none)")
        self._require(0 <= self.eps_low < 1, "eps_low", "a float in [0, 1)")
        self._require(self.eps_high >= 0, "eps_high", "a float >= 0")
        self._require(self.adv_std_floor >= 0, "adv_std_floor", "a float >= 0")
        self._require(self.kl_beta >= 0, "kl_beta", "a float >= 0")
        self._require(self.tis_cap is None or self.tis_cap > 0, "tis_cap", "a float > 0 or none")


@dataclasses.dataclass(frozen=True)
class OptimConfig(_Section):
    """optax AdamW with global-norm clipping and a learning-rate schedule (GRPO updates)."""
    SECTION = "optim"
    learning_rate: float = 1e-4
    weight_decay: float = 0.0
    adam_b1: float = 0.9
    adam_b2: float = 0.999
    adam_eps: float = 1e-8
    max_grad_norm: float = 1.0            # 0 = no clipping
    warmup_steps: int = 0                 # optimizer updates
    lr_schedule: LrSchedule = "constant"

    def _validate(self):
        self._require(self.learning_rate > 0, "learning_rate", "a float > 0")
        self._require(self.weight_decay >= 0, "weight_decay", "a float >= 0")
        self._require(0 <= self.adam_b1 < 1, "adam_b1", "a float in [0, 1)")
        self._require(0 <= self.adam_b2 < 1, "adam_b2", "a float in [0, 1)")
        self._require(self.adam_eps > 0, "adam_eps", "a float > 0")
        self._require(self.max_grad_norm >= 0, "max_grad_norm", "a float >= 0")
        self._require(self.warmup_steps >= 0, "warmup_steps", "an int >= 0")


@dataclasses.dataclass(frozen=True)
class EvalConfig(_Section):
    """Held-out evaluation before GRPO (after warm start) and after, at the run's q."""
    SECTION = "eval"
    eval_problems: int = 500
    greedy: bool = True
    eval_batch_size: int = 128
    eval_every_steps: int = 0             # also during GRPO; 0 = only before and after

    def _validate(self):
        self._require(self.eval_problems >= 1, "eval_problems", "a positive int")
        self._require(self.eval_batch_size >= 1, "eval_batch_size", "a positive int")
        self._require(self.eval_every_steps >= 0, "eval_every_steps", "an int >= 0")


@dataclasses.dataclass(frozen=True)
class RunConfig(_Section):
    """Where and how long a run goes (docs/DESIGN.md §6)."""
    SECTION = "run"
    out_dir: str = "runs/default"
    seed: int = 0
    grpo_steps: int = 100
    stop_after: Optional[int] = None      # stop after this many GRPO steps (resume later)
    resume: Optional[str] = None          # RUN_DIR to continue in place (out_dir = RUN_DIR)
    checkpoint_every_steps: int = 25
    keep_checkpoints: int = 2
    tensorboard: bool = True
    progress_bar: bool = True

    def _validate(self):
        self._require(len(self.out_dir) > 0, "out_dir", "a non-empty path")
        self._require(self.grpo_steps >= 0, "grpo_steps", "an int >= 0")
        self._require(self.stop_after is None or self.stop_after >= 0, "stop_after",
                      "an int >= 0 or none")
        self._require(self.checkpoint_every_steps >= 1, "checkpoint_every_steps", "a positive int")
        self._require(self.keep_checkpoints >= 1, "keep_checkpoints", "a positive int")
        self._require(self.resume is None or len(self.resume) > 0, "resume",
                      "a run directory or none")


@dataclasses.dataclass(frozen=True)
class MeshConfig(_Section):
    """The device mesh (`looprl.distributed.mesh`): axis sizes, -1 = the rest of the devices.

    Rows of every batch (rollout, learner, KV cache) are split over `data` x `fsdp`; parameters
    and optimizer state are stored sharded over `fsdp` (largest divisible non-contraction axis)
    and all-gathered before use, so no contraction axis is ever split and each device runs the
    one-device program on its rows. The default is pure data parallelism over every visible
    device, which on one device is the unsharded program. `tensor` > 1 (sharded contractions)
    is not implemented: it would change reduction order and void the bit-exact replay."""
    SECTION = "mesh"
    data: int = -1
    fsdp: int = 1
    tensor: int = 1

    def _validate(self):
        for name in ("data", "fsdp"):
            self._require(getattr(self, name) == -1 or getattr(self, name) >= 1, name,
                          "a positive int or -1 (the rest of the devices)")
        self._require(not (self.data == -1 and self.fsdp == -1), "fsdp",
                      "at most one of mesh.data / mesh.fsdp set to -1")
        self._require(self.tensor == 1, "tensor",
                      "1 (tensor parallelism shards contraction axes, which changes reduction "
                      "order and voids the bit-exact replay; not implemented)")


@dataclasses.dataclass(frozen=True)
class ExperimentConfig(_Section):
    """One experiment: all sections, checked together for cross-section consistency."""
    name: str = "default"
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    task: TaskConfig = dataclasses.field(default_factory=TaskConfig)
    warm_start: WarmStartConfig = dataclasses.field(default_factory=WarmStartConfig)
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    learner: LearnerConfig = dataclasses.field(default_factory=LearnerConfig)
    grpo: GRPOConfig = dataclasses.field(default_factory=GRPOConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    run: RunConfig = dataclasses.field(default_factory=RunConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)

    def _validate(self):
        B = self.rollout.sequences_per_step
        if B % self.learner.minibatches:
            raise ConfigError(
                f"config key 'learner.minibatches': expected a divisor of rollout.prompts_per_step"
                f" * rollout.group_size = {B}, found {self.learner.minibatches}")
        mb = B // self.learner.minibatches
        if self.learner.microbatch_size and mb % self.learner.microbatch_size:
            raise ConfigError(
                f"config key 'learner.microbatch_size': expected a divisor of the minibatch size "
                f"{mb}, found {self.learner.microbatch_size}")
        T = self.model.total_ut_steps
        if T is not None and self.rollout.fixed_depth is not None and \
                self.rollout.fixed_depth > T:
            raise ConfigError(f"config key 'rollout.fixed_depth': expected an int in [1, {T}] "
                              f"(model.total_ut_steps), found {self.rollout.fixed_depth}")
        if self.rollout.kernels == "stock" and self.learner.replay_impl == "invariant":
            raise ConfigError("config key 'learner.replay_impl': 'invariant' cannot reproduce a "
                              "sampler run with rollout.kernels='stock'; use 'forced' or 'auto'")
