"""The reproducibility matrix of docs/DESIGN.md §5 (`looprl verify`; the report is
`looprl.verify.report`).

Cells: dtype {float32, bfloat16} x KV policy {dense, deferred, copy} x weights {random, trained}
x learner batching {same: the rows in order; different: permuted, in half-size minibatches} x
parameters {sampler; updated: one AdamW step away, compared with the sampler re-run in forced
mode} (x devices {1, N} when N > 1 are visible), each with the methods `replay`, `dense` and
`stock`. One rollout per (weights, dtype, policy): q < 1, temperature 1, untruncated, stop ids
off, so every cell holds >= 512 sampled tokens. A `replay` cell passes only at exact fraction
1.0 (raw bits, as uint32); each `stock` cell is a negative control that must mismatch while
staying within 1e-4 in fp32. `replay_impl` is `invariant` (the learner's dense pass) or `forced`
(`--replay-impl auto` where the invariant pass is inexact; always for a stock-sampled rollout).
A cell whose rollout misses the requirements (`min_tokens`, q < 1, `min_early_exit_fraction`)
fails whatever its bits. Bits hold for one jax build, backend, CPU model and thread count (the
report's `env`); the CLI pins XLA CPU to one intra-op thread unless the user set it.
"""
from __future__ import annotations

import dataclasses
import itertools
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from looprl.distributed.mesh import make_mesh
from looprl.errors import ScheduleError
from looprl.logprobs import METHODS as LEARNER_METHODS
from looprl.logprobs import (SCHEDULE_UNAWARE, batch_logprobs, forced_replay_logprobs,
                             sequence_logprobs)
from looprl.logprobs.mismatch import compare_logprobs
from looprl.kernels import KERNEL_VERSION, KERNEL_VERSION_ORDERED, kernel_version
from looprl.programs import release_programs_near_map_limit
from looprl.sampling.kv_policies import KV_POLICIES
from looprl.sampling.sampler import SamplingConfig, generate
from looprl.sampling.fingerprint import params_fingerprint

DTYPES = ("float32", "bfloat16")
POLICIES = KV_POLICIES
# the learner's schedule-aware methods but `hybrid`, whose value is replay's and whose gradient
# is dense's: ("replay", "dense", "stock")
METHODS = tuple(m for m in LEARNER_METHODS if m != "hybrid" and m not in SCHEDULE_UNAWARE)
STOCK_TOLERANCE_FP32 = 1e-4


@dataclasses.dataclass(frozen=True)
class VerifyOptions:
    """Sizes of the matrix run. `quick` is the 15-minutes-on-2-cores setting of DESIGN.md §6."""
    n_prompts: int = 4
    group_size: int = 4
    max_new_tokens: int = 40
    exit_threshold_random: float = 0.85
    exit_threshold_trained: float = 0.9
    deferred_max_pending: int = 4
    warm_start_steps: int = 40
    warm_start_gate_steps: int = 20
    warm_start_batch_size: int = 32
    warm_start_learning_rate: float = 3e-3
    update_learning_rate: float = 1e-3
    seed: int = 0
    replay_impl: str = "invariant"  # or "auto": forced replay where the invariant one is not exact
    min_tokens: int = 512
    min_early_exit_fraction: float = 0.2
    # small decode batches (DESIGN.md §5): rollouts of this many rows (one sample of each of as
    # many prompts), each decoding ceil(min_tokens / rows) tokens so it holds min_tokens
    small_batches: tuple[int, ...] = (1, 3, 5)
    # the weight sets whose (dtype, policy) groups get the small decode batches: `quick` runs
    # them on the trained weights (a 1-row rollout decodes 512 tokens one at a time, the costly
    # part of the matrix), `full` on both
    small_batch_weights: tuple[str, ...] = ("trained",)

    @classmethod
    def quick(cls, **kw) -> "VerifyOptions":
        return cls(**kw)

    @classmethod
    def full(cls, **kw) -> "VerifyOptions":
        base = dict(n_prompts=8, group_size=4, max_new_tokens=64, warm_start_steps=300,
                    warm_start_gate_steps=100, small_batch_weights=("random", "trained"))
        base.update(kw)
        return cls(**base)


