"""The report of `looprl verify` (docs/DESIGN.md §5-§6): the summary verdict, `report.json` and
`report.md`, and their `env` (`report_environment`: the environment the bits hold for).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import looprl
from looprl import determinism
from looprl.kernels import current_form, kernel_version


def report_environment() -> dict[str, Any]:
    """A report's `env`: `looprl.determinism.environment()` (versions, machine, flags, git
    commit) with looprl's version, the kernel version the rollouts record and the kernel form
    that ran (`cpu-ordered`, `cpu-xla`, `pallas-gpu`, ...)."""
    return {**determinism.environment(), "looprl_version": looprl.__version__,
            "kernel_version": kernel_version(), "kernel_form": current_form().name}


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
              "| dtype | kv | weights | rows | batching | params | dev | method | impl | tokens "
              "| early | req | exact | max abs | mean abs | k3 KL | pass |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in report["cells"]:
        lines.append(
            f"| {c['dtype']} | {c['kv_policy']} | {c['weights']} | {c.get('rollout_rows', '')} | "
            f"{c['batching']} | "
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
