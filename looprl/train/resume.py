"""Training checkpoints of a run directory: save every N steps, retention, latest, exact resume.

Layout under `RUN_DIR/checkpoints/`:
  step_{N:08d}/   a complete looprl checkpoint (`looprl.io.checkpoint`; any CLI command's
                  `--checkpoint` takes it) of the parameters after N GRPO steps, with
                  `train_state` = `GRPOLearner.train_state(N)` (optax state, run PRNG key,
                  step N = the next step to run, data position), `experiment_config.json` (the
                  resolved config that produced it) and meta entries `step`, `params_sha256`
  index.jsonl     one object per checkpoint written: {"step", "params_sha256", "dir"} (kept
                  when retention deletes the directory, so runs can be compared step by step)

A checkpoint counts only if it is complete (`read_checkpoint_meta` accepts it: meta written last,
every part present, a train state) and its meta's step is the one its name says; the temporary
`.step_*.tmp-*` directories an interrupted save leaves, and step directories without their meta
or with a part missing, are never picked as the latest.

Resuming (`resume=RUN_DIR`) requires the new resolved config to equal the checkpoint's in every
key except the run-control ones (`RESUMABLE_KEYS`); `run.grpo_steps` may change only under a
constant learning rate (the schedule's length depends on it).
"""
from __future__ import annotations

import dataclasses
import json
import re
import shlex
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np

from looprl.config import ExperimentConfig, apply_overrides, from_json, to_dict, to_json
from looprl.distributed.mesh import to_host
from looprl.distributed.multihost import is_main_process
from looprl.errors import CheckpointError, ConfigError, create_dir
from looprl.io.checkpoint import (load_model_checkpoint, load_train_state, params_sha256,
                                  read_checkpoint_meta, save_model_checkpoint)
from looprl.io.train_state import is_prng_key, leaf_name, tree_like_template

CHECKPOINTS_DIR = "checkpoints"
INDEX_FILE = "index.jsonl"
CONFIG_IN_CHECKPOINT = "experiment_config.json"
REFERENCE_FILE = "reference.json"  # the reference policy of a run without a warm start
_STEP_RE = re.compile(r"^step_(\d{8})$")
_LEFTOVER_RE = re.compile(r"^\.step_\d{8}\.(tmp|old)-")

# keys that may differ between a run and its resumption (they steer the process, not the math)
RESUMABLE_KEYS = ("run.out_dir", "run.resume", "run.stop_after", "run.checkpoint_every_steps",
                  "run.keep_checkpoints", "run.tensorboard", "run.progress_bar",
                  "run.grpo_steps",
                  # the device layout: a run continues on another mesh or device count
                  # (checkpoints restore on any)
                  "mesh.data", "mesh.fsdp", "mesh.tensor")


# keys a resumed run takes from its checkpoint whatever the command line says: they fix how its
# samples were drawn (a run started before completion-index noise keeps the layout keying) and
# how its gradients were summed (a run started before the learner's live prefix keeps the whole
# layout, `learner.seq_bucket=0`: the same log-probs, but the loss in another order), and how
# its deferred rollouts were batched (a run started before the automatic pending bound became
# the default keeps its `rollout.deferred_max_pending`, 4: the same tokens, another schedule)
INHERITED_KEYS = ("rollout.noise_keying", "learner.seq_bucket", "rollout.deferred_max_pending")


def resume_command(run_dir: str | Path) -> str:
    """The command that continues run `run_dir`, as printed and recorded in `preempted.json`:
    `looprl train RUN_DIR/config.json resume=RUN_DIR` (the run's own resolved config, so the
    overrides it was started with need not be given again)."""
    run_dir = Path(run_dir)
    return (f"looprl train {shlex.quote(str(run_dir / 'config.json'))} "
            f"resume={shlex.quote(str(run_dir))}")


def finished_summary(run_dir: Path, newest_step: int, n_steps: int) -> dict[str, Any] | None:
    """The `summary.json` of run `run_dir` when it finished at the requested end: its newest
    training checkpoint is at step `n_steps` and its summary records those `grpo_steps`. None
    otherwise (a run stopped by `stop_after` or a signal, or one asked to go further)."""
    path = run_dir / "summary.json"
    if newest_step != n_steps or not path.is_file():
        return None
    try:
        summary = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(summary, dict) or summary.get("grpo_steps") != n_steps:
        return None
    return summary