# --- the learner side of a cell -----------------------------------------------------------------

def device_mesh(devices: int):
    """A data-parallel mesh over the first `devices` devices (None for one device)."""
    if devices <= 1:
        return None

    return make_mesh(None, jax.devices()[:devices])


def learner_logprobs(cfg, params, batch, method: str, batching: str, perm, minibatch: int,
                     devices: int = 1, replay_impl: str = "invariant"):
    """Learner log-probs `[B, S]` of `batch` in the row order the cell compares (identity for
    `same`, `perm` for `different`). `replay` of a stock-kernel rollout is always the forced
    re-run (`replay_impl_of`). `devices` > 1: the rows split across that many devices
    (`looprl.distributed.mesh`; each device runs the one-device program on its rows)."""
    mesh = device_mesh(devices)
    if method == "replay" and replay_impl_of(batch, replay_impl) == "forced":
        return forced_replay_logprobs(cfg, params, batch,
                                      rows=None if batching == "same" else perm, mesh=mesh)[0]
    if mesh is not None:
        return batch_logprobs(cfg, params, batch, method, mesh=mesh)[0]
    if batching == "same":
        return batch_logprobs(cfg, params, batch, method)[0]
    parts = [batch_logprobs(cfg, params, batch, method, rows=perm[i:i + minibatch])[0]
             for i in range(0, len(perm), minibatch)]
    return np.concatenate(parts, axis=0)


def replay_impl_of(batch, requested: str = "invariant") -> str:
    """How a `replay` cell of `batch` is computed: `forced` when asked or when the rollout was
    sampled with `kernels="stock"` (no invariant pass reproduces it; `batch_logprobs` re-runs the
    sampler in forced mode), else `invariant`."""
    return "forced" if requested == "forced" or batch.schedule.kernels != "invariant" \
        else "invariant"


def requirement_failures(tokens: int, early_exit_fraction: float, schedule,
                         opts: "VerifyOptions") -> list[str]:
    """The size/schedule requirements a rollout misses, as readable reasons (empty: all met):
    at least `opts.min_tokens` sampled tokens, the Q-exit rule with q < 1, and at least
    `opts.min_early_exit_fraction` of the tokens exiting before the last loop."""
    reasons = []
    if tokens < opts.min_tokens:
        reasons.append(f"{tokens} sampled tokens < {opts.min_tokens}")
    if schedule.fixed_depth is not None:
        reasons.append(f"fixed depth {schedule.fixed_depth} (needs the Q-exit rule with q < 1)")
    elif (schedule.exit_threshold or 1.0) >= 1.0:
        reasons.append(f"exit threshold q={schedule.exit_threshold} (needs q < 1)")
    if early_exit_fraction < opts.min_early_exit_fraction:
        reasons.append(f"{early_exit_fraction:.0%} early exit < "
                       f"{opts.min_early_exit_fraction:.0%}")
    return reasons


def batching_layouts(batch_size: int, n_devices: int) -> tuple[list[tuple[str, int]], list[str]]:
    """The (batching, devices) layouts a rollout of `batch_size` rows is checked in, and notes
    on the ones skipped: `different` needs >= 2 rows (one row permuted is the same batching).
    A rollout sampled on N > 1 devices is checked on the same N-device row split only (rows
    padded to a multiple of N; `_cell_group`)."""
    if n_devices > 1:
        return [("same", n_devices)], []
    layouts, notes = [("same", 1)], []
    if batch_size > 1:
        layouts.append(("different", 1))
    else:
        notes.append("batch size 1: the 'different' batching cells are skipped (a permutation "
                     "of one row is the 'same' batching; not a test of batch invariance)")
    return layouts, notes


