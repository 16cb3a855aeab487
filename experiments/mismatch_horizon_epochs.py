"""The horizon study's second off-policy setting: 4 minibatches x 4 epochs per rollout (twice the
updates of `mismatch_horizon.py`, so the late minibatches are further from the policy that
sampled them), everything else as there: bf16, `copy` KV at q = 0.6, the long-completion task,
300 GRPO steps. Learners: `hybrid`, `full_depth` + recompute, the same + TIS (cap 2).

    looprl train experiments/mismatch_horizon_epochs.py seed=0 out_dir=runs/horizon_epochs/seed0 \
        model.checkpoint=runs/loss_study/seed0/warm_start_run/warm_start warm_start.enabled=false
"""
from mismatch_horizon import CONFIG as HORIZON
from mismatch_horizon import SHARED_WARM_START  # noqa: F401
from mismatch_horizon import VARIANTS as _ALL

CONFIG = HORIZON.replace(
    name="mismatch_horizon_epochs",
    learner=HORIZON.learner.replace(ppo_epochs=4),
    run=HORIZON.run.replace(out_dir="runs/horizon_epochs"),
)

VARIANTS = {k: _ALL[k] for k in ("hybrid", "full_depth", "full_depth_tis")}
