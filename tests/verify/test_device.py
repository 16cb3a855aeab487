"""`looprl verify --device`, from the CPU: the items' order and budgets, checks that can fail
(a kernel whose rows depend on the row count, a batch-mate), budgets that skip items without
failing their dtype, exactness, the report, and where replay_choice finds committed reports.
The dry run of the carried install is tests/verify/test_carry.py."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from looprl import device_reports, kernels as kn
from looprl.rl import replay_choice as rc
from looprl.determinism import ACCELERATOR_FLAGS
from looprl.verify.device import plan, speed, summary
from looprl.verify.device.checks import Scans, row_scan


def test_items_run_in_order_of_value_within_six_minutes():
    items = plan.items(plan.FULL)
    names = [i.name for i in items]
    first = [f"replay/bfloat16/{p}/rows{r}" for p in ("deferred", "copy")
             for r in (1, 3, 5, 64, 256)]
    assert names[:10] == first
    groups = list(dict.fromkeys(i.group for i in items))
    assert groups == ["replay", "needle", "replay_more", "scan", "speed", "run_to_run"]
    assert [i.meta["dtype"] for i in items if i.group == "replay_more"][0] == "float32"
    assert names[-1] == "run_to_run/" + names[0]
    assert plan.total_budget_s(items) <= plan.TOTAL_BUDGET_S == 360
    assert len(plan.items(plan.DRY)) < len(items)


def test_the_fair_pairs_are_timed_on_a_device_and_skipped_in_a_dry_run():
    """Both steps against the fair baseline, after the stock pairs; on the CPU their items
    stay in the dry run's plan and come back `skipped` with the reason, building nothing."""
    from looprl.verify.device import run
    names = [p.name for p in speed.PAIRS]
    assert names[-2:] == ["learner_step_vs_fair", "decode_step_vs_fair"]
    assert [speed.pair(n).target for n in names[-2:]] == [1.25, 1.2]
    assert [speed.pair(n).target for n in names[:2]] == [1.3, 1.5]  # the stock ratios stay
    flags = {f.removeprefix("--").split("=")[0] for f in ACCELERATOR_FLAGS}
    assert set(speed.FAIR_GPU_OPTIONS) == flags  # every pin undone for the fair compile
    f = jax.jit(lambda x: x * 2).lower(jnp.ones(3)).compile(
        compiler_options=speed.FAIR_GPU_OPTIONS)  # XLA knows each name and value
    assert np.array_equal(np.asarray(f(jnp.ones(3))), [2.0, 2.0, 2.0])
    fair = [i for i in plan.items(plan.DRY) if i.kind == "speed" and "_vs_fair" in i.name]
    assert [i.name for i in fair] == ["speed/learner_step_vs_fair/bfloat16",
                                      "speed/decode_step_vs_fair/bfloat16"]
    recs = plan.run_items(fair, lambda it: run.run_item(plan.DRY, it, True, None),
                          enforce=False)
    why = "jax's Pallas GPU/TPU kernels (the fair baseline) do not run on the cpu"
    assert [(r["status"], r["why"]) for r in recs] == [("skipped", why)] * 2
    rep = _report([_rec("replay", "pass", policy="deferred", rows=1)] + recs, dry=True)
    assert rep["ok"] and "2 skipped" in rep["verdict"]


def test_the_row_scan_catches_a_kernel_whose_rows_depend_on_the_call():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((24, 16)), jnp.float32)
    w = jnp.asarray(np.random.default_rng(1).standard_normal((16, 8)), jnp.float32)
    assert row_scan(lambda x: kn.matmul(x, w), (x,), (1, 3)) == []
    assert row_scan(lambda x: x * x.shape[0], (x,), (1, 3, 24)) == [1, 3]
    assert row_scan(lambda x: x + 1e-3 * x[:1], (x,), (1, 3)) == [1, 3]  # row 0 leaks
    t = jnp.arange(24, dtype=jnp.int32)[:, None] % 8
    assert row_scan(lambda x, t: jnp.take_along_axis(x, t, axis=1), (x, t), (1, 5)) == []


def test_a_scan_item_passes_on_the_cpu_form_and_scans_the_stock_control():
    rec = Scans(plan.DRY).matmul("bfloat16", "q_proj")
    assert rec["status"] == "pass" and rec["rows_differing"] == []
    assert rec["stock_rows_differing"] == []  # q_proj is the dry run's control


