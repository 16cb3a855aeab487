"""The prepared accelerator check (issue 16): everything a GPU (or TPU) session should measure,
in one script sized to finish in under 8 minutes on one H200 (not yet timed on one), writing one
JSON report plus `report.md` under the directory it is given.

    python reproducibility/gpu_check.py OUT_DIR    # a GPU install pins looprl's GPU flags itself
    python reproducibility/gpu_check.py --reduced OUT_DIR    # the plumbing, on a CPU (minutes)

Steps (each a section of report.json; a failing step is recorded, the rest still run; the
exit status is 0 only if every scan is clean, the invariant verify passes, the needle test
passes and the smoke train is exact at every measured step):
  1. scan      kernel row invariance at Ouro-1.4B widths: rows of `kernels.matmul` at M rows
               against the same rows inside a 512-row call, for every weight shape, fp32/bf16,
               and one attention query in calls of other batch, cache and chunk sizes,
               for each accelerator kernel form (`accel-xla`, the default, and the fixed-block
               Pallas kernel, `pallas-gpu` / `pallas-tpu`); on a CPU (`--reduced`) the CPU form
               and, traced as for an accelerator, `accel-xla` and `pallas-gpu` (interpreted)
  2. verify    `looprl verify --quick` with the invariant replay, then `--replay-impl auto`
               (forced re-run where the invariant replay is not exact; skipped when every
               invariant cell is exact, since it would give the same cells)
  3. needle    tests/sampling/test_needle.py (a prompt alone and in batches: same bits)
  4. kernels   the speed ratios of benchmarks/kernels.py (its final JSON line)
  5. train     a smoke `looprl train` (experiments/tiny_arith_smoke.py): per step `replay_impl`
               and `replay_exact_fraction`
The report's `env` records the jax build, backend, device kind and XLA flags (every flag that
pins what the GPU compiler could otherwise choose per program). Commit the output under
`reproducibility/gpu/` with the jax build it ran on. Nothing here is run in CI.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import looprl  # noqa: F401  (sets looprl's XLA flags before jax starts)
import jax
import jax.numpy as jnp
import numpy as np

from looprl.determinism import environment
from looprl.model import init_params, preset
from looprl import kernels as kn
from looprl.verify.matrix import VerifyOptions, run_matrix
from looprl.verify.report import summarize

ROOT = Path(__file__).resolve().parents[1]
OURO_1P4B = {"q_proj": (2048, 2048), "o_proj": (2048, 2048), "gate_proj": (2048, 5632),
             "down_proj": (5632, 2048), "lm_head": (2048, 49152), "exit_gate": (2048, 1)}
REDUCED_ONE = {"q_proj": (256, 272)}  # one weight at toy size (tests)
REDUCED = {"q_proj": (256, 256), "gate_proj": (256, 704), "down_proj": (704, 256),
           "lm_head": (256, 4096), "exit_gate": (256, 1)}
SCAN_ROWS = (1, 2, 3, 5, 7, 8, 9, 16, 17, 64, 300)
PALLAS_SCAN_ROWS = (1, 3, 7, 64, 300)  # fewer compiles for the second form (8-minute budget)


def scan_forms(shapes: dict, rows=SCAN_ROWS) -> dict:
    """`scan` for each kernel form this backend runs: off the CPU both accelerator matmul forms
    (`accel-xla`, the Pallas form of the platform); on a CPU the CPU form in force and, traced
    as for an accelerator (`kernels.use_form`), `accel-xla` and `pallas-gpu` (interpreted).
    Keys `<form>/<weight>_<dtype>`; the kernel version of each form is recorded under
    `kernel_versions`."""
    here = kn.current_form()
    accel, pallas = kn.accelerator_forms()
    names = ([here.name] if here.cpu else []) + [accel, pallas]
    out, versions = {}, {}
    try:
        for name in names:
            with kn.use_form(name):
                jax.clear_caches()  # the form is read when a program is traced
                versions[name] = kn.kernel_version()
                form_rows = PALLAS_SCAN_ROWS if name == pallas and not here.cpu else rows
                try:  # a form that fails to build must not lose the other forms' results
                    for key, v in scan(shapes, form_rows).items():
                        out[f"{name}/{key}"] = v
                    out[f"{name}/attention"] = scan_attention(reduced=shapes is not OURO_1P4B)
                except Exception as e:
                    out[f"{name}/error"] = {"error": f"{type(e).__name__}: {e}"[:2000],
                                            "rows_differing": ["error"]}
    finally:
        jax.clear_caches()
    return {"kernel_versions": versions, "results": out}


def scan_attention(reduced: bool) -> dict:
    """`kernels.attention` for one query of batch row 0 (its last live position, 100 live keys)
    computed in differently shaped calls: alone (C = 1) or as the last of a chunk of 8 or 64
    queries, in a batch of 1 or 5 rows, over a cache of 256 or 640 slots, with 0 or 30 slots of
    left padding. `rows_differing` lists the calls whose bits differ from the first (the batched
    dots' batch count B x H x S/128 changes with B and the cache length; whether the device's
    batched GEMM keeps every matrix's bits is what this measures)."""
    H, K, live = (2, 64, 100) if reduced else (16, 128, 100)
    rng = np.random.default_rng(1)
    q_all = rng.standard_normal((5, 64, H, K)).astype(np.float32)
    kv = rng.standard_normal((2, 5, live, H, K)).astype(np.float32)
    calls = [(1, 256, 1, 0), (1, 256, 8, 0), (5, 256, 8, 0), (1, 640, 64, 0), (5, 640, 1, 30),
             (5, 256, 64, 30)]
    out = {}
    for dtype in ("float32", "bfloat16"):
        f = jax.jit(lambda q, k, v, m: kn.attention(q, k, v, m, K ** -0.5))
        ref, bad = None, []
        for B, S, C, pad in calls:
            k = np.zeros((B, S, H, K), np.float32)
            v = np.zeros((B, S, H, K), np.float32)
            k[:, pad:pad + live], v[:, pad:pad + live] = kv[0, :B], kv[1, :B]
            qpos = pad + live - C + np.arange(C)
            mask = (np.arange(S)[None] >= pad) & (np.arange(S)[None] <= qpos[:, None])
            mask = np.broadcast_to(mask, (B, C, S))
            q = q_all[:B, 64 - C:]
            o = f(*(jnp.asarray(a, dtype) for a in (q, k, v)), jnp.asarray(mask))
            bits = np.asarray(o[0, -1].astype(jnp.float32)).view(np.uint32)
            if ref is None:
                ref = bits
            elif not np.array_equal(bits, ref):
                bad.append(f"B={B},S={S},C={C},pad={pad}")
        out[dtype] = bad
    return {"calls": [f"B={b},S={s},C={c},pad={p}" for b, s, c, p in calls],
            "rows_differing": [f"{d}: {c}" for d, cs in out.items() for c in cs]}


def scan(shapes: dict, rows=SCAN_ROWS) -> dict:
    """Per (weight, dtype): the row counts M whose rows differ in bits from the same rows of a
    512-row call (each M-row block placed at offset 0 and at offset 100 of the big call)."""
    out = {}
    rng = np.random.default_rng(0)
    for name, (i, o) in shapes.items():
        for dtype in ("float32", "bfloat16"):
            w = jnp.asarray(rng.standard_normal((i, o)) / np.sqrt(i), dtype)
            x = jnp.asarray(rng.standard_normal((512, i)), dtype)
            f = jax.jit(kn.matmul)
            big = np.asarray(f(x, w).astype(jnp.float32)).view(np.uint32)
            bad = []
            for m in rows:
                for off in (0, 100):
                    part = np.asarray(f(x[off:off + m], w).astype(jnp.float32)).view(np.uint32)
                    if not np.array_equal(part, big[off:off + m]):
                        bad.append(m)
                        break
            out[f"{name}_{dtype}"] = {"rows_tested": list(rows), "rows_differing": bad}
    return out


def _run(cmd: list[str], timeout: int, env=None) -> tuple[int, str]:
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, **(env or {})})
    return p.returncode, (p.stdout + p.stderr)[-4000:]