def step_dir(run_dir: str | Path, step: int) -> Path:
    """`RUN_DIR/checkpoints/step_{step:08d}`."""
    return Path(run_dir) / CHECKPOINTS_DIR / f"step_{step:08d}"


def checkpoint_candidates(run_dir: str | Path) -> list[tuple[int, Path, str | None]]:
    """[(step, dir, problem)] of every `step_*` directory under `RUN_DIR/checkpoints`, by step;
    `problem` is None for a complete training checkpoint, else why it cannot be used (an
    interrupted write, a missing part, a meta step that disagrees with the name)."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    found = []
    if not root.is_dir():
        return found
    for d in root.iterdir():
        m = _STEP_RE.match(d.name)
        if not m or not d.is_dir():
            continue
        step, problem = int(m.group(1)), None
        try:
            meta = read_checkpoint_meta(d)
            if not meta.get("has_train_state"):
                problem = "no train_state (not a training checkpoint)"
            elif meta.get("step") != step:
                problem = f"its meta says step {meta.get('step')!r}, its name step {step}"
        except CheckpointError as e:
            problem = str(e)
        found.append((step, d, problem))
    return sorted(found, key=lambda x: x[0])


def complete_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """[(step, dir)] of the complete training checkpoints under `RUN_DIR/checkpoints`, by step.
    Incomplete ones (interrupted writes, missing parts, a meta step that disagrees with the
    name) are skipped."""
    return [(s, d) for s, d, problem in checkpoint_candidates(run_dir) if problem is None]


def latest_checkpoint(run_dir: str | Path) -> tuple[int, Path] | None:
    """(step, dir) of the newest complete training checkpoint, or None."""
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


def save_training_checkpoint(run_dir: str | Path, step: int, learner, model_cfg,
                             tokenizer_json: str | None, exp_cfg: ExperimentConfig,
                             extra_meta: dict[str, Any] | None = None) -> tuple[Path, str]:
    """Write `step_dir(run_dir, step)` from `learner` (after `step` GRPO steps), append to the
    index, then keep only the newest `exp_cfg.run.keep_checkpoints` complete checkpoints (and remove
    leftovers of interrupted writes). An existing (e.g. incomplete) directory of that step is
    replaced. `extra_meta`: more meta entries (the run's task, prompt style, stop ids and
    evaluation settings). Returns (dir, params_sha256)."""
    run_dir = Path(run_dir)
    params = jax.tree.map(to_host, learner.params)
    sha = params_sha256(params)
    state = learner.train_state(step)
    path = save_model_checkpoint(
        step_dir(run_dir, step), params, model_cfg, tokenizer_json,
        extra_meta={**(extra_meta or {}), "stage": "grpo", "step": step, "params_sha256": sha,
                    "train_state_sha256": train_state_sha256(state)},
        train_state=state, overwrite=True,
        extra_files={CONFIG_IN_CHECKPOINT: to_json(exp_cfg) + "\n"})
    if not is_main_process():  # every process wrote its shards; process 0 keeps the index
        return path, sha
    with (run_dir / CHECKPOINTS_DIR / INDEX_FILE).open("a") as f:
        f.write(json.dumps({"step": step, "params_sha256": sha, "dir": path.name}) + "\n")
    root = run_dir / CHECKPOINTS_DIR
    for d in root.iterdir():
        if _LEFTOVER_RE.match(d.name):
            shutil.rmtree(d, ignore_errors=True)
    for _, old in complete_checkpoints(run_dir)[:-exp_cfg.run.keep_checkpoints]:
        shutil.rmtree(old)
    return path, sha


def train_state_sha256(state) -> str:
    """`params_sha256` of a `GRPOLearner.train_state` tree (typed PRNG keys as their key data):
    recorded at save, compared at restore, so silently damaged optimizer state is caught."""
    def plain(x):
        if is_prng_key(x):
            return np.asarray(jax.random.key_data(x))
        return to_host(x)  # a sharded leaf may span processes

    return params_sha256(jax.tree.map(plain, state))


def check_resume_config(saved: ExperimentConfig, cfg: ExperimentConfig, source: str) -> None:
    """Raise ConfigError naming every key (outside `RESUMABLE_KEYS`) whose value in `cfg`
    differs from the checkpoint's config `saved` (read from `source`)."""
    a, b = _flat(to_dict(saved)), _flat(to_dict(cfg))
    diff = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k)
                  and k not in RESUMABLE_KEYS and k not in INHERITED_KEYS)
    if (a.get("run.grpo_steps") != b.get("run.grpo_steps")
            and (cfg.optim.lr_schedule != "constant")):
        diff.append("run.grpo_steps")
    if diff:
        shown = ", ".join(f"{k} ({a.get(k)!r} -> {b.get(k)!r})" for k in diff[:8])
        raise ConfigError(f"config key(s) {diff} differ from the run being resumed ({source}): "
                          f"{shown}; only {list(RESUMABLE_KEYS)} may change on resume "
                          f"(run.grpo_steps only with optim.lr_schedule='constant')")


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def load_resume_point(ckpt: Path, cfg: ExperimentConfig, say=None) -> ExperimentConfig:
    """`cfg` with the `INHERITED_KEYS` of the config stored in training checkpoint `ckpt`, after
    `check_resume_config` against it (`say` is told of each inherited value that differs from
    `cfg`'s). Raises CheckpointError (unreadable) or ConfigError (differs)."""
    p = Path(ckpt) / CONFIG_IN_CHECKPOINT
    try:
        saved = from_json(p.read_text(), source=str(p))
    except OSError as e:
        raise CheckpointError(f"{p}: cannot read: {e}") from e
    check_resume_config(saved, cfg, str(p))
    kept = {}
    for key in INHERITED_KEYS:
        section, name = key.split(".")
        value = getattr(getattr(saved, section), name)
        if value != getattr(getattr(cfg, section), name):
            kept[key] = value
            if say is not None:
                say(f"resuming with the run's own {key}={value!r}")
    if kept:
        cfg = apply_overrides(cfg, [f"{k}={v}" for k, v in kept.items()])
    return cfg


