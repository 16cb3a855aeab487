"""`looprl verify`: the reproducibility matrix of DESIGN.md §5 and its report (§6).

Cells: compute dtype {float32, bfloat16} x KV policy {dense, deferred, copy} x weights {random,
trained} x learner batching {same, different} x parameters {sampler, updated} (x devices {1, N}
when N > 1 devices are visible), each with the methods `replay`, `dense` and `stock`.

- One rollout per (weights, dtype, policy) at q < 1, temperature 1, untruncated, stop ids off
  (every row decodes `max_new_tokens`, so each cell holds rows x max_new_tokens >= 512 sampled
  tokens; EOS handling is covered by tests/sampling). The rollout is reused by every batching,
  parameter set and method of its cells.
- `same` batching: the learner sees the rollout's rows in order, as one batch. `different`: a
  random permutation of the rows in minibatches of half the rollout's size.
- `sampler` params: compared with the rollout's recorded log-probs. `updated`: params one AdamW
  step (a policy-gradient loss on hybrid log-probs with random +-1 advantages) away; the learner
  runs on the rollout with its log-probs removed (`without_logprobs`) and is compared with the
  sampler re-run in forced mode at the updated params.
- devices N (when N > 1 devices are visible): the rollout sampled again with its rows split
  across N devices, and its learner on the same split (`looprl.distributed.mesh`: every device
  runs the one-device program on its rows, parameters all-gathered), `same` batching; these
  cells also report `exact_fraction_vs_one_device_sampler` (informative).

Per cell: `exact_fraction` (raw bits equal, as uint32), `max_abs_diff`, `mean_abs_diff`, `k3_kl`
(mean over sampled tokens of the k3 estimate of KL(learner || sampler)). A `replay` cell passes
only at exact fraction 1.0; `negative_control` lists the `stock` cells, each of which must show
mismatches (exact < 1) while staying within 1e-4 of the sampler in fp32. `replay_impl` says how
a replay cell was computed: `invariant` (the learner's dense pass under stop_gradient, the
default) or `forced` (the sampler re-run in forced mode on the whole recorded batch,
`looprl.learner.logprobs.forced_replay_logprobs`; only with `--replay-impl auto`, for cells
whose invariant replay is not exact, and then the invariant result stays in the report as
`invariant_exact_fraction`; and always for a rollout sampled with `kernels="stock"`, which
`batch_logprobs` replays by the forced re-run since no invariant pass reproduces it).

Requirements (per cell `requirements_unmet`, a list of reasons; `requirements_met` is its
emptiness): at least `min_tokens` (512) sampled tokens, the Q-exit rule with q < 1 (not a fixed
depth), and at least `min_early_exit_fraction` (20%) of tokens exiting before loop T. A cell whose
rollout misses them fails whatever its bits; the console and report.md say which. With batch
size 1 the `different` batching is the `same` one (a permutation of one row), so its cells are
skipped and `notes` in the report says so.

Bits hold for one jax/jaxlib build, backend, CPU model / device kind and thread count; the
report's `env` records them. The CLI pins XLA CPU to one intra-op thread by appending
`--xla_cpu_multi_thread_eigen=false` to XLA_FLAGS (with looprl's required
`--xla_cpu_use_fusion_emitters=false`, see `looprl.determinism`) unless the user set them.
"""
from __future__ import annotations

import dataclasses
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PINNED_XLA_FLAGS = "--xla_cpu_multi_thread_eigen=false"
DTYPES = ("float32", "bfloat16")
POLICIES = ("dense", "deferred", "copy")
METHODS = ("replay", "dense", "stock")
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

    @classmethod
    def quick(cls, **kw) -> "VerifyOptions":
        return cls(**kw)

    @classmethod
    def full(cls, **kw) -> "VerifyOptions":
        base = dict(n_prompts=8, group_size=4, max_new_tokens=64, warm_start_steps=300,
                    warm_start_gate_steps=100)
        base.update(kw)
        return cls(**base)


# --- environment --------------------------------------------------------------------------------

def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_commit() -> dict[str, Any]:
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=root, capture_output=True, text=True, timeout=10).stdout
        return {"git_commit": head or None, "git_dirty": bool(dirty.strip())}
    except (OSError, subprocess.SubprocessError):
        return {"git_commit": None, "git_dirty": None}