def verify(out: Path, reduced: bool) -> dict:
    """`looprl verify --quick` with the invariant replay, then with `--replay-impl auto` (the
    invariant replay per cell, the forced re-run where it is not exact). Where every invariant
    cell is exact `auto` would give the same cells, so it is skipped (it costs a whole matrix)."""
    res = {}
    for impl in ("invariant", "auto"):
        if impl == "auto" and res["invariant"].get("replay_cells") and \
                res["invariant"].get("replay_exact_cells") == res["invariant"]["replay_cells"]:
            res[impl] = {"skipped": "every invariant replay cell is exact"}
            continue
        d = out / f"verify_{impl}"
        if reduced:  # the matrix at toy sizes, in process
            cfg = preset("tiny", num_layers=1)
            opts = VerifyOptions(n_prompts=2, group_size=2, max_new_tokens=4,
                                 small_batches=(1,), small_batch_weights=("random",),
                                 min_tokens=8,
                                 min_early_exit_fraction=0.0, replay_impl=impl)
            prompts = [[1, 5, 6, 2, 1], [1, 9, 2, 1]]
            cells = run_matrix(cfg, {"random": init_params(cfg, 0)}, prompts, opts,
                               log=lambda m: None)
            res[impl] = summarize(cells)
            continue
        rc, tail = _run([sys.executable, "-m", "looprl.cli", "verify", "--quick",
                         "--replay-impl", impl, "--out", str(d)], timeout=420)
        rep = json.loads((d / "report.json").read_text()) if (d / "report.json").exists() \
            else {}
        res[impl] = {"exit_status": rc, **rep.get("summary", {}), "tail": tail[-800:]}
    return res


