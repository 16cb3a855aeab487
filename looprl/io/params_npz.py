"""The parameters `looprl verify` samples with, saved beside its rollouts as
`<weights>_params.npz` so that `looprl verify --rollout FILE` can re-verify a rollout without a
checkpoint: one entry per parameter leaf, keyed by `jax.tree_util.keystr` of its path, plus
`model_config` (the `OuroConfig.to_dict()` JSON text).
"""
from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np

from looprl.errors import ScheduleError
from looprl.model.config import OuroConfig
from looprl.model.looped import init_params


def save_params_npz(path: Path, params, cfg) -> None:
    """The weights a rollout was sampled with, next to it, so `--rollout` can re-verify it."""
    flat = {jax.tree_util.keystr(k): np.asarray(v)
            for k, v in jax.tree_util.tree_leaves_with_path(params)}
    np.savez(path, model_config=np.asarray(json.dumps(cfg.to_dict())), **flat)


def load_rollout_params(rollout: Path):
    """(params, OuroConfig) saved by `looprl verify` next to a rollout (`<weights>_params.npz`
    for the rollout `<weights>_<dtype>_<policy>.npz`). Raises ScheduleError when there is none."""
    weights = rollout.stem.split("_")[0]
    path = rollout.with_name(f"{weights}_params.npz")
    if not path.exists():
        raise ScheduleError(f"{rollout}: no --checkpoint given and no {path.name} next to it (only "
                            f"rollouts written by `looprl verify` have one): pass --checkpoint "
                            f"CKPT, the parameters the rollout was sampled with")
    with np.load(path) as z:
        cfg = OuroConfig.from_dict(json.loads(str(z["model_config"])))
        flat = {k: z[k] for k in z.files if k != "model_config"}
    template = init_params(cfg, 0)
    leaves = jax.tree_util.tree_leaves_with_path(template)
    treedef = jax.tree_util.tree_structure(template)
    return jax.tree_util.tree_unflatten(
        treedef, [flat[jax.tree_util.keystr(k)] for k, _ in leaves]), cfg
