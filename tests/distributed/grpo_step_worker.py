"""Subprocess worker for the mesh tests: one GRPO step (and optionally a checkpoint round trip)
on however many devices this process sees; writes the results to an .npz.

Usage: python grpo_step_worker.py OUT.npz [key=value overrides...]
Environment: XLA_FLAGS (device count), LOOPRL_COORDINATOR / LOOPRL_NUM_PROCESSES /
LOOPRL_PROCESS_ID for the two-process test, LOOPRL_TEST_CKPT=DIR to also save and restore a
training checkpoint there.
"""
import json
import os
import sys

from looprl.distributed.multihost import init_distributed

init_distributed()

import jax  # noqa: E402
import numpy as np  # noqa: E402

from looprl.config import apply_overrides, load_experiment  # noqa: E402
from looprl.model.looped import init_params  # noqa: E402
from looprl.rl.learner import GRPOLearner  # noqa: E402
from looprl.train.setup import build_tasks
from looprl.model.config import from_model_section  # noqa: E402

SMOKE = os.path.join(os.path.dirname(__file__), "..", "..", "experiments", "tiny_arith_smoke.py")
BASE = ["rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=4",
        "learner.minibatches=2", "learner.microbatch_size=4", "measure_stock=false"]


def main():
    out, overrides = sys.argv[1], sys.argv[2:]
    cfg = apply_overrides(load_experiment(SMOKE), BASE + overrides)
    _, task = build_tasks(cfg)
    # a deterministic reward of the text (a random model never solves a sum): the text's length,
    # so advantages correlate with token counts and the token-mean loss does not cancel to ~0
    task.reward = lambda problem, text: float(len(text))
    tok = task.tokenizer()
    mcfg = from_model_section(cfg.model)
    learner = GRPOLearner(cfg, mcfg, init_params(mcfg, 0), task, tok)
    m = learner.step(0)
    res = {"loss": m["loss"], "grad_norm": m["grad_norm"],
           "replay_exact_fraction": m["replay_exact_fraction"], "reward_mean": m["reward_mean"],
           "devices": jax.device_count(), "processes": jax.process_count(),
           "mesh": None if learner.mesh is None else dict(learner.mesh.shape)}
    from looprl.distributed.mesh import to_host
    params = jax.tree.map(to_host, learner.params)
    flat = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(params)}
    ckpt = os.environ.get("LOOPRL_TEST_CKPT")
    if ckpt:
        from looprl.io.checkpoint import load_model_checkpoint, save_model_checkpoint
        save_model_checkpoint(ckpt, learner.params, mcfg, tok.to_json(),
                              train_state={"opt_state": learner.opt_state, "step": 1})
        got, _, _, _ = load_model_checkpoint(ckpt)
        res["ckpt_roundtrip_bits"] = all(
            np.array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32))
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(params)))
    if jax.process_index() == 0:
        np.savez(out, meta=np.asarray(json.dumps(res)), **flat)


if __name__ == "__main__":
    main()
