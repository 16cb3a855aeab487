"""The device check's run: a process for the items, a fresh one for run-to-run, the report.

`check(out, ...)` starts `python -m looprl.verify.device.run --child main` (every item but the
last, each record appended to a file as it is made, so a process killed at its limit keeps
what it finished), then `--child repeat` (the first replay cell again in a fresh process, its
digest compared with the first's). Both use jax's persistent compilation cache (`cache_dir`,
default `~/.cache/looprl/jax-compile`): the repeat, and a rerun, compile nothing. OUT ends
with `report.json` and `report.md` only.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import jax

from looprl import kernels as kn
from looprl.determinism import environment
from looprl.device_reports import REPORT_FORMAT, device_key
from looprl.errors import ConfigError, create_dir
from looprl.verify.device import checks, plan, speed, summary

CACHE_DIR = Path.home() / ".cache" / "looprl" / "jax-compile"
GRACE_S = 30  # a process start (jax, the device) and the last item's overrun
DRY_LIMIT_S = 3600  # a dry run judges no time; a loaded 2-core host is slow
_RECORDS, _FACTS, _REPEAT = ".items.jsonl", ".facts.json", ".repeat.json"


def default_form(dry_run: bool) -> str:
    """`pallas-gpu` on a GPU and in a dry run (interpreted on the CPU), `pallas-tpu` on a TPU.
    Raises ConfigError on a CPU outside a dry run."""
    platform = jax.default_backend()
    if platform == "tpu":
        return "pallas-tpu"
    if platform == "cpu" and not dry_run:
        raise ConfigError("looprl verify --device: no GPU or TPU here; --dry-run runs the "
                          "check at tiny widths on the CPU")
    return "pallas-gpu"


def use_cache(cache_dir: Path) -> None:
    """jax's persistent compilation cache at `cache_dir`, every program cached."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(cache_dir))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def run_item(sz, item: plan.Item, dry_run: bool, scans: checks.Scans) -> dict:
    """One item's record (its kind's check)."""
    k, a = item.kind, item.args
    if k in ("replay", "run_to_run"):
        return checks.replay_cell(sz, *a)
    if k == "needle":
        return checks.needle(sz, *a)
    if k == "scan_matmul":
        return scans.matmul(*a)
    if k == "scan_rows":
        return scans.rows(*a)
    if k.startswith("scan_"):
        return getattr(scans, k[len("scan_"):])(*a)
    if k == "speed":
        return speed.timed_pair(sz, *a, judged=not dry_run)
    raise ValueError(f"unknown item kind {k!r}")


def _selected(sz, groups) -> list[plan.Item]:
    items = plan.items(sz)
    return [i for i in items if not groups or i.group in groups or i.group == "run_to_run"]


def child(role: str, out: Path, form: str, dry_run: bool, scale: float, groups) -> int:
    """A check process: `main` runs every selected item but run-to-run, appending records to
    OUT/.items.jsonl; `repeat` runs the run-to-run item into OUT/.repeat.json."""
    sz = plan.DRY if dry_run else plan.FULL
    items = _selected(sz, groups)
    items = items[:-1] if role == "main" else items[-1:]
    items = [plan.Item(i.name, i.group, i.budget_s * scale, i.meta, i.kind, i.args)
             for i in items]
    with kn.use_form(form):
        jax.clear_caches()  # programs traced under another form must not be reused
        if role == "main":
            kind = jax.devices()[0].device_kind
            facts = {"env": environment(), "device_kind": kind, "device_key": device_key(kind),
                     "form": form, "kernel_version": kn.kernel_version()}
            (out / _FACTS).write_text(json.dumps(facts))
        scans = checks.Scans(sz)
        path = out / (_RECORDS if role == "main" else _REPEAT)
        path.write_text("")

        def sink(rec):
            with path.open("a") as f:
                f.write(json.dumps(rec) + "\n")
        plan.run_items(items, lambda it: run_item(sz, it, dry_run, scans), enforce=not dry_run,
                       sink=sink)
    return 0


def _spawn(role, out, form, dry_run, scale, groups, limit_s, cache_dir) -> tuple[str, str] | None:
    """Run one check process; None when it ended well, else (`timeout` or `error`, why)."""
    cmd = [sys.executable, "-m", "looprl.verify.device.run", "--child", role, str(out),
           "--form", form, "--budget-scale", str(scale), "--cache", str(cache_dir)]
    cmd += (["--dry-run"] if dry_run else []) + (["--groups", ",".join(groups)] if groups else [])
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=limit_s)
    except subprocess.TimeoutExpired:
        return "timeout", f"{role}: killed after {limit_s:.0f} s"
    if p.returncode != 0:
        return "error", f"{role}: exit status {p.returncode}: {(p.stdout + p.stderr)[-1200:]}"
    return None


