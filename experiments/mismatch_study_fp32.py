"""The fp32 grid of `mismatch_study.py` alone (10 variants: deferred/copy x hybrid, stock,
full_depth, full_depth_tis, expected), for extra seeds when the 2-core budget does not hold the
whole grid (18 variants) per seed; same CONFIG, so its runs compare with the full grid's.

    looprl train experiments/mismatch_study_fp32.py seed=1 out_dir=runs/mismatch/short/seed1
"""
from mismatch_study import CONFIG, SHARED_WARM_START  # noqa: F401
from mismatch_study import VARIANTS as _ALL

VARIANTS = {k: v for k, v in _ALL.items() if "_fp32_" in k and "rltt" not in k}