def updated_params(cfg, params, batch, learning_rate: float, seed: int):
    """One AdamW step on `-mean(adv_b * hybrid_logprob)` over the sampled tokens of `batch`,
    with advantages +-1 drawn from `seed`: parameters one optimizer step past the sampler's."""
    sch = batch.schedule
    rng = np.random.default_rng(seed)
    adv = jnp.asarray(rng.choice([-1.0, 1.0], size=sch.batch_size), jnp.float32)
    tokens, pad = jnp.asarray(batch.tokens_BxS), jnp.asarray(batch.pad_B)
    exit_loop, kv_depth = jnp.asarray(batch.exit_loop_BxS), jnp.asarray(batch.kv_depth_BxS())

    def loss(p):
        lp, _ = sequence_logprobs(cfg, p, tokens, pad, exit_loop, kv_depth,
                                  kv_policy=sch.kv_policy, compute_dtype=sch.compute_dtype,
                                  temperature=sch.temperature, method="hybrid")
        mask = (exit_loop > 0).astype(jnp.float32)
        return -jnp.sum(lp * adv[:, None] * mask) / jnp.maximum(jnp.sum(mask), 1.0)

    grads = jax.jit(jax.grad(loss))(params)
    opt = optax.adamw(learning_rate, weight_decay=0.0)
    updates, _ = opt.update(grads, opt.init(params), params)
    return optax.apply_updates(params, updates)


# --- the matrix ---------------------------------------------------------------------------------