def needle(reduced: bool) -> dict:
    cmd = [sys.executable, "-m", "pytest", "-q", "tests/sampling/test_needle.py",
           "-m", "slow or not slow"]  # the bf16 cases are under -m slow in the suite
    if reduced:
        cmd += ["-k", "dense and float32"]
    rc, tail = _run(cmd, timeout=420)
    return {"exit_status": rc, "passed": rc == 0, "tail": tail[-800:]}


def kernels_bench(reduced: bool) -> dict:
    if reduced:  # the benchmark runs at Ouro-1.4B widths only (minutes on a CPU)
        return {"skipped": "reduced mode"}
    rc, tail = _run([sys.executable, "benchmarks/kernels.py"], timeout=420)
    last = [ln for ln in tail.splitlines() if ln.startswith("{")]
    return {"exit_status": rc, "figures": json.loads(last[-1]) if last else None,
            "tail": "" if last else tail[-800:]}


def train(out: Path, reduced: bool) -> dict:
    d = out / "smoke_train"
    steps = 2 if reduced else 6
    rc, tail = _run([sys.executable, "-m", "looprl.cli", "train",
                     "experiments/tiny_arith_smoke.py", f"out_dir={d}", f"grpo_steps={steps}",
                     "progress_bar=false", "tensorboard=false", "learner.replay_impl=auto",
                     "learner.require_exact=false"] + (["warm_start.max_steps=20"] if reduced
                                                       else []), timeout=420)
    rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()] \
        if (d / "metrics.jsonl").exists() else []
    return {"exit_status": rc, "steps": [{k: r.get(k) for k in (
        "step", "replay_impl", "replay_exact_fraction", "stock_max_abs_diff")} for r in rows],
        "tail": "" if rows else tail[-800:]}


