"""Does the sampler-learner mismatch hurt looped-model RL over hundreds of steps? The
long-completion task of `mismatch_study_long.py` where the mismatch is largest: bf16, `copy` KV
at q = 0.6 (an approximation the schedule-unaware learners cannot see), 4 minibatches x 2
epochs per rollout. Learners (experiments/README.md, "Does the mismatch matter?"):
  hybrid              replay's value, dense gradient (looprl; exact)
  full_depth          loop T everywhere, dense KV, old log-probs recomputed by the learner
  full_depth_tis      the same with truncated importance sampling against the sampler (cap 2)
  expected            HF Ouro's exit-distribution mixture of logits, old log-probs recomputed
  cispo_full_depth    full_depth with the CISPO loss (truncation at 5.0)
  ouro_public         the public Ouro GRPO recipe: a sampler that runs every loop (q = 1, as
                      vLLM's Ouro does) and a full-depth learner with recomputed old log-probs,
                      CISPO at 5.0 and batch-level reward scaling
Each seed shares one warm start (the long study's) across variants; runs resume bit for bit
(`looprl train RUN/NAME/config.json resume=RUN/NAME`), so a grid may span sessions.

    looprl train experiments/mismatch_horizon.py seed=0 out_dir=runs/horizon/seed0 \
        model.checkpoint=runs/loss_study/seed0/warm_start_run/warm_start warm_start.enabled=false

(the study's runs start from the loss study's warm starts; without the last two overrides the
file's own shared warm start runs first).
"""
from mismatch_study_long import CONFIG as LONG
from mismatch_study_long import SHARED_WARM_START  # noqa: F401

CONFIG = LONG.replace(
    name="mismatch_horizon",
    model=LONG.model.replace(compute_dtype="bfloat16"),
    rollout=LONG.rollout.replace(kv_policy="copy"),
    eval=LONG.eval.replace(eval_every_steps=50),
    run=LONG.run.replace(out_dir="runs/horizon", grpo_steps=300, checkpoint_every_steps=25,
                         keep_checkpoints=2),
)

_RECOMPUTE = ["learner.old_logprobs=recompute"]
VARIANTS = {
    "hybrid": ["learner.logprob_method=hybrid"],
    "full_depth": ["learner.logprob_method=full_depth", *_RECOMPUTE],
    "full_depth_tis": ["learner.logprob_method=full_depth", *_RECOMPUTE, "grpo.tis_cap=2.0"],
    "expected": ["learner.logprob_method=expected", *_RECOMPUTE],
    "cispo_full_depth": ["learner.logprob_method=full_depth", *_RECOMPUTE, "grpo.loss=cispo"],
    "ouro_public": ["rollout.exit_threshold=1.0", "rollout.kv_policy=dense",
                    "learner.logprob_method=full_depth", *_RECOMPUTE, "grpo.loss=cispo",
                    "grpo.scale_rewards=batch"],
}