def _cell_group(cfg, params, params_u, rb, *, weights: str, opts: VerifyOptions, n_devices: int,
                log, notes: list[str] | None = None) -> list[dict]:
    """All cells of one rollout `rb` (one weights x dtype x policy). Notes on skipped layouts
    are appended to `notes` (once each). `n_devices` > 1: `rb` was sampled on that many devices
    (rows split) and the cells are its learner on the same split (batching `same`); each cell
    also reports `exact_fraction_vs_one_device_sampler`, the learner against the sampler re-run
    in forced mode on one device (informative: the kernels' row invariance across local batch
    sizes, not needed for replay)."""
    sch = rb.schedule
    T = sch.total_ut_steps
    mask = rb.sampled_mask_BxS  # not the tokens a thinking budget forced
    tokens = int(mask.sum())
    early = float((np.asarray(rb.exit_loop_BxS)[mask] < T).mean()) if tokens else 0.0
    B = sch.batch_size
    perm = np.random.default_rng(opts.seed + 1).permutation(B)
    minibatch = max(B // 2, 1)
    base = {"dtype": sch.compute_dtype, "kv_policy": sch.kv_policy, "weights": weights,
            "rollout_rows": B,
            "exit_threshold": sch.exit_threshold, "tokens": tokens,
            "early_exit_fraction": early,
            "mean_exit_loop": float(np.asarray(rb.exit_loop_BxS)[mask].mean()),
            "deferred_flushes": int(np.asarray(rb.flush_BxS).sum())}
    unmet = requirement_failures(tokens, early, sch, opts)
    refs = {"sampler": np.asarray(rb.logprob_BxS)}
    t0 = time.time()
    forced = forced_replay_logprobs
    mesh = device_mesh(n_devices)
    refs["updated"] = forced(cfg, params_u, rb, mesh=mesh)[0]  # the sampler re-run, forced mode
    log(f"    forced sampler at updated params: {time.time() - t0:.1f}s")
    one_device = None
    if mesh is not None:
        one_device = {"sampler": forced(cfg, params, rb)[0],
                      "updated": forced(cfg, params_u, rb)[0]}
    batches = {"sampler": rb, "updated": rb.without_logprobs()}
    param_sets = {"sampler": params, "updated": params_u}
    layouts, layout_notes = batching_layouts(B, n_devices)
    for note in layout_notes:
        if notes is not None and note not in notes:
            notes.append(note)
        log(f"    note: {note}")
    cells = []
    for pname in ("sampler", "updated"):
        for batching, devices in layouts:
            order = np.arange(B) if batching == "same" else perm
            ref = refs[pname][order]
            m = mask[order]
            for method in METHODS:
                t0 = time.time()
                lp = learner_logprobs(cfg, param_sets[pname], batches[pname], method, batching,
                                      perm, minibatch, devices)
                cell = {**base, "batching": batching, "params": pname, "devices": devices,
                        "method": method, "learner_minibatch": B if batching == "same"
                        else minibatch, **compare_logprobs(lp, ref, m),
                        "requirements_met": not unmet, "requirements_unmet": list(unmet)}
                if one_device is not None:
                    cell["exact_fraction_vs_one_device_sampler"] = compare_logprobs(
                        lp, one_device[pname][order], m)["exact_fraction"]
                if method == "replay":
                    cell["replay_impl"] = replay_impl_of(batches[pname])
                    if cell["exact_fraction"] < 1.0 and opts.replay_impl == "auto" \
                            and cell["replay_impl"] == "invariant":
                        lpf = learner_logprobs(cfg, param_sets[pname], batches[pname], method,
                                               batching, perm, minibatch, devices, "forced")
                        inv = cell["exact_fraction"]
                        cell.update(compare_logprobs(lpf, ref, m), replay_impl="forced",
                                    invariant_exact_fraction=inv)
                cell["passed"] = _cell_passed(cell)
                cell["seconds"] = round(time.time() - t0, 2)
                cells.append(cell)
                log(f"    {pname:7s} {batching:9s} dev={devices} {method:6s} "
                    f"exact={cell['exact_fraction']:.4f} max={cell['max_abs_diff']:.2e}"
                    f"{' [' + cell['replay_impl'] + ']' if method == 'replay' else ''}")
    return cells


def _cell_passed(cell: dict) -> bool | None:
    """replay: exact; stock (negative control): mismatches, and within 1e-4 in fp32; dense: None
    (informative; exact where the kernels are invariant)."""
    if not cell["requirements_met"]:
        return False
    if cell["method"] == "replay":
        return cell["exact_fraction"] == 1.0
    if cell["method"] == "stock":
        ok = cell["exact_fraction"] < 1.0
        if cell["dtype"] == "float32":
            ok = ok and cell["max_abs_diff"] <= STOCK_TOLERANCE_FP32
        return ok
    return None


def task_prompts(task, tokenizer, n: int, start: int = 100_000) -> list[list[int]]:
    """`n` training-stream prompts of the task, tokenized (different lengths)."""
    return [tokenizer.encode(task.format_prompt(p)) for p in task.train_problems(n, start)]


def run_matrix(cfg, weight_sets: dict[str, Any], prompts: list[list[int]], opts: VerifyOptions,
               log=print, rollout_dir: Path | None = None,
               notes: list[str] | None = None) -> list[dict]:
    """Every cell for every weight set (`{"random": params, "trained": params}`); notes on
    skipped layouts go to `notes`. Per (weights, dtype, policy) the default rollout (the first
    `opts.n_prompts` prompts x `opts.group_size` samples) and the small decode batches of
    `opts.small_batches` rows (one sample of each of as many prompts; `prompts` must hold
    enough; for the weight sets in `opts.small_batch_weights`), each saved as `<weights>_<dtype>_<policy>[_rows<R>].npz` under `rollout_dir`."""
    n_devices = jax.device_count()
    batches = [("", prompts[:opts.n_prompts], opts.group_size, opts.max_new_tokens)]
    for rows in opts.small_batches:
        if rows > len(prompts):
            raise ValueError(f"a {rows}-row rollout needs {rows} prompts, given {len(prompts)}")
        batches.append((f"_rows{rows}", prompts[:rows], 1, -(-opts.min_tokens // rows)))
    cells = []
    for weights, params in weight_sets.items():
        q = opts.exit_threshold_trained if weights == "trained" else opts.exit_threshold_random
        params_u = None
        mine = batches if weights in opts.small_batch_weights else batches[:1]
        for dtype, policy, (suffix, batch_prompts, group, new_tokens) in itertools.product(
                DTYPES, POLICIES, mine):
            t0 = time.time()
            scfg = SamplingConfig(max_new_tokens=new_tokens, temperature=1.0, exit_threshold=q,
                                  kv_policy=policy,
                                  deferred_max_pending=opts.deferred_max_pending, stop_ids=(),
                                  compute_dtype=dtype)
            rb = generate(cfg, params, batch_prompts, scfg, group_size=group, seed=opts.seed,
                          step=0)
            name = f"{weights}_{dtype}_{policy}{suffix}"
            log(f"  {name}: rollout of {rb.schedule.batch_size} rows {time.time() - t0:.1f}s")
            if rollout_dir is not None:
                rb.save(rollout_dir / f"{name}.npz")
            if params_u is None:
                params_u = updated_params(cfg, params, rb, opts.update_learning_rate, opts.seed)
            cells += _cell_group(cfg, params, params_u, rb, weights=weights, opts=opts,
                                 n_devices=1, log=log, notes=notes)
            if n_devices > 1 and not suffix:  # the same rollout, rows split over devices
                t0 = time.time()
                rbm = generate(cfg, params, batch_prompts, scfg, group_size=group,
                               seed=opts.seed, step=0, mesh=device_mesh(n_devices))
                log(f"  {name}: rollout on {n_devices} devices {time.time() - t0:.1f}s")
                cells += _cell_group(cfg, params, params_u, rbm, weights=weights, opts=opts,
                                     n_devices=n_devices, log=log, notes=notes)
            release_programs_near_map_limit()  # `looprl.programs`: the map limit
    return cells


def isa_free_match(theirs: str, here: str) -> bool:
    """True when kernel versions `theirs` and `here` name the ordered CPU kernel and differ at
    most in the `/<isa>` suffix: the ordered kernel's bits do not depend on the ISA
    (`looprl.kernels.cpu_kernel_version`), so such a rollout is verified here and its cells
    compare the bits."""
    return theirs.split("/")[0] == here.split("/")[0] == KERNEL_VERSION_ORDERED


def verify_rollout(cfg, params, rb, opts: VerifyOptions, weights: str = "checkpoint", log=print,
                   notes: list[str] | None = None):
    """The cells of one saved rollout (re-verification). A rollout of the ordered CPU kernel
    sampled on another ISA is verified (`isa_free_match`, with a note). Raises ScheduleError
    when `params` are not the ones the rollout was sampled with (fingerprint mismatch), or
    when it was sampled with another version of the invariant kernels (its bits are another
    function's)."""
    here = kernel_version()
    theirs = rb.schedule.kernel_version
    if (rb.schedule.kernels == "invariant" and theirs != here and theirs
            and isa_free_match(theirs, here)):
        line = (f"the rollout was sampled with kernel version {theirs}, this machine has "
                f"{here}: the ordered kernel's bits do not depend on the ISA, so it is verified "
                f"here")
        log(f"    note: {line}")
        if notes is not None:
            notes.append(line)
    elif rb.schedule.kernels == "invariant" and theirs != here:
        base = (theirs or "").split("/")[0]
        if base == here.split("/")[0]:  # this CPU form, sampled on another sgemm ISA
            fix = ("verify it on a machine whose CPU runs the same sgemm kernels (the report's "
                   "env.cpu_isa), or sample it again here")
        elif base == KERNEL_VERSION:  # the cpu-xla kernel form
            fix = ("that is the cpu-xla kernel form: verify it with LOOPRL_KERNELS=cpu-xla "
                   "(formerly LOOPRL_CPU_MATMUL=xla) on a CPU of its sgemm ISA, or sample it "
                   "again here")
        else:
            fix = "sample it again with this version"
        raise ScheduleError(f"rollout was sampled with kernel version "
                            f"{theirs or '(none recorded)'}"
                            f", this looprl has {here}: its bits come from other "
                            f"kernels; {fix}")
    fp = params_fingerprint(params)
    if fp != rb.schedule.params_fingerprint:
        raise ScheduleError(f"rollout was sampled with parameters {rb.schedule.params_fingerprint}"
                            f", these are {fp}: pass the sampler's --checkpoint")
    params_u = updated_params(cfg, params, rb, opts.update_learning_rate, opts.seed)
    n = min(int(rb.schedule.devices or 1), jax.device_count())
    if n != int(rb.schedule.devices or 1):
        log(f"    note: the rollout was sampled on {rb.schedule.devices} devices, {n} visible: "
            f"its cells run on {n}")
    return _cell_group(cfg, params, params_u, rb, weights=weights, opts=opts, n_devices=n,
                       log=log, notes=notes)