def restore_training_checkpoint(ckpt: str | Path, learner) -> int:
    """Load training checkpoint `ckpt` into `learner` (parameters and `train_state`, each array
    checked by name, shape and dtype against the learner's own, so a checkpoint of another
    model or optimizer is a CheckpointError naming the array; then their SHA-256 against the
    ones recorded at save, so damaged bytes of the right size are a CheckpointError too, and
    `learner` is left untouched). Returns the next GRPO step."""
    ckpt = Path(ckpt)
    meta = read_checkpoint_meta(ckpt)
    if not meta.get("has_train_state"):
        raise CheckpointError(f"{ckpt}: a model checkpoint without train_state (not a "
                              f"training checkpoint); resume needs RUN_DIR/checkpoints/step_*")
    params, _, _, _ = load_model_checkpoint(ckpt)
    stored = {leaf_name(p): a for p, a in jax.tree_util.tree_flatten_with_path(params)[0]}
    template = jax.tree.map(to_host, learner.params)
    params = tree_like_template(stored, template, where=f"{ckpt}/params")
    state = load_train_state(ckpt, template=learner.train_state(0))
    for what, got, key in (("parameters", params_sha256(params), "params_sha256"),
                           ("train state", train_state_sha256(state), "train_state_sha256")):
        if key in meta and got != meta[key]:
            raise CheckpointError(f"{ckpt}: damaged {what}: SHA-256 {got[:12]}... differs from "
                                  f"the {meta[key][:12]}... recorded when it was saved")
    return learner.restore_train_state(params, state)