def _items(budgets):
    return [plan.Item(f"g/{i}", "g", b, {"dtype": "float32"}, "k", (i,))
            for i, b in enumerate(budgets)]


def test_budgets_pass_unused_time_on_and_skip_what_cannot_start():
    now = [0.0]
    cost = {0: 5.0, 1: 30.0, 2: 1.0, 3: 1.0}

    def run(item):
        now[0] += cost[item.args[0]]
        if item.args[0] == 2:
            raise RuntimeError("kernel exceeds available shared memory")
        return {"status": "pass"}
    recs = plan.run_items(_items([10, 10, 20, 5]), run, clock=lambda: now[0])
    # item 1 starts at 5 s (< 20 allowed) and runs to 35; item 2 may start until 40; item 3
    # (allowed until 45) starts at 36 and runs
    assert [r["status"] for r in recs] == ["pass", "pass", "error", "pass"]
    assert recs[2]["error"] == "RuntimeError: kernel exceeds available shared memory"
    now[0], cost[1] = 0.0, 60.0
    recs = plan.run_items(_items([10, 10, 20, 5]), run, clock=lambda: now[0])
    assert [r["status"] for r in recs] == ["pass", "pass", "skipped", "skipped"]
    now[0] = 0.0  # a dry run skips nothing
    recs = plan.run_items(_items([10, 10, 20, 5]), run, enforce=False, clock=lambda: now[0])
    assert "skipped" not in [r["status"] for r in recs]


def _rec(group, status, dtype="bfloat16", policy=None, rows=None):
    r = {"name": f"{group}/{dtype}/{policy}/{rows}", "group": group, "budget_s": 5,
         "status": status, "dtype": dtype, "seconds": 1.0}
    if policy:
        r["kv_policy"] = policy
    if rows is not None:
        r["rows"] = rows
    return r


def _report(items, dry=False):
    rep = {"env": {"jax": "0.11.2", "jaxlib": "0.11.2", "accelerator_pins": {"P": True}},
           "device_kind": "NVIDIA H200", "device_key": "h200", "form": "pallas-gpu",
           "kernel_version": "2026-12-05-accel/pallas-gpu-sm90", "dry_run": dry,
           "budget_s": 360, "wall_s": 300.0, "errors": [], "items": items}
    rep["exactness"] = summary.exactness(rep)
    rep["ok"], rep["verdict"] = summary.verdict(rep)
    return rep


def test_a_skipped_item_is_not_a_failure_of_its_dtype():
    items = [_rec("replay", "pass", policy="deferred", rows=1),
             _rec("replay", "pass", policy="deferred", rows=3),
             _rec("replay", "pass", policy="copy", rows=1),
             _rec("replay", "fail", policy="copy", rows=3),
             _rec("needle", "skipped", policy="deferred"),
             _rec("scan", "skipped"),
             _rec("replay_more", "pass", dtype="float32", policy="dense", rows=1),
             _rec("scan", "fail", dtype="float32")]
    rep = _report(items)
    ex = rep["exactness"]["replay_exact"]
    assert ex["bfloat16/deferred"] and not ex["bfloat16/copy"]  # skips say nothing
    assert not ex["float32/dense"]  # a failed fp32 scan fails fp32
    assert not ex["bfloat16/dense"] and not rep["exactness"]["measured"]["bfloat16/dense"]
    assert rep["exactness"]["rows_exact"]["bfloat16/deferred"] == [1, 3]
    assert not rep["ok"] and "FAIL" in rep["verdict"] and "2 skipped" in rep["verdict"]
    items[3]["status"], items[7]["status"] = "pass", "pass"
    rep = _report(items)
    assert rep["ok"] and rep["verdict"].startswith("looprl verify --device: PASS on NVIDIA H200")
    items[0]["status"] = "skipped"  # a first-group item that did not run: no PASS
    assert not _report(items)["ok"]


