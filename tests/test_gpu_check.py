"""`reproducibility/gpu_check.py`, the device check, from the CPU: its checks can fail (a
kernel whose rows depend on the row count, a batch-mate or a skipped item is caught), its
budget skips items and never passes a section that skipped one, `exactness` (what
`learner.replay_impl=auto` reads) is true only for a fully passed (dtype, policy), and the
report renders. The whole dry run (every section at tiny widths, in process) is `slow`: about
2 minutes on a quiet 2-core host, 7 on a loaded one."""
import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from looprl import kernels as kn
from looprl.rl import replay_choice as rc

SCRIPT = Path(__file__).resolve().parents[1] / "reproducibility" / "gpu_check.py"


@pytest.fixture(scope="module")
def gc():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = mod  # dataclasses look their module up
    saved = list(sys.argv)
    sys.argv = [str(SCRIPT), "--in-process"]  # no XLA_PYTHON_CLIENT_PREALLOCATE change here
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.argv = saved
    return mod


def test_help_and_bad_sections(gc, capsys):
    with pytest.raises(SystemExit) as e:
        gc.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--dry-run" in out and "OUT_DIR" in out and "ratios" in out
    with pytest.raises(SystemExit):
        gc.main(["/tmp/x", "--dry-run", "--sections", "scan,bogus"])
    assert "unknown sections ['bogus']" in capsys.readouterr().err


def test_the_row_scan_catches_a_kernel_whose_rows_depend_on_the_call(gc):
    x = jnp.asarray(np.random.default_rng(0).standard_normal((24, 16)), jnp.float32)
    w = jnp.asarray(np.random.default_rng(1).standard_normal((16, 8)), jnp.float32)
    assert gc.row_scan(lambda x: kn.matmul(x, w), (x,), (1, 3)) == []
    # a row's value that depends on how many rows share the call, or on a batch-mate
    assert gc.row_scan(lambda x: x * x.shape[0], (x,), (1, 3, 24)) == [1, 3]
    assert gc.row_scan(lambda x: x + 1e-3 * x[:1], (x,), (1, 3)) == [1, 3]  # row 0 leaks
    # a sliced second operand is cut with the rows (targets of a log-prob)
    t = jnp.arange(24, dtype=jnp.int32)[:, None] % 8
    assert gc.row_scan(lambda x, t: jnp.take_along_axis(x, t, axis=1), (x, t), (1, 5)) == []


def test_a_budget_skips_items_and_a_section_with_skips_does_not_pass(gc):
    calls = []

    def run(v):
        calls.append(v)
        if v == "boom":
            raise RuntimeError("kernel exceeds available shared memory")
        return {"status": "pass"}
    plan = [("a", {"dtype": "float32"}, "ok"), ("b", {}, "boom"), ("c", {}, "ok")]
    items = gc._items(gc.Budget(60), plan, run)
    assert [i["status"] for i in items] == ["pass", "error", "pass"]
    assert items[1]["error"] == "RuntimeError: kernel exceeds available shared memory"
    assert items[0]["dtype"] == "float32"
    items = gc._items(gc.Budget(-1), plan, run)  # the first item always runs
    assert [i["status"] for i in items] == ["pass", "skipped", "skipped"] and len(calls) == 4
    # a real section: the first item runs (a matmul scan), the spent budget skips the rest
    sz = dataclasses.replace(gc.DRY, weights={"q_proj": (32, 16)}, big_rows=8)
    res = gc.run_section("scan", sz, kn.current_form().name, 1e-9)
    assert res["items"][0]["name"] == "matmul/q_proj/bfloat16"
    assert res["items"][0]["status"] == "pass" and res["items"][0]["rows_differing"] == []
    assert res["items"][0]["stock_rows_differing"] == []  # q_proj is the dry run's control
    assert {i["status"] for i in res["items"][1:]} == {"skipped"}
    assert res["status"] == "incomplete"
    assert kn.current_form().name == "cpu-ordered"  # the form in force again


def _report(sections, dry=False):
    return {"env": {"jax": "0.11.2", "jaxlib": "0.11.2", "accelerator_pins": {"P": True}},
            "device_kind": "NVIDIA H200", "device_key": "h200",
            "kernel_version": "2026-12-05-accel/pallas-gpu-sm90", "form": "pallas-gpu",
            "dry_run": dry, "wall_s": 3.0, "ok": False, "sections": sections}


