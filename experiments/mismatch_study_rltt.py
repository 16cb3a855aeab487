"""The two RLTT loop-credit variants of `mismatch_study.py` alone (hybrid learner, deferred, fp32,
`grpo.loop_credit=exit_dist|progressive`), for the seeds run with `mismatch_study_fp32.py`: they
start from that seed's shared warm start, so they compare with its plain-GRPO `hybrid` run.

    looprl train experiments/mismatch_study_rltt.py seed=1 out_dir=runs/mismatch/short/seed1_rltt \
        model.checkpoint=runs/mismatch/short/seed1/warm_start_run/warm_start warm_start.enabled=false

`looprl plot --compare` reads a seed's variants from one directory: link the two run directories
into `runs/mismatch/short/seed1/` (or pass `seed1_rltt` as a seed directory of its own).
"""
from mismatch_study import CONFIG  # noqa: F401
from mismatch_study import VARIANTS as _ALL

VARIANTS = {k: v for k, v in _ALL.items() if "rltt" in k}
