"""The policy losses side by side on the long-completion task: PPO-clip (looprl's default),
CISPO (MiniMax-M1, arXiv 2506.13585; the Ouro GRPO trainer's default, truncation at 5.0) and
GSPO (arXiv 2507.18071; sequence ratio clipped to [1 - 3e-4, 1 + 4e-4], the paper's range),
each with the `hybrid` learner, so the log-probs equal the sampler's and only the loss differs.
Everything else is `mismatch_study_long.py`: deferred KV at q = 0.6, fp32, 4 minibatches x 2
epochs per rollout (so the ratios leave 1 and the clipping acts), 30 GRPO steps from one shared
warm start per seed; and CISPO with one update per rollout, as the Ouro trainer runs it.

    looprl train experiments/loss_study.py seed=0 out_dir=runs/loss_study/seed0
"""
from mismatch_study_long import CONFIG as LONG
from mismatch_study_long import SHARED_WARM_START  # noqa: F401

CONFIG = LONG.replace(
    name="loss_study",
    rollout=LONG.rollout.replace(kv_policy="deferred"),
    learner=LONG.learner.replace(logprob_method="hybrid"),
    run=LONG.run.replace(out_dir="runs/loss_study"),
)

VARIANTS = {
    "ppo_clip": ["grpo.loss=ppo-clip"],
    "cispo": ["grpo.loss=cispo", "grpo.cispo_clip_high=5.0"],
    "gspo": ["grpo.loss=gspo", "grpo.eps_low=3e-4", "grpo.eps_high=4e-4"],
    # the Ouro trainer's schedule: one update per rollout (mu = 1), where CISPO's gradient is
    # PPO-clip's (every ratio is exactly 1 under exact replay)
    "cispo_mu1": ["grpo.loss=cispo", "learner.minibatches=1", "learner.ppo_epochs=1"],
}
