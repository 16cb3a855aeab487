"""What exactness buys: the main job's GRPO with learner `hybrid` vs `stock` log-probs and
rollout `dense` vs `deferred` KV, same seeds, from one shared warm-start checkpoint.

`looprl train experiments/tiny_arith_ablation.py` first runs the main job's warm start once
(`out_dir/warm_start_run`, `grpo_steps=0`), then each variant below into `out_dir/<name>` from
that checkpoint (`model.checkpoint=...`, `warm_start.enabled=false`, added by the runner), so
only GRPO differs; then it writes `out_dir/variants.json` and side-by-side plots into
`out_dir/plots` (the same as `looprl plot out_dir/hybrid_dense out_dir/stock_dense ...`).
Command-line overrides apply to every variant (e.g. `grpo_steps=20`).

With `hybrid`, the first update's ratio is exactly 1 (the learner reproduces the sampler's
log-probs bit for bit where replay is exact); with `stock`, the ratio starts off by the
kernel-order round-off (`stock_max_abs_diff`), which PPO clipping and the ratio then see as
policy change. Under `deferred`, positions that exited early see deeper KV later, so the
non-replaying learner differs more.
"""
from looprl.config import RunConfig

from tiny_arith import CONFIG as MAIN  # the sibling experiment file

CONFIG = MAIN.replace(name="tiny_arith_ablation",
                      run=MAIN.run.replace(out_dir="runs/tiny_arith_ablation", grpo_steps=40))
SHARED_WARM_START = True
VARIANTS = {
    "hybrid_dense": ["learner.logprob_method=hybrid", "rollout.kv_policy=dense"],
    "hybrid_deferred": ["learner.logprob_method=hybrid", "rollout.kv_policy=deferred"],
    "stock_dense": ["learner.logprob_method=stock", "rollout.kv_policy=dense"],
    "stock_deferred": ["learner.logprob_method=stock", "rollout.kv_policy=deferred"],
}
