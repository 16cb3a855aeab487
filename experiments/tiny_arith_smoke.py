"""Smoke variant of the main job (tiny_arith.py): finishes in under a minute on 2 CPU cores with
at least 4 GRPO steps whose gradients are non-zero. Used by tests and determinism checks.

Same model and answer-only format as the main job, but a very short warm start (it learns the
`=N<|im_end|>` format, not yet the sums) and GRPO on 2-term sums at temperature 1.5, so that at
the start some samples of a group are right and some wrong (rewards vary within groups, hence
non-zero advantages and gradients). The held-out set is 3-term sums (so the 2-term train stream
keeps all its expressions)."""
from looprl.config import (EvalConfig, ExperimentConfig, GRPOConfig, LearnerConfig, ModelConfig,
                           OptimConfig, RolloutConfig, RunConfig, TaskConfig, WarmStartConfig)

CONFIG = ExperimentConfig(
    name="tiny_arith_smoke",
    model=ModelConfig(preset="tiny", hidden_size=64, num_layers=1, num_heads=2,
                      intermediate_size=128, total_ut_steps=4),
    task=TaskConfig(train_datasets=("chain_sum",), eval_datasets=("chain_sum",),
                    train_terms=(2, 2), train_digits=(1, 1), eval_terms=(3, 3),
                    eval_digits=(1, 1), rl_terms=(2, 2), rl_digits=(1, 1), eval_size=100,
                    solution_style="answer", spaces=False, max_prompt_tokens=32),
    warm_start=WarmStartConfig(max_steps=200, batch_size=32, learning_rate=3e-3,
                               eval_every_steps=50, eval_problems=32, gate_steps=10,
                               entropy_beta=0.1),
    rollout=RolloutConfig(prompts_per_step=16, group_size=8, max_new_tokens=5,
                          temperature=1.5, exit_threshold=0.6, kv_policy="deferred"),
    learner=LearnerConfig(minibatches=2, microbatch_size=16),
    grpo=GRPOConfig(),
    optim=OptimConfig(learning_rate=1e-3),
    eval=EvalConfig(eval_problems=64, eval_batch_size=64),
    run=RunConfig(out_dir="runs/tiny_arith_smoke", seed=0, grpo_steps=6, progress_bar=True),
)