def _unfinished(items, done: set, ended: tuple[str, str] | None) -> list[dict]:
    """Records of the items a process did not finish: after a crash the first is `error` (it
    was running), the rest `skipped`; after a timeout or none, all `skipped`."""
    out = []
    for i in items:
        if i.name in done:
            continue
        crashed = ended is not None and ended[0] == "error" and not out
        rec = {"name": i.name, "group": i.group, "budget_s": i.budget_s, **i.meta,
               "seconds": 0.0}
        rec.update({"status": "error", "error": ended[1][:1500]} if crashed else
                   {"status": "skipped", "why": "its process ended first"})
        out.append(rec)
    return out


def _read_lines(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _run_to_run(first: dict | None, rep: dict, budget_s: float) -> dict:
    """The run-to-run record: the repeat's facts, `pass` when its digest is the first's."""
    out = {"name": rep.get("name"), "group": "run_to_run", "budget_s": budget_s, **rep}
    out["group"] = "run_to_run"
    if rep.get("status") in ("skipped", "error"):
        return out
    if not first or "digest" not in first:
        out.update(status="skipped", why="the first cell did not run")
    else:
        same = first["digest"] == rep.get("digest")
        out.update(status="pass" if same and rep["status"] == "pass" else "fail",
                   same_bits_as_first=same)
    return out


def check(out: str | Path, dry_run: bool = False, form: str | None = None,
          budget_scale: float = 1.0, cache_dir: Path | None = None, groups=()) -> int:
    """The device check into `out`: report.json, report.md, the verdict line on stdout; the
    exit status (0 on PASS). `groups` restricts the items (run-to-run always runs)."""
    sz = plan.DRY if dry_run else plan.FULL
    known = sorted({i.group for i in plan.items(sz)})
    unknown = sorted(set(groups) - set(known))
    if unknown:
        raise ConfigError(f"--groups: unknown {unknown}; known: {', '.join(known)}")
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # the children's memory
    form = form or default_form(dry_run)
    out = create_dir(out, "OUT")
    cache_dir = Path(cache_dir or CACHE_DIR)
    items = _selected(sz, groups)
    budget = plan.total_budget_s(items[:-1]) * budget_scale
    t0 = time.time()
    ended = {}
    for role, limit in (("main", budget + GRACE_S), ("repeat", items[-1].budget_s * budget_scale
                                                     + GRACE_S)):
        ended[role] = _spawn(role, out, form, dry_run, budget_scale, groups,
                             DRY_LIMIT_S if dry_run else limit, cache_dir)
    errors = [e[1] for e in ended.values() if e]
    recs = _read_lines(out / _RECORDS)
    recs += _unfinished(items[:-1], {r["name"] for r in recs}, ended["main"])
    rep = (_read_lines(out / _REPEAT) or _unfinished(items[-1:], set(), ended["repeat"]))[0]
    first = [r for r in recs if "/" + r["name"] == items[-1].name[len("run_to_run"):]]
    recs.append(_run_to_run(first[0] if first else None, rep, items[-1].budget_s))
    facts_path = out / _FACTS
    facts = (json.loads(facts_path.read_text()) if facts_path.exists() else
             {"env": {}, "device_kind": "unknown", "device_key": "unknown", "form": form,
              "kernel_version": ""})
    report = {"format": REPORT_FORMAT, "command": " ".join(sys.argv), **facts,
              "dry_run": dry_run, "budget_s": plan.total_budget_s(items) * budget_scale,
              "wall_s": round(time.time() - t0, 1), "errors": errors, "items": recs}
    report["exactness"] = summary.exactness(report)
    report["ok"], report["verdict"] = summary.verdict(report)
    for name in (_RECORDS, _FACTS, _REPEAT):
        (out / name).unlink(missing_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "report.md").write_text(summary.report_md(report))
    print(report["verdict"], flush=True)
    return 0 if report["ok"] else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="a device-check process (`looprl verify --device`)")
    p.add_argument("out")
    p.add_argument("--child", choices=("main", "repeat"), required=True)
    p.add_argument("--form", required=True)
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--budget-scale", type=float, default=1.0)
    p.add_argument("--cache", required=True)
    p.add_argument("--groups", default="")
    a = p.parse_args(argv)
    use_cache(Path(a.cache))
    groups = tuple(g for g in a.groups.split(",") if g)
    return child(a.child, Path(a.out), a.form, a.dry_run, a.budget_scale, groups)


if __name__ == "__main__":
    sys.exit(main())