def environment() -> dict[str, Any]:
    """What the bits depend on (DESIGN.md §5): build, backend, CPU/device, threads, flags, commit."""
    import jax
    import jaxlib

    dev = jax.devices()[0]
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = None
    return {
        "jax": jax.__version__, "jaxlib": jaxlib.__version__, "python": platform.python_version(),
        "backend": jax.default_backend(), "device_kind": dev.device_kind,
        "device_count": jax.device_count(), "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(), "cpu_affinity": affinity,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "intra_op_threads": 1 if "xla_cpu_multi_thread_eigen=false" in
        os.environ.get("XLA_FLAGS", "") else affinity,
        "platform": platform.platform(), **_git_commit(),
    }


# --- comparisons --------------------------------------------------------------------------------

def compare_logprobs(lp_BxS, ref_BxS, mask_BxS) -> dict[str, float]:
    """Exact-bit fraction (fp32 bits as uint32), max/mean |delta| and mean k3 KL over `mask`."""
    import numpy as np

    lp = np.asarray(lp_BxS, np.float32)[mask_BxS]
    ref = np.asarray(ref_BxS, np.float32)[mask_BxS]
    exact = lp.view(np.uint32) == ref.view(np.uint32)
    diff = np.abs(lp.astype(np.float64) - ref.astype(np.float64))
    x = ref.astype(np.float64) - lp.astype(np.float64)  # k3 of KL(learner || sampler)
    k3 = np.expm1(x) - x
    n = max(int(lp.size), 1)
    return {"exact_fraction": float(exact.sum() / n),
            "max_abs_diff": float(np.max(diff, initial=0.0)),
            "mean_abs_diff": float(diff.sum() / n), "k3_kl": float(k3.sum() / n)}


# --- the learner side of a cell -----------------------------------------------------------------

def device_mesh(devices: int):
    """A data-parallel mesh over the first `devices` devices (None for one device)."""
    if devices <= 1:
        return None
    import jax

    from looprl.distributed.mesh import make_mesh
    return make_mesh(None, jax.devices()[:devices])


