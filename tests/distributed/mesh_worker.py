"""Subprocess worker for tests/distributed/test_mesh.py (run with N forced host devices).

Usage: python mesh_worker.py replay OUT_DIR POLICIES | ckpt OUT_DIR
  replay  sample on the N-device mesh (rows split) and replay on it; the verify cells of that
          rollout (`devices` = N); results as OUT_DIR/replay.json. POLICIES: KV policies,
          comma-separated, e.g. dense,deferred
  ckpt    restore OUT_DIR/ck1 (written on one device) onto the mesh with fsdp shardings, then
          write OUT_DIR/ckN from fsdp-sharded arrays (params + optimizer state)
"""
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from looprl.config import MeshConfig
from looprl.distributed.mesh import make_mesh, place_params, to_host
from looprl.logprobs import batch_logprobs
from looprl.model.config import preset
from looprl.model.looped import init_params
from looprl.sampling.sampler import SamplingConfig, generate

CFG = preset("tiny", vocab_size=32, hidden_size=64, intermediate_size=128, num_heads=2,
             num_kv_heads=2, head_dim=32)
PROMPTS = [[5, 9, 3, 7, 11], [4, 6], [8, 12, 13, 14, 15, 16, 17], [20]]


def u32(x):
    return np.asarray(x, np.float32).view(np.uint32)


def params0():
    p = init_params(CFG, 0)
    p["early_exit_gate"]["bias"] = jnp.array([-0.3])  # exits spread over the loops
    return jax.tree.map(np.asarray, p)


def replay(out: Path, policies: str):
    from looprl.verify.matrix import VerifyOptions, _cell_group, updated_params
    n = jax.device_count()
    mesh = make_mesh(MeshConfig(data=-1))
    p = params0()
    res = {"devices": n}
    for policy in policies.split(","):
        scfg = SamplingConfig(max_new_tokens=8, exit_threshold=0.7, kv_policy=policy,
                              deferred_max_pending=3, stop_ids=(2, 7))
        one = generate(CFG, p, PROMPTS, scfg, group_size=4, seed=1)
        rb = generate(CFG, place_params(p, make_mesh(MeshConfig(data=n // 2, fsdp=2))),
                      PROMPTS, scfg, group_size=4, seed=1, mesh=mesh)
        emit = np.asarray(rb.exit_loop_BxS) > 0
        lp, _ = batch_logprobs(CFG, p, rb, "replay", mesh=mesh)
        st, _ = batch_logprobs(CFG, p, rb, "stock", mesh=mesh)
        res[policy] = {
            "tokens_equal_one_device": bool(np.array_equal(one.tokens_BxS, rb.tokens_BxS)),
            "exits_equal_one_device": bool(np.array_equal(one.exit_loop_BxS, rb.exit_loop_BxS)),
            "replay_exact": float(np.mean(u32(lp)[emit] == u32(rb.logprob_BxS)[emit])),
            "stock_exact": float(np.mean(u32(st)[emit] == u32(rb.logprob_BxS)[emit])),
            "schedule_mesh": rb.schedule.mesh, "schedule_devices": rb.schedule.devices,
            "emitted": int(emit.sum())}
        opts = VerifyOptions(min_tokens=1, min_early_exit_fraction=0.0)
        pu = updated_params(CFG, p, rb, opts.update_learning_rate, 0)
        cells = _cell_group(CFG, p, pu, rb, weights="random", opts=opts, n_devices=n,
                            log=lambda *a: None)
        res[policy]["cells"] = [{k: c[k] for k in ("devices", "batching", "params", "method",
                                                   "exact_fraction", "max_abs_diff",
                                                   "exact_fraction_vs_one_device_sampler")}
                                for c in cells]
    (out / "replay.json").write_text(json.dumps(res))


def ckpt(out: Path):
    import optax

    from looprl.io.checkpoint import load_model_checkpoint, save_model_checkpoint
    mesh = make_mesh(MeshConfig(data=1, fsdp=-1))
    restored, cfg, tok, _ = load_model_checkpoint(out / "ck1", mesh=mesh)
    specs = {jax.tree_util.keystr(k): str(v.sharding.spec)
             for k, v in jax.tree_util.tree_leaves_with_path(restored)}
    same = all(np.array_equal(u32(to_host(a)), u32(b))
               for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(params0())))
    params = place_params(jax.tree.map(lambda a: a * 2.0, params0()), mesh)
    opt_state = optax.adam(1e-3).init(params)
    sharded = [not a.is_fully_replicated for a in jax.tree.leaves(params)]
    save_model_checkpoint(out / "ckN", params, cfg, tok, train_state={"opt": opt_state})
    (out / "ckpt.json").write_text(json.dumps({"restored_bits_equal": same, "specs": specs,
                                               "sharded_leaves": sum(sharded)}))


if __name__ == "__main__":
    {"replay": replay, "ckpt": ckpt}[sys.argv[1]](Path(sys.argv[2]), *sys.argv[3:])
