"""The mismatch study: when does the learner's mismatch with the sampler hurt
looped-model RL? Learners that replay the schedule against learners that ignore it, side by
side, with nothing else changed.

Sampler: early exit at q = 0.6 with `deferred` KV (exact math, other grouping) or `copy` KV
(an approximation that saves FLOPs). Updates: 4 minibatches x 2 epochs per rollout, so the
ratio and clipping act on stale log-probs. Learners:
  hybrid        replay's value, dense gradient (looprl; exact)
  stock         the same math with plain matmuls (replays the schedule; off by round-off)
  full_depth    loop T everywhere, dense KV, old log-probs recomputed by the learner (what an
                ordinary forward in a common framework gives)
  full_depth_tis  the same, with truncated importance sampling against the sampler (cap 2)
  expected      HF Ouro's exit-distribution mixture of logits, old log-probs recomputed
and RLTT loop credit (`exit_dist`, `progressive`) with hybrid. fp32 runs the whole grid; bf16
runs hybrid, full_depth and full_depth_tis. Each seed shares one warm start across variants.

Completion length is a factor: this file's task is the main job's (answers only, <= 5 tokens);
`mismatch_study_long.py` writes the running partial sums out (>= 24 tokens). Commands, sizes and
measured seconds per step: experiments/README.md ("The mismatch study").

    looprl train experiments/mismatch_study.py seed=0 out_dir=runs/mismatch/short/seed0
"""
from tiny_arith import CONFIG as MAIN  # the sibling experiment file

CONFIG = MAIN.replace(
    name="mismatch_study",
    learner=MAIN.learner.replace(minibatches=4, ppo_epochs=2, measure_stock=False),
    rollout=MAIN.rollout.replace(prompts_per_step=16, group_size=8),
    eval=MAIN.eval.replace(eval_problems=200, eval_batch_size=200, eval_every_steps=10),
    run=MAIN.run.replace(out_dir="runs/mismatch/short", grpo_steps=30, progress_bar=False,
                         checkpoint_every_steps=1000, tensorboard=False),
)
SHARED_WARM_START = True

_LEARNERS = {
    "hybrid": ["learner.logprob_method=hybrid"],
    "stock": ["learner.logprob_method=stock"],
    "full_depth": ["learner.logprob_method=full_depth", "learner.old_logprobs=recompute"],
    "full_depth_tis": ["learner.logprob_method=full_depth", "learner.old_logprobs=recompute",
                       "grpo.tis_cap=2.0"],
    "expected": ["learner.logprob_method=expected", "learner.old_logprobs=recompute"],
}
_BF16 = ("hybrid", "full_depth", "full_depth_tis")
VARIANTS = {}
for _kv in ("deferred", "copy"):
    for _name, _over in _LEARNERS.items():
        VARIANTS[f"{_kv}_fp32_{_name}"] = [f"rollout.kv_policy={_kv}", *_over]
        if _name in _BF16:
            VARIANTS[f"{_kv}_bf16_{_name}"] = [f"rollout.kv_policy={_kv}",
                                               "model.compute_dtype=bfloat16", *_over]
for _credit in ("exit_dist", "progressive"):
    VARIANTS[f"deferred_fp32_hybrid_rltt_{_credit}"] = [
        "rollout.kv_policy=deferred", "learner.logprob_method=hybrid",
        f"grpo.loop_credit={_credit}"]