def test_the_report_renders_and_replay_choice_reads_it(tmp_path, monkeypatch):
    items = [_rec("replay", "pass", dtype=d, policy=p, rows=1)
             for d in plan.DTYPES for p in plan.POLICIES]
    items[1]["status"] = "fail"  # bfloat16/copy
    rep = _report(items)
    md = summary.report_md(rep)
    assert "# Device check: NVIDIA H200 (`h200`)" in md and "`P`" in md
    assert "bfloat16/deferred yes" in md and "bfloat16/copy no" in md
    items[2:] = []  # bfloat16/dense and every fp32 cell: not measured
    assert "float32/copy not measured" in summary.report_md(_report(items))
    assert "| replay/bfloat16/copy/1 | fail | 1.0 | 5 |" in md
    facts = rc.DeviceFacts("NVIDIA H200", rep["kernel_version"], "0.11.2")
    (tmp_path / "h200").mkdir()
    (tmp_path / "h200" / "report.json").write_text(json.dumps(rep))
    monkeypatch.setenv(device_reports.ENV, str(tmp_path))
    assert device_reports.reports_dir() == tmp_path
    assert rc.report_choice(facts, "bfloat16", "deferred")[0] == "invariant"
    assert rc.report_choice(facts, "bfloat16", "copy")[0] == "forced"
    rep = _report(items, dry=True)
    (tmp_path / "h200" / "report.json").write_text(json.dumps(rep))
    assert rc.report_choice(facts, "bfloat16", "deferred")[0] == "forced"
    assert "not judged" in summary.report_md(rep)


def test_committed_reports_are_package_data(monkeypatch):
    monkeypatch.delenv(device_reports.ENV, raising=False)
    d = device_reports.reports_dir()
    assert d == device_reports.PACKAGE_REPORTS and d.parent.name == "looprl"
    assert (d / "README.md").is_file()
    text = (device_reports.PACKAGE_REPORTS.parents[1] / "pyproject.toml").read_text()
    assert '"reports/*/report.json"' in text


@pytest.mark.parametrize("kind,key", [("NVIDIA H100 80GB HBM3", "h100_80gb_hbm3"),
                                      ("NVIDIA H200", "h200"), ("TPU v5 lite", "tpu_v5_lite")])
def test_device_keys(kind, key):
    assert device_reports.device_key(kind) == key


def test_the_report_keeps_what_a_killed_process_finished(tmp_path, monkeypatch, capsys):
    """`check` with fake processes: the main one is killed at its limit after two items (the
    rest `skipped`, not failed), the repeat gives the first cell's bits; OUT ends with
    report.json and report.md. A crash instead makes the item it ran an error: FAIL."""
    from looprl.verify.device import run
    items = plan.items(plan.DRY)
    ended = ("timeout", "main: killed after 60 s")

    def spawn(role, out, form, dry_run, scale, groups, limit_s, cache_dir):
        if role == "main":
            (out / run._FACTS).write_text(json.dumps({
                "env": {"jax": "0.10.2"}, "device_kind": "cpu", "device_key": "cpu",
                "form": form, "kernel_version": "v"}))
            recs = [{"name": i.name, "group": i.group, "budget_s": i.budget_s, **i.meta,
                     "status": "pass", "seconds": 1.0, "digest": "d"} for i in items[:2]]
            (out / run._RECORDS).write_text("".join(json.dumps(r) + "\n" for r in recs))
            return ended
        rep = {"name": items[-1].name, **items[-1].meta, "status": "pass", "digest": "d"}
        (out / run._REPEAT).write_text(json.dumps(rep) + "\n")
        return None
    monkeypatch.setattr(run, "_spawn", spawn)
    code = run.check(tmp_path / "out", dry_run=True, cache_dir=tmp_path / "cache")
    rep = json.loads((tmp_path / "out" / "report.json").read_text())
    assert [r["name"] for r in rep["items"]] == [i.name for i in items]
    states = [r["status"] for r in rep["items"]]
    assert states[:2] == ["pass", "pass"] and states[-1] == "pass"
    assert set(states[2:-1]) == {"skipped"} and rep["items"][-1]["same_bits_as_first"]
    assert rep["errors"] == ["main: killed after 60 s"] and rep["dry_run"]
    assert code == 0 and capsys.readouterr().out.strip() == rep["verdict"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["report.json", "report.md"]
    assert rep["budget_s"] == plan.total_budget_s(items)
    ended = ("error", "main: exit status -11: Segmentation fault")
    assert run.check(tmp_path / "out", dry_run=True, cache_dir=tmp_path / "cache") == 1
    rep = json.loads((tmp_path / "out" / "report.json").read_text())
    assert [r["status"] for r in rep["items"]][2:4] == ["error", "skipped"]
    assert "Segmentation fault" in rep["items"][2]["error"] and "FAIL" in rep["verdict"]
