"""Does the sampler-learner mismatch hurt looped-model RL, and does exact replay fix it? Ten
seeds, four arms, 300 GRPO steps, each seed from its own warm start; the statistics are over
seeds (`experiments/analysis/seed_stats.py`).

The setting is the long-completion task of `mismatch_study_long.py` (4-term chain sums with the
running partial sums written out, >= 24 tokens), bf16 compute, 16 prompts x 8 samples per step,
temperature 1. The three mismatch arms sample with the Q-exit rule at q = 0.6 and `copy` KV (an
approximation the schedule-unaware learner cannot see). Arms (identical hyper-parameters):
  hybrid      replay's value, dense gradient (exact: the ratio is 1 at the first update)
  stock       the recorded schedule with plain kernels (round-off only, about 1e-6 nats)
  full_depth  loop T everywhere, dense KV, old log-probs recomputed by the learner
  control     the same full_depth learner and PPO-clip loss with a sampler that runs every loop
              with dense KV (q = 1): no mismatch at all, so (full_depth, control) isolates it

Pre-registered, written before any run of this file (experiments/README.md, "Ten seeds"):
  task         as above; held-out set of 600 4-term sums, all evaluated (greedy), at the
               training q and at q = 1, warm start and final checkpoint
  optimizer    AdamW, lr 2e-4, grad-norm clip 1.0; PPO-clip [0.8, 1.28], token-mean, no KL
  updates      4 minibatches x 1 epoch per rollout (4 updates; the earlier studies took 4 x 2)
  steps        300; all ten seeds reported, none dropped
  outcome      final held-out accuracy at the arm's training q; contrasts per seed, a
               t-interval, d_z, an exact sign-flip test and Holm's correction (seed_stats.py)
  expectation  `hybrid` gains >= 5 points over its warm start on average and does not collapse

Why this setting. At 4 x 2 updates, bf16 and `copy` KV, `hybrid` gained 5.3 points in 300 steps
(0.145 -> 0.198, three seeds) with its rollout reward still rising at step 300; at 4 x 4 it
gained 0.2 (0.145 -> 0.147): more updates per rollout cost the exact learner its gain. In
the loss study one update per rollout learned as fast over 30 steps as 4 x 2 (0.290 against
0.315). So one epoch is the knob the evidence supports: it keeps most of each rollout's
learning, keeps three stale minibatches per rollout (the ratio and the clip still act), and
halves the learner's time. The learning rate stays at 2e-4, the rate under which `hybrid`
learned at 300 steps; a lower one would need more steps than the grid holds.

    looprl train experiments/mismatch_replication.py seed=0 out_dir=runs/replication/seed0
    python experiments/analysis/collect_replication.py runs/replication/seed0 --seed 0

(seeds 0-9; a stopped seed continues with the same command and resume=runs/replication/seedS).
The pilot that sized the grid and the grid's cost: experiments/README.md, "Ten seeds".
"""
from mismatch_study_long import CONFIG as LONG

SHARED_WARM_START = True  # one warm start per seed, shared by the seed's four arms

CONFIG = LONG.replace(
    name="mismatch_replication",
    model=LONG.model.replace(compute_dtype="bfloat16"),
    task=LONG.task.replace(eval_size=600),
    rollout=LONG.rollout.replace(kv_policy="copy"),
    learner=LONG.learner.replace(logprob_method="hybrid", minibatches=4, ppo_epochs=1),
    grpo=LONG.grpo.replace(loss="ppo-clip"),
    eval=LONG.eval.replace(eval_problems=600, eval_batch_size=300, eval_every_steps=100),
    run=LONG.run.replace(out_dir="runs/replication", grpo_steps=300, checkpoint_every_steps=25,
                         keep_checkpoints=2),
)

_RECOMPUTE = ["learner.logprob_method=full_depth", "learner.old_logprobs=recompute"]
VARIANTS = {
    "hybrid": ["learner.logprob_method=hybrid"],
    "stock": ["learner.logprob_method=stock"],
    "full_depth": _RECOMPUTE,
    "control": [*_RECOMPUTE, "rollout.exit_threshold=1.0", "rollout.kv_policy=dense"],
}
