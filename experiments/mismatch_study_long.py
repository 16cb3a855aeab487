"""The mismatch study with long completions: the running partial sums written out
(`= 12 - 3 + 1 = 9 + 1 = 10<|im_end|>`, >= 24 tokens for 4 terms), so drift between sampler and
learner has room to build along a completion. Same learners, samplers and updates as
`mismatch_study.py` (its docstring); here the warm start learns the step format on 2-4-term
sums and GRPO trains and evaluates on 4-term sums.

    looprl train experiments/mismatch_study_long.py seed=0 out_dir=runs/mismatch/long/seed0

Its variants are the fp32 learners under `deferred` KV (`hybrid`, `stock`, `full_depth` +
recompute, with and without TIS, `expected` + recompute): the warm start alone took 18-25
minutes per seed on 2 CPU cores, so the whole grid of the short study does not fit the 30
minutes per seed its issue sets.
"""
from mismatch_study import CONFIG as SHORT, SHARED_WARM_START  # noqa: F401
from mismatch_study import VARIANTS as _ALL

VARIANTS = {k: v for k, v in _ALL.items() if k.startswith("deferred_fp32_") and "rltt" not in k}

CONFIG = SHORT.replace(
    name="mismatch_study_long",
    task=SHORT.task.replace(solution_style="steps", spaces=True, train_terms=(2, 4),
                            eval_terms=(4, 4), rl_terms=(4, 4), max_prompt_tokens=48),
    warm_start=SHORT.warm_start.replace(max_steps=3000, eval_problems=200),
    rollout=SHORT.rollout.replace(max_new_tokens=32),
    run=SHORT.run.replace(out_dir="runs/mismatch/long"),
)