def load_reference(out: Path):
    """The reference (pre-GRPO) policy of a run being resumed: its `warm_start/` checkpoint, or
    the model checkpoint `reference.json` points at (runs without a warm start), checked
    against the SHA-256 recorded when the run started. Returns (params, cfg, tokenizer_json,
    dir, params_sha256). Raises CheckpointError if that checkpoint is gone or changed."""
    if (out / "warm_start").is_dir():
        params, mcfg, tok, meta = load_model_checkpoint(out / "warm_start")
        # runs that predate the recorded SHA-256 have nothing to compare against
        ref = {"checkpoint": str(out / "warm_start"), "params_sha256": meta.get("params_sha256")}
    else:
        ref = json.loads((out / REFERENCE_FILE).read_text())
        params, mcfg, tok, _ = load_model_checkpoint(ref["checkpoint"])
    recorded = ref["params_sha256"]
    sha = params_sha256(params)
    if recorded is not None and sha != recorded:
        raise CheckpointError(f"{ref['checkpoint']}: the run's reference checkpoint changed since "
                              f"the run started (params_sha256 {sha[:12]}..., recorded "
                              f"{recorded[:12]}... at the start)")
    return params, mcfg, tok, Path(ref["checkpoint"]), sha


def resume_candidates(out: Path, say) -> list[tuple[int, Path]]:
    """The complete training checkpoints of run `out`, newest first, after saying which step
    directories are unusable and why. Raises CheckpointError when there is none."""
    cands = checkpoint_candidates(out)
    for _, d, problem in cands:
        if problem is not None:
            say(f"skipping {d.name}: {problem}")
    good = [(s, d) for s, d, problem in reversed(cands) if problem is None]
    if good:
        return good
    if cands:
        raise CheckpointError(f"{out}: no usable training checkpoint: "
                              + "; ".join(f"{d.name}: {p}" for _, d, p in cands))
    raise CheckpointError(f"{out}: no training checkpoint under checkpoints/: the run was "
                          f"interrupted before its first one (during the warm start or the "
                          f"evaluation before GRPO), so there is nothing to resume; remove "
                          f"{out} or start again with another out_dir")


def without_run_control(cfg: ExperimentConfig) -> ExperimentConfig:
    """`cfg` as the run directory's `config.json` keeps it: without `run.resume` and
    `run.stop_after`, which steer one invocation, so the file can serve as CONFIG again (a
    fresh run with another out_dir, or `resume=`)."""
    return dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, resume=None,
                                                            stop_after=None))


def prepare_out_dir(exp_cfg: ExperimentConfig) -> Path:
    """The run directory, absolute: `run.resume`'s (checked to be a run directory and to equal
    `run.out_dir`) or a new or empty `run.out_dir`, created.

    Raises:
      ConfigError: out_dir differs from the resumed directory, the resumed directory has no
        config.json, a fresh run's out_dir is a file, holds a finished run or is not empty, or
        it cannot be created (the OS error named: no permission, a parent that is a file).
    """
    out = Path(exp_cfg.run.out_dir)
    if exp_cfg.run.resume is not None:
        run_dir = Path(exp_cfg.run.resume)
        if out.resolve() != run_dir.resolve():
            raise ConfigError(f"config key 'run.out_dir': a resumed run continues in place, so "
                              f"out_dir must be the resumed directory {exp_cfg.run.resume!r}, "
                              f"found {exp_cfg.run.out_dir!r}")
        if not (run_dir / "config.json").is_file():
            raise ConfigError(f"config key 'run.resume': {exp_cfg.run.resume!r} is not a run "
                              f"directory (no config.json)")
        return run_dir.resolve()
    if out.exists() and not out.is_dir():
        raise ConfigError(f"config key 'run.out_dir': {str(out)!r} is a file; a run needs an "
                          f"empty or new directory")
    if (out / "summary.json").is_file():
        raise ConfigError(f"config key 'run.out_dir': {str(out)!r} holds a finished run "
                          f"(summary.json); a fresh run needs an empty or new directory "
                          f"(resume= continues a run only past its last step: pass a larger "
                          f"grpo_steps)")
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"config key 'run.out_dir': {str(out)!r} is not empty; a fresh run "
                          f"needs an empty or new directory (or resume={str(out)!r})")
    # absolute: orbax refuses relative checkpoint paths
    return create_dir(out, "config key 'run.out_dir'").resolve()