def learner_logprobs(cfg, params, batch, method: str, batching: str, perm, minibatch: int,
                     devices: int = 1, replay_impl: str = "invariant"):
    """Learner log-probs `[B, S]` of `batch` in the row order the cell compares (identity for
    `same`, `perm` for `different`). `replay` of a stock-kernel rollout is always the forced
    re-run (`replay_impl_of`). `devices` > 1: the rows split across that many devices
    (`looprl.distributed.mesh`; each device runs the one-device program on its rows)."""
    import numpy as np

    from looprl.learner.logprobs import batch_logprobs, forced_replay_logprobs

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
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from looprl.learner.logprobs import sequence_logprobs

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
    import numpy as np

    sch = rb.schedule
    T = sch.total_ut_steps
    mask = np.asarray(rb.exit_loop_BxS) > 0
    tokens = int(mask.sum())
    early = float((np.asarray(rb.exit_loop_BxS)[mask] < T).mean()) if tokens else 0.0
    B = sch.batch_size
    perm = np.random.default_rng(opts.seed + 1).permutation(B)
    minibatch = max(B // 2, 1)
    base = {"dtype": sch.compute_dtype, "kv_policy": sch.kv_policy, "weights": weights,
            "exit_threshold": sch.exit_threshold, "tokens": tokens,
            "early_exit_fraction": early,
            "mean_exit_loop": float(np.asarray(rb.exit_loop_BxS)[mask].mean()),
            "deferred_flushes": int(np.asarray(rb.flush_BxS).sum())}
    unmet = requirement_failures(tokens, early, sch, opts)
    refs = {"sampler": np.asarray(rb.logprob_BxS)}
    t0 = time.time()
    forced = __import__("looprl.learner.logprobs", fromlist=["x"]).forced_replay_logprobs
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
    skipped layouts go to `notes`."""
    import jax

    from looprl.sampling.sampler import SamplingConfig, generate

    n_devices = jax.device_count()
    cells = []
    for weights, params in weight_sets.items():
        q = opts.exit_threshold_trained if weights == "trained" else opts.exit_threshold_random
        params_u = None
        for dtype in DTYPES:
            for policy in POLICIES:
                t0 = time.time()
                scfg = SamplingConfig(max_new_tokens=opts.max_new_tokens, temperature=1.0,
                                      exit_threshold=q, kv_policy=policy,
                                      deferred_max_pending=opts.deferred_max_pending,
                                      stop_ids=(), compute_dtype=dtype)
                rb = generate(cfg, params, prompts, scfg, group_size=opts.group_size,
                              seed=opts.seed, step=0)
                log(f"  {weights} {dtype} {policy}: rollout {time.time() - t0:.1f}s")
                if rollout_dir is not None:
                    rb.save(rollout_dir / f"{weights}_{dtype}_{policy}.npz")
                if params_u is None:
                    params_u = updated_params(cfg, params, rb, opts.update_learning_rate,
                                              opts.seed)
                cells += _cell_group(cfg, params, params_u, rb, weights=weights, opts=opts,
                                     n_devices=1, log=log, notes=notes)
                if n_devices > 1:  # the same rollout sampled with its rows split over devices
                    t0 = time.time()
                    rbm = generate(cfg, params, prompts, scfg, group_size=opts.group_size,
                                   seed=opts.seed, step=0, mesh=device_mesh(n_devices))
                    log(f"  {weights} {dtype} {policy}: rollout on {n_devices} devices "
                        f"{time.time() - t0:.1f}s")
                    cells += _cell_group(cfg, params, params_u, rbm, weights=weights, opts=opts,
                                         n_devices=n_devices, log=log, notes=notes)
    return cells


def verify_rollout(cfg, params, rb, opts: VerifyOptions, weights: str = "checkpoint", log=print,
                   notes: list[str] | None = None):
    """The cells of one saved rollout (re-verification). Raises ScheduleError when `params` are
    not the ones the rollout was sampled with (fingerprint mismatch)."""
    from looprl.errors import ScheduleError
    from looprl.sampling.schedule import params_fingerprint

    fp = params_fingerprint(params)
    if fp != rb.schedule.params_fingerprint:
        raise ScheduleError(f"rollout was sampled with parameters {rb.schedule.params_fingerprint}"
                            f", these are {fp}: pass the sampler's --checkpoint")
    import jax
    params_u = updated_params(cfg, params, rb, opts.update_learning_rate, opts.seed)
    n = min(int(rb.schedule.devices or 1), jax.device_count())
    if n != int(rb.schedule.devices or 1):
        log(f"    note: the rollout was sampled on {rb.schedule.devices} devices, {n} visible: "
            f"its cells run on {n}")
    return _cell_group(cfg, params, params_u, rb, weights=weights, opts=opts, n_devices=n,
                       log=log, notes=notes)


# --- report -------------------------------------------------------------------------------------

def summarize(cells: list[dict]) -> dict[str, Any]:
    replay = [c for c in cells if c["method"] == "replay"]
    stock = [c for c in cells if c["method"] == "stock"]
    failures = [c for c in cells if c.get("passed") is False]
    return {"replay_cells": len(replay),
            "replay_exact_cells": sum(c["exact_fraction"] == 1.0 for c in replay),
            "replay_forced_cells": sum(c.get("replay_impl") == "forced" for c in replay),
            "negative_control_cells": len(stock),
            "negative_control_mismatching": sum(c["exact_fraction"] < 1.0 for c in stock),
            "failed_cells": len(failures),
            "requirements_met": all(c["requirements_met"] for c in cells),
            "requirements_unmet": list(dict.fromkeys(
                r for c in cells for r in c.get("requirements_unmet", ()))),
            "passed": not failures and bool(replay) and bool(stock)}


def write_report(out: Path, report: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "report.md").write_text(report_markdown(report))


def report_markdown(report: dict) -> str:
    env, s = report["env"], report["summary"]
    lines = ["# looprl reproducibility report", "",
             f"Verdict: **{'PASS' if s['passed'] else 'FAIL'}** — replay exact in "
             f"{s['replay_exact_cells']}/{s['replay_cells']} cells "
             f"({s['replay_forced_cells']} via forced replay), negative control mismatching in "
             f"{s['negative_control_mismatching']}/{s['negative_control_cells']} cells.", "",
             f"Requirements (per rollout: >= {report['setup'].get('min_tokens', 512)} sampled "
             f"tokens, q < 1, >= {report['setup'].get('min_early_exit_fraction', 0.2):.0%} early "
             f"exit): "
             + ("met." if s.get("requirements_met", True) else
                "**not met**: " + "; ".join(s.get("requirements_unmet", [])) +
                " (such cells fail whatever their bits)."), ""]
    if report.get("notes"):
        lines += ["Notes:", ""] + [f"- {n}" for n in report["notes"]] + [""]
    lines += ["## Environment", ""]
    lines += [f"- {k}: `{v}`" for k, v in env.items()]
    lines += ["", "## Setup", ""]
    lines += [f"- {k}: `{v}`" for k, v in report["setup"].items() if k != "warm_start_curve"]
    lines += ["", "## Cells", "",
              "| dtype | kv | weights | batching | params | dev | method | impl | tokens | early "
              "| req | exact | max abs | mean abs | k3 KL | pass |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in report["cells"]:
        lines.append(
            f"| {c['dtype']} | {c['kv_policy']} | {c['weights']} | {c['batching']} | "
            f"{c['params']} | {c['devices']} | {c['method']} | {c.get('replay_impl', '')} | "
            f"{c['tokens']} | {c['early_exit_fraction']:.2f} | "
            f"{'yes' if c['requirements_met'] else '**NO**'} | {c['exact_fraction']:.4f} | "
            f"{c['max_abs_diff']:.2e} | {c['mean_abs_diff']:.2e} | {c['k3_kl']:.1e} | "
            f"{'' if c['passed'] is None else ('yes' if c['passed'] else '**NO**')} |")
    lines += ["", "A `replay` cell passes at exact fraction 1.0 (raw fp32 bits). `stock` cells are "
              "the negative control: they must mismatch, and stay within 1e-4 in fp32. `dense` "
              "is informative (exact where the kernels are invariant). `req`: whether the cell's "
              "rollout met the requirements above.", ""]
    return "\n".join(lines)


# --- CLI ----------------------------------------------------------------------------------------

def _load_weights(args, opts: VerifyOptions, log):
    """(cfg, weight_sets, prompts, setup) from --checkpoint / --config / defaults."""
    import jax
    import numpy as np

    from looprl.model.config import preset
    from looprl.model.looped import init_params
    from looprl.tasks.arithmetic import ArithmeticTask

    setup: dict[str, Any] = {}
    task = ArithmeticTask(seed=0)
    tokenizer = task.tokenizer()
    if args.checkpoint:
        from looprl.tokenizer import tokenizer_from_json
        from looprl.train.checkpoint import load_model_checkpoint
        params, cfg, tok_json, meta = load_model_checkpoint(args.checkpoint)
        params = jax.tree.map(np.asarray, params)
        if tok_json:
            tokenizer = tokenizer_from_json(tok_json)
        setup.update(checkpoint=str(args.checkpoint), checkpoint_meta_keys=sorted(meta))
        weight_sets = {"random": init_params(cfg, opts.seed), "trained": params}
        setup["trained_weights"] = f"checkpoint {args.checkpoint}"
    else:
        from looprl.train.warm_start import warm_start
        model_preset, overrides = "tiny", {}
        if args.config:
            from looprl.config import load_experiment
            exp = load_experiment(args.config)
            model_preset = exp.model.preset
            overrides = {k: getattr(exp.model, k) for k in
                         ("hidden_size", "num_layers", "num_heads", "intermediate_size",
                          "total_ut_steps") if getattr(exp.model, k) is not None}
            setup["config"] = str(args.config)
        cfg = preset(model_preset, vocab_size=tokenizer.vocab_size, **overrides)
        params0 = init_params(cfg, opts.seed)
        t0 = time.time()
        trained, ws = warm_start(cfg, params0, task, tokenizer, steps=opts.warm_start_steps,
                                 batch_size=opts.warm_start_batch_size,
                                 learning_rate=opts.warm_start_learning_rate, seed=opts.seed,
                                 gate_steps=opts.warm_start_gate_steps)
        log(f"  warm start: {time.time() - t0:.1f}s, stage-I loss {ws['stage1_final_loss']:.4f}")
        weight_sets = {"random": params0, "trained": trained}
        setup.update(trained_weights="looprl.train.warm_start (arithmetic chain_sum task)",
                     warm_start_stage1_steps=ws["stage1_steps"],
                     warm_start_stage1_final_loss=ws["stage1_final_loss"],
                     warm_start_stage2_steps=ws["stage2_steps"],
                     warm_start_stage2_final_loss=ws["stage2_final_loss"],
                     warm_start_batch_size=ws["batch_size"],
                     warm_start_learning_rate=ws["learning_rate"])
    prompts = task_prompts(task, tokenizer, opts.n_prompts)
    setup.update(model={k: v for k, v in cfg.to_dict().items()}, num_params=cfg.num_params,
                 prompt_lengths=[len(p) for p in prompts], **dataclasses.asdict(opts))
    return cfg, weight_sets, prompts, setup


def check_out_dir(out: Path) -> None:
    """Raises ConfigError when `out` is a file. A report already in `out` is replaced at the
    end (DESIGN.md §6: `looprl verify --quick --out DIR` needs no other flag), with a note on
    stderr now, so it is never replaced silently."""
    from looprl.errors import ConfigError

    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out: {str(out)!r} exists and is not a directory")
    if (out / "report.json").exists():
        print(f"looprl verify: note: {out / 'report.json'} exists and will be replaced when "
              f"this run finishes", file=sys.stderr)


def run_verify(args) -> int:
    """`looprl verify`: run the matrix (or re-verify `--rollout`), write the report, return the
    exit status (0 only if every replay cell is exact and every negative control mismatches
    within 1e-4 in fp32, and every cell met its size requirements; when requirements are unmet
    the console and report.md say which). Raises ConfigError when `--out` is a file or
    `--config` is given with `--rollout`, ScheduleError for an
    unreadable rollout or one sampled with other parameters, CheckpointError for a bad
    `--checkpoint`."""
    from looprl import determinism
    from looprl.errors import ConfigError
    determinism.configure_xla(pin_threads=True)  # one intra-op thread + looprl's required flags
    import jax
    import numpy as np

    t_start = time.time()
    out = Path(args.out)
    check_out_dir(out)
    if args.rollout and args.config:
        raise ConfigError("--config has no effect with --rollout (the rollout records its "
                          "schedule): pass --checkpoint CKPT, the parameters it was sampled with")
    make = VerifyOptions.quick if args.quick else VerifyOptions.full
    opts = make(replay_impl=args.replay_impl)
    notes: list[str] = []

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    if args.rollout:
        from looprl.sampling.schedule import RolloutBatch
        rb = RolloutBatch.load(args.rollout)
        out.mkdir(parents=True, exist_ok=True)
        if args.checkpoint:
            from looprl.train.checkpoint import load_model_checkpoint
            params, cfg, _, _ = load_model_checkpoint(args.checkpoint)
            params = jax.tree.map(np.asarray, params)
        else:
            params, cfg = _rollout_params(Path(args.rollout))
        cells = verify_rollout(cfg, params, rb, opts, weights="checkpoint", log=log, notes=notes)
        setup = {"rollout": str(args.rollout), "checkpoint": args.checkpoint,
                 "schedule": rb.schedule.to_dict(), "replay_impl": opts.replay_impl,
                 "min_tokens": opts.min_tokens,
                 "min_early_exit_fraction": opts.min_early_exit_fraction}
    else:
        cfg, weight_sets, prompts, setup = _load_weights(args, opts, log)
        rdir = out / "rollouts"
        rdir.mkdir(parents=True, exist_ok=True)
        for name, p in weight_sets.items():
            _save_params(rdir / f"{name}_params.npz", p, cfg)
        cells = run_matrix(cfg, weight_sets, prompts, opts, log=log, rollout_dir=rdir,
                           notes=notes)
    summary = summarize(cells)
    report = {"format_version": 1, "command": "looprl verify " + " ".join(sys.argv[2:])
              if sys.argv[1:2] == ["verify"] else "looprl verify", "env": environment(),
              "setup": setup, "summary": summary, "cells": cells,
              "negative_control": [c for c in cells if c["method"] == "stock"],
              "notes": notes, "wall_s": round(time.time() - t_start, 1)}
    write_report(out, report)
    if not summary["requirements_met"]:
        log("looprl verify: FAIL: requirements not met: "
            + "; ".join(summary["requirements_unmet"])
            + " (cells of such a rollout fail whatever their bits; see report.md)")
    log(f"looprl verify: {'PASS' if summary['passed'] else 'FAIL'} "
        f"({summary['replay_exact_cells']}/{summary['replay_cells']} replay cells exact, "
        f"{summary['negative_control_mismatching']}/{summary['negative_control_cells']} negative "
        f"controls mismatching) in {report['wall_s']}s -> {out / 'report.json'}")
    return 0 if summary["passed"] else 1


def _save_params(path: Path, params, cfg) -> None:
    """The weights a rollout was sampled with, next to it, so `--rollout` can re-verify it."""
    import jax
    import numpy as np

    flat = {jax.tree_util.keystr(k): np.asarray(v)
            for k, v in jax.tree_util.tree_leaves_with_path(params)}
    np.savez(path, model_config=np.asarray(json.dumps(cfg.to_dict())), **flat)


def _rollout_params(rollout: Path):
    """Params saved by `looprl verify` next to a rollout (`<weights>_params.npz`)."""
    import jax
    import numpy as np

    from looprl.errors import ScheduleError
    from looprl.model.config import OuroConfig
    from looprl.model.looped import init_params

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