def _sections(gc):
    ok = {"status": "pass"}
    scan = [{"name": "m", "dtype": d, **ok} for d in gc.DTYPES]
    verify = [{"name": "v", "dtype": "float32", "kv_policy": "dense", **ok},
              {"name": "v", "dtype": "float32", "kv_policy": "dense", "status": "skipped"},
              {"name": "v", "dtype": "float32", "kv_policy": "copy", **ok},
              {"name": "v", "dtype": "float32", "kv_policy": "copy", "status": "fail"},
              {"name": "v", "dtype": "float32", "kv_policy": "deferred", **ok},
              {"name": "v", "dtype": "bfloat16", "kv_policy": "dense", **ok}]
    needle = [{"name": "n", "dtype": "float32", "kv_policy": "deferred", "status": "fail"}]
    return {"scan": {"items": scan}, "verify": {"items": verify}, "needle": {"items": needle}}


def test_exactness_needs_every_item_of_a_dtype_and_policy(gc):
    rep = _report(_sections(gc))
    scan = rep["sections"]["scan"]["items"]
    ex = gc.exactness(rep)
    assert ex["replay_exact"] == {"float32/dense": True, "float32/deferred": False,
                                  "float32/copy": False, "bfloat16/dense": True,
                                  "bfloat16/deferred": False, "bfloat16/copy": False}
    assert (ex["device_kind"], ex["jax"], ex["dry_run"]) == ("NVIDIA H200", "0.11.2", False)
    scan[1]["status"] = "skipped"  # bf16's scan did not finish: nothing in bf16 counts
    assert not gc.exactness(rep)["replay_exact"]["bfloat16/dense"]
    assert gc.exactness(_report(_sections(gc), dry=True))["dry_run"] is True


def test_the_report_renders_and_replay_choice_reads_it(gc, tmp_path):
    rep = _report(_sections(gc))
    rep["exactness"] = gc.exactness(rep)
    facts = rc.DeviceFacts("NVIDIA H200", rep["kernel_version"], "0.11.2")
    assert gc.device_key(rep["device_kind"]) == "h200"
    rep["sections"]["ratios"] = {"status": "fail", "budget_s": 80, "seconds": 5, "items": [
        {"name": "decode_step/bfloat16", "dtype": "bfloat16", "status": "fail", "ratio": 2.5,
         "target": 1.5, "seconds": 1.0}], "error": None}
    md = gc.report_md(rep)
    assert "# Device check: NVIDIA H200 (`h200`)" in md and "`P`" in md
    assert "float32/dense yes" in md and "float32/copy no" in md
    assert "| decode_step/bfloat16 | fail | 1.0 | ratio 2.5; target 1.5 |" in md
    (tmp_path / "h200").mkdir()
    (tmp_path / "h200" / "report.json").write_text(json.dumps(rep))
    assert rc.report_choice(facts, "float32", "dense", tmp_path)[0] == "invariant"
    assert rc.report_choice(facts, "float32", "copy", tmp_path)[0] == "forced"
    rep["exactness"]["dry_run"] = True
    (tmp_path / "h200" / "report.json").write_text(json.dumps(rep))
    assert rc.report_choice(facts, "float32", "dense", tmp_path)[0] == "forced"


@pytest.mark.slow  # every section at tiny widths: ~2 min quiet, ~7 min on a loaded 2-core host
def test_the_dry_run_runs_every_section(gc, tmp_path):
    rc_ = gc.main([str(tmp_path), "--dry-run", "--in-process", "--budget-scale", "0.05"])
    rep = json.loads((tmp_path / "report.json").read_text())
    assert rc_ == (0 if rep["ok"] else 1) and rep["dry_run"] and rep["device_key"] == "cpu"
    assert list(rep["sections"]) == list(gc.SECTIONS)
    for name, s in rep["sections"].items():  # the first item of each ran, and passed
        assert s["items"][0]["status"] == "pass", (name, s["items"][0])
    assert rep["sections"]["ratios"]["items"][0]["ratio"] > 0
    assert rep["sections"]["smoke"]["items"][0]["steps"][0]["replay_exact_fraction"] == 1.0
    assert rep["exactness"]["dry_run"] is True
    assert (tmp_path / "report.md").read_text().startswith("# Device check: cpu")
