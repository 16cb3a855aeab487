"""Smoke variant of the main job (tiny_arith.py): finishes in under a minute on 2 CPU cores with
at least 4 GRPO steps whose gradients are non-zero. Used by tests and determinism checks."""
from looprl.config import (EvalConfig, ExperimentConfig, GRPOConfig, LearnerConfig, ModelConfig,
                           OptimConfig, RolloutConfig, RunConfig, TaskConfig, WarmStartConfig)

CONFIG = ExperimentConfig(
    name="tiny_arith_smoke",
    model=ModelConfig(preset="tiny", hidden_size=64, num_layers=1, num_heads=2,
                      intermediate_size=128),
    task=TaskConfig(train_datasets=("chain_sum",), eval_datasets=("chain_sum",),
                    train_terms=(2, 2), train_digits=(1, 1), eval_terms=(2, 3),
                    eval_digits=(1, 1), eval_size=100),
    warm_start=WarmStartConfig(max_steps=20, batch_size=16, learning_rate=3e-3,
                               eval_every_steps=10, eval_problems=32, gate_steps=5,
                               entropy_beta=0.1),
    rollout=RolloutConfig(prompts_per_step=4, group_size=4, max_new_tokens=12,
                          exit_threshold=0.8, kv_policy="dense"),
    learner=LearnerConfig(minibatches=2, microbatch_size=4),
    grpo=GRPOConfig(),
    optim=OptimConfig(learning_rate=1e-3),
    eval=EvalConfig(eval_problems=64, eval_batch_size=64),
    run=RunConfig(out_dir="runs/tiny_arith_smoke", seed=0, grpo_steps=4, progress_bar=True),
)
