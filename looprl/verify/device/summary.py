"""The device check's summary: exactness per (dtype, KV policy), the verdict and `report.md`.

Replay is exact here for `<dtype>/<policy>` when at least one replay item of it ran and every
one that ran passed, and no needle, run-to-run or scan item of it (a scan: of its dtype) that
ran failed. A skipped item is reported as skipped and says nothing: it neither passes nor
fails its dtype. `looprl.rl.replay_choice` reads `exactness`.
"""
from __future__ import annotations

import json

from looprl.verify.device.plan import DTYPES, POLICIES

BAD = ("fail", "error")


def exactness(report: dict) -> dict:
    """The `exactness` block: device kind, kernel version, jax build, form, dry run, and per
    `<dtype>/<policy>` whether replay is exact (module doc) with the rows it was shown at."""
    recs = [r for r in report["items"] if r["status"] != "skipped"]
    exact, rows, measured = {}, {}, {}
    for d in DTYPES:
        scan_bad = any(r["group"] == "scan" and r.get("dtype") == d and r["status"] in BAD
                       for r in recs)
        for p in POLICIES:
            mine = [r for r in recs if r.get("dtype") == d and r.get("kv_policy") == p]
            replay = [r for r in mine if r["group"] in ("replay", "replay_more")]
            others_bad = any(r["status"] in BAD for r in mine
                             if r["group"] in ("needle", "run_to_run"))
            exact[f"{d}/{p}"] = (bool(replay) and all(r["status"] == "pass" for r in replay)
                                 and not others_bad and not scan_bad)
            rows[f"{d}/{p}"] = sorted({r["rows"] for r in replay if r["status"] == "pass"})
            measured[f"{d}/{p}"] = bool(replay)
    env = report["env"]
    return {"device_kind": report["device_kind"], "kernel_version": report["kernel_version"],
            "jax": env.get("jax"), "jaxlib": env.get("jaxlib"), "form": report["form"],
            "dry_run": report["dry_run"], "replay_exact": exact, "rows_exact": rows,
            "measured": measured}


def verdict(report: dict) -> tuple[bool, str]:
    """(ok, the one-line verdict). ok: no item failed or raised and every first-group (bf16
    replay) item ran; skipped items of later groups are counted, not failed. In a dry run the
    speed ratios and budgets are recorded, not judged."""
    items = report["items"]
    bad = [r["name"] for r in items if r["status"] in BAD]
    skipped = [r["name"] for r in items if r["status"] == "skipped"]
    first_skipped = [r for r in items if r["group"] == "replay" and r["status"] == "skipped"]
    ok = not bad and not first_skipped and bool(items)
    ex = report["exactness"]["replay_exact"]
    exact = [k for k, v in ex.items() if v]
    line = (f"looprl verify --device: {'PASS' if ok else 'FAIL'} on {report['device_kind']} "
            f"({report['form']}, jax {report['env'].get('jax')}"
            f"{', DRY RUN: counts for nothing' if report['dry_run'] else ''}): "
            f"replay exact in {', '.join(exact) or 'none'}")
    if bad:
        line += f"; failed {len(bad)}: {', '.join(bad[:3])}{' ...' if len(bad) > 3 else ''}"
    if skipped:
        line += f"; {len(skipped)} skipped"
    return ok, line + f"; {report['wall_s']:.0f} s"


def report_md(report: dict) -> str:
    """`report.md`: the verdict, exactness, the pins in force, one table row per item."""
    ex = report["exactness"]
    lines = [f"# Device check: {report['device_kind']} (`{report['device_key']}`)", "",
             report["verdict"], "",
             f"Form `{report['form']}`, kernel version `{report['kernel_version']}`, jax "
             f"{ex['jax']}, {report['wall_s']:.0f} s of {report['budget_s']:.0f} s budgeted.", ""]
    if report["dry_run"]:
        lines += ["Dry run: tiny widths, interpreted kernels on the CPU. Time budgets and speed "
                  "ratios are recorded here, not judged; the report counts for nothing.", ""]
    lines += ["Replay exact (what `learner.replay_impl=auto` reads): " + ", ".join(
        f"{k} {'yes' if v else 'no' if ex['measured'][k] else 'not measured'}"
        for k, v in ex["replay_exact"].items()), "",
        "Accelerator pins in force: " + (", ".join(
            f"`{k}`" for k, on in (report["env"].get("accelerator_pins") or {}).items()
            if on) or "none"), ""]
    if report.get("errors"):
        lines += [f"Process errors: `{e}`" for e in report["errors"]] + [""]
    skip = {"name", "status", "seconds", "group", "budget_s", "digest"}
    lines += ["| item | status | s | budget s | details |", "|---|---|---|---|---|"]
    for r in report["items"]:
        details = "; ".join(f"{k} {json.dumps(v)}" for k, v in r.items() if k not in skip)
        lines.append(f"| {r['name']} | {r['status']} | {r.get('seconds', '')} | "
                     f"{r['budget_s']} | {details.replace('|', '/')} |")
    return "\n".join(lines) + "\n"
