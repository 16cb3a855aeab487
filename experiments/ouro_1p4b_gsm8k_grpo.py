"""GRPO on GSM8K for the released Ouro-1.4B (a GPU/TPU job; see docs/GUIDE.md "Running the real Ouro
configs"). Nothing here has been run at this scale yet: no figures are claimed.

Needs a converted checkpoint (the weights are not downloadable from this repository):

    looprl convert --hf /path/to/Ouro-1.4B --out ckpts/ouro-1.4b
    XLA_FLAGS=--xla_gpu_deterministic_ops=true \\
        looprl train experiments/ouro_1p4b_gsm8k_grpo.py model.checkpoint=ckpts/ouro-1.4b

Without `model.checkpoint=` the run stops at once with a ConfigError (GSM8K has no tokenizer of
its own; the checkpoint's tokenizer.json is used). For the Thinking model add
`task.prompt_style=thinking` (the prompt then ends with `<think>\\n`) and raise
`rollout.max_new_tokens`.

Settings and where they come from:
  * model: parameters stay fp32 (master weights, DESIGN.md §2); the sampler and every learner pass
    compute in bf16 (`model.compute_dtype`), the precision the released checkpoints ship in.
  * rollout: Q-exit rule at q = 0.9, `kv_policy=deferred` (exited positions' deeper loops run
    later, grouped with the next position that needs them: the same math as dense, DESIGN.md §3).
    q = 0.9 is a stated choice, not a tuned value: close enough to 1 that the model, trained to run
    all T = 4 loops, mostly keeps its depth, while the gate's early exits (and so the recorded
    schedule and the deferred flushes the learner must replay) are exercised. The run also
    evaluates at q = 1.0 before GRPO (`summary.json: eval_before_q1`), which shows what the exit
    costs; sweep q with `looprl eval --exit-threshold 0.5,0.7,0.9,1.0` to choose another.
    Temperature 1, top-p/top-k off: the recorded log-prob is then the behaviour probability.
    Group size 8 and 16 prompts per step (128 completions); up to 512 new tokens (GSM8K
    solutions of instruct models are mostly far shorter; verl's GSM8K GRPO quick-start allows 1024).
    Prompts are left-padded to a multiple of 64 tokens: every compiled shape (sampler and learner)
    depends on the prompt length, so without it nearly every step would compile anew.
  * learner: `hybrid` log-probs (value = replay of the recorded schedule, gradient = dense), two
    optimizer updates per step (minibatches of 64), microbatches of 8 sequences to bound memory
    (lower it if the backward pass does not fit).
  * objective: PPO-clip with DAPO's clip-higher (eps_low 0.2, eps_high 0.28) and token-mean loss
    aggregation (DAPO, arXiv:2503.14476); k3 KL to the starting checkpoint with coefficient 0.001,
    as in verl's GSM8K GRPO example (`kl_loss_type=low_var_kl`, `kl_loss_coef=0.001`).
  * optimizer: AdamW, learning rate 1e-6 (verl's GSM8K GRPO example), global-norm clip 1.0.
  * evaluation: greedy pass@1 on the whole GSM8K test set (1319 problems) before and after GRPO.
"""
from looprl.config import (EvalConfig, ExperimentConfig, GRPOConfig, LearnerConfig, ModelConfig,
                           OptimConfig, RolloutConfig, RunConfig, TaskConfig, WarmStartConfig)

CONFIG = ExperimentConfig(
    name="ouro_1p4b_gsm8k_grpo",
    # checkpoint: required on the command line (model.checkpoint=CKPT); None fails clearly
    model=ModelConfig(preset="ouro-1.4b", checkpoint=None, compute_dtype="bfloat16"),
    task=TaskConfig(name="gsm8k", data_dir="../shared/data/gsm8k", source="jsonl",
                    prompt_style="chatml", data_seed=0),
    warm_start=WarmStartConfig(enabled=False),   # GRPO starts from the released weights
    rollout=RolloutConfig(prompts_per_step=16, group_size=8, max_new_tokens=512,
                          temperature=1.0, top_p=1.0, top_k=0, exit_threshold=0.9,
                          kv_policy="deferred", deferred_max_pending=4,  # pinned: postpones
                          # at any batch (the automatic bound, none, is 0 from 16 rows per
                          # device, where postponing cost more than dense on a CPU:
                          # benchmarks/deferred_window.py; measure the GPU's before choosing)
                          prompt_len_multiple=64),
    learner=LearnerConfig(logprob_method="hybrid", ppo_epochs=1, minibatches=2,
                          microbatch_size=8, train_gate=False, measure_stock=True),
    grpo=GRPOConfig(eps_low=0.2, eps_high=0.28, loss_agg="token-mean", scale_adv_by_std=True,
                    kl_beta=0.001),
    optim=OptimConfig(learning_rate=1e-6, weight_decay=0.0, max_grad_norm=1.0,
                      lr_schedule="constant"),
    eval=EvalConfig(eval_problems=1319, greedy=True, eval_batch_size=64),
    run=RunConfig(out_dir="runs/ouro_1p4b_gsm8k_grpo", seed=0, grpo_steps=200,
                  checkpoint_every_steps=25, keep_checkpoints=2, progress_bar=True),
)
