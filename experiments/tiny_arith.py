"""The main job: a tiny looped model learns chain sums on a 2-core CPU, then GRPO.

Task: reasoning-gym `chain_sum`, 1-digit operands, no spaces, answer-only completions
(`<|im_start|>5-7+3+1<|im_end|><|im_start|>` -> `=2<|im_end|>`): short sequences, so the warm
start learns fast and rollouts are cheap. The warm start sees 2- and 3-term sums; the held-out
set (and GRPO's training mix, never its problems) is 3- and 4-term sums, so 4-term sums are
longer than anything the warm start saw: that is RL's room.

Model: hidden 64, 1 layer, 2 heads, T = 4 loops. The warm start (Ouro stage I with entropy
beta 0.1, then stage II) runs until held-out accuracy plateaus (its last fifth gains < 2 points).
q = 0.6: measured mean exit loop and accuracy against q = 1.0 are in experiments/README.md.

    looprl train experiments/tiny_arith.py            # out_dir runs/tiny_arith, seed 0
"""
from looprl.config import (EvalConfig, ExperimentConfig, GRPOConfig, LearnerConfig, ModelConfig,
                           OptimConfig, RolloutConfig, RunConfig, TaskConfig, WarmStartConfig)

CONFIG = ExperimentConfig(
    name="tiny_arith",
    model=ModelConfig(preset="tiny", hidden_size=64, num_layers=1, num_heads=2,
                      intermediate_size=128, total_ut_steps=4),
    task=TaskConfig(train_datasets=("chain_sum",), eval_datasets=("chain_sum",),
                    train_terms=(2, 3), train_digits=(1, 1), eval_terms=(3, 4),
                    eval_digits=(1, 1), eval_size=600, solution_style="answer", spaces=False,
                    max_prompt_tokens=32),
    warm_start=WarmStartConfig(max_steps=4000, batch_size=64, learning_rate=3e-3,
                               entropy_beta=0.1, eval_every_steps=100, eval_problems=500,
                               plateau_min_evals=15,
                               gate_steps=100, gate_learning_rate=1e-3),
    rollout=RolloutConfig(prompts_per_step=32, group_size=8, max_new_tokens=5, temperature=1.0,
                          exit_threshold=0.6, kv_policy="deferred"),
    learner=LearnerConfig(logprob_method="hybrid", minibatches=2),
    grpo=GRPOConfig(eps_low=0.2, eps_high=0.28, loss_agg="token-mean"),
    optim=OptimConfig(learning_rate=2e-4, max_grad_norm=1.0),
    eval=EvalConfig(eval_problems=500, eval_batch_size=250),
    run=RunConfig(out_dir="runs/tiny_arith", seed=0, grpo_steps=120, progress_bar=True),
)