def report_md(report: dict) -> str:
    env = report["env"]
    lines = [f"# Accelerator check ({env.get('device_kind')}, jax {env.get('jax')})", "",
             f"Backend `{env.get('backend')}`, XLA_FLAGS `{env.get('xla_flags')}`, "
             f"{report['wall_s']:.0f} s{' (reduced mode)' if report['reduced'] else ''}.", "",
             "## Row-invariance scan (kernels.matmul vs rows of a 512-row call)", "",
             "| weight | rows differing |", "|---|---|"]
    for k, v in ((report.get("scan") or {}).get("results") or {}).items():
        lines.append(f"| {k} | {v.get('error') or v['rows_differing'] or 'none'} |")
    versions = (report.get("scan") or {}).get("kernel_versions") or {}
    if versions:
        lines += ["", "Kernel versions: " + ", ".join(f"{f} `{v}`" for f, v in versions.items())]
    lines += ["", "Accelerator pins in force: " + (", ".join(
            f"`{k}`" for k, on in (env.get("accelerator_pins") or {}).items() if on) or "none")]
    lines += ["", "## looprl verify --quick", ""]
    for impl, s in (report.get("verify") or {}).items():
        if "skipped" in s:
            lines.append(f"- `--replay-impl {impl}`: skipped ({s['skipped']})")
            continue
        lines.append(f"- `--replay-impl {impl}`: passed={s.get('passed')}, replay exact "
                     f"{s.get('replay_exact_cells')}/{s.get('replay_cells')} cells "
                     f"({s.get('replay_forced_cells')} forced)")
    n = report.get("needle") or {}
    lines += ["", f"## Needle test: {'pass' if n.get('passed') else 'FAIL'}", "",
              "## benchmarks/kernels.py", "",
              f"`{json.dumps((report.get('kernels') or {}).get('figures'))}`",
              "", "## Smoke train (replay_impl, replay_exact_fraction per step)", ""]
    for s in (report.get("train") or {}).get("steps", []):
        lines.append(f"- step {s['step']}: {s['replay_impl']}, {s['replay_exact_fraction']}")
    for step, err in report.get("errors", {}).items():
        lines.append(f"\n**{step} failed**: `{err}`")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    head, _, rest = __doc__.partition("\n\n")
    p = argparse.ArgumentParser(description=head, epilog=rest,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir", metavar="OUT_DIR", help="directory for report.json and report.md")
    p.add_argument("--reduced", action="store_true",
                   help="toy sizes, to check the plumbing on a CPU in a few minutes")
    args = p.parse_args(argv)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    report = {"env": environment(), "reduced": args.reduced, "errors": {}}
    steps = {"scan": lambda: scan_forms(REDUCED if args.reduced else OURO_1P4B,
                                        (1, 3, 8, 17) if args.reduced else SCAN_ROWS),
             "verify": lambda: verify(out, args.reduced), "needle": lambda: needle(args.reduced),
             "kernels": lambda: kernels_bench(args.reduced),
             "train": lambda: train(out, args.reduced)}
    for name, fn in steps.items():
        t = time.time()
        try:
            report[name] = fn()
        except Exception as e:  # one broken step must not lose the others' figures
            report["errors"][name] = f"{type(e).__name__}: {e}"
        print(f"gpu_check: {name} done in {time.time() - t:.0f} s", file=sys.stderr, flush=True)
    report["wall_s"] = time.time() - t0
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "report.md").write_text(report_md(report))
    ok = (not report["errors"]
          and all(not v["rows_differing"] for v in report["scan"]["results"].values())
          and report["verify"]["invariant"].get("passed") is True
          and report["needle"]["passed"] and report["train"]["exit_status"] == 0
          and all(s["replay_exact_fraction"] in (1.0, None) for s in report["train"]["steps"]))
    print(json.dumps({"benchmark": "gpu_check", "reduced": args.reduced, "ok": ok,
                      "wall_s": round(report["wall_s"], 1)}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
