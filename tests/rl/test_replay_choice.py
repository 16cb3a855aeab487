"""`learner.replay_impl=auto` off the CPU (`looprl.rl.replay_choice`): the invariant replay only
where a committed device report of this device kind, kernel version and jax build shows it
exact for the run's dtype and KV policy; the forced re-run elsewhere, said in one line. Fake
reports in a temporary directory; no device needed."""
import json
from pathlib import Path

import pytest

from looprl.config import apply_overrides, load_experiment
from looprl.rl import replay_choice as rc

SMOKE = Path(__file__).resolve().parents[2] / "experiments" / "tiny_arith_smoke.py"
H100 = rc.DeviceFacts("NVIDIA H100 80GB HBM3", "2026-12-05-accel/pallas-gpu-sm90", "0.11.2")


def _report(root: Path, facts=H100, exact=None, dry_run=False, key=None):
    exact = {"float32/deferred": True, "bfloat16/deferred": False} if exact is None else exact
    d = root / (key or rc.device_key(facts.kind))
    d.mkdir(parents=True, exist_ok=True)
    (d / "report.json").write_text(json.dumps({"format": rc.REPORT_FORMAT, "exactness": {
        "device_kind": facts.kind, "kernel_version": facts.kernel_version, "jax": facts.jax,
        "dry_run": dry_run, "replay_exact": exact}}))


def test_device_keys():
    assert rc.device_key("NVIDIA H100 80GB HBM3") == "h100_80gb_hbm3"
    assert rc.device_key("NVIDIA H200") == "h200"
    assert rc.device_key("TPU v5 lite") == "tpu_v5_lite"
    assert rc.device_key("TPU v6e") == "tpu_v6e"
    assert rc.device_key("cpu") == "cpu"
    assert rc.device_key("  ") == "unknown"


def test_a_report_decides_per_dtype_and_policy(tmp_path):
    _report(tmp_path)
    impl, why = rc.report_choice(H100, "float32", "deferred", tmp_path)
    assert impl == "invariant" and "h100_80gb_hbm3/report.json shows exact replay" in why
    assert rc.report_choice(H100, "bfloat16", "deferred", tmp_path)[0] == "forced"
    impl, why = rc.report_choice(H100, "float32", "copy", tmp_path)
    assert impl == "forced" and "not measured" in why
    assert "not exact" in rc.report_choice(H100, "bfloat16", "deferred", tmp_path)[1]


@pytest.mark.parametrize("field, value, words", [
    ("kernel_version", "2026-12-02-accel/pallas", "kernel version"),
    ("jax", "0.10.2", "jax"),
    ("kind", "NVIDIA H100 PCIe", "no committed device report"),  # another directory
])
def test_a_report_of_another_build_or_kind_gives_forced(tmp_path, field, value, words):
    _report(tmp_path)
    other = rc.DeviceFacts(**{**H100.__dict__, field: value})
    impl, why = rc.report_choice(other, "float32", "deferred", tmp_path)
    assert impl == "forced" and words in why


def test_dry_runs_misfiled_and_broken_reports_give_forced(tmp_path):
    _report(tmp_path, dry_run=True)
    impl, why = rc.report_choice(H100, "float32", "deferred", tmp_path)
    assert (impl, "dry run" in why) == ("forced", True)
    # a report filed under this kind's key but measured on another kind
    _report(tmp_path, rc.DeviceFacts("NVIDIA H200", H100.kernel_version, H100.jax),
            key=rc.device_key(H100.kind))
    impl, why = rc.report_choice(H100, "float32", "deferred", tmp_path)
    assert impl == "forced" and "device_kind 'NVIDIA H200'" in why
    (tmp_path / "h100_80gb_hbm3" / "report.json").write_text('{"summary": {}}')  # verify's
    impl, why = rc.report_choice(H100, "float32", "deferred", tmp_path)
    assert impl == "forced" and "not a device report (KeyError" in why
    impl, why = rc.report_choice(H100, "float32", "deferred", tmp_path / "absent")
    assert impl == "forced" and "no committed device report" in why


def test_auto_off_the_cpu_reads_the_report_and_says_so(tmp_path):
    cfg = apply_overrides(load_experiment(SMOKE), ["rollout.kernels=invariant",
                                                   "rollout.kv_policy=deferred"])
    lines = []
    _report(tmp_path)
    got = rc.resolve_replay_impl(cfg, "gpu", H100, tmp_path, say=lines.append)
    assert got == "invariant" and len(lines) == 1
    assert lines[0].startswith("looprl: learner.replay_impl=auto -> invariant: ")
    bf16 = apply_overrides(cfg, ["model.compute_dtype=bfloat16"])
    assert rc.resolve_replay_impl(bf16, "gpu", H100, tmp_path, say=lines.append) == "forced"
    assert lines[1].startswith("looprl: learner.replay_impl=auto -> forced: ")
    # the CPU: exact by construction, no report read, nothing said
    assert rc.resolve_replay_impl(cfg, "cpu", H100, tmp_path / "absent",
                                  say=lines.append) == "invariant"
    stock = apply_overrides(cfg, ["rollout.kernels=stock"])
    assert rc.resolve_replay_impl(stock, "gpu", H100, tmp_path, say=lines.append) == "forced"
    forced = apply_overrides(cfg, ["learner.replay_impl=forced"])
    assert rc.resolve_replay_impl(forced, "cpu", say=lines.append) == "forced"
    assert len(lines) == 2
    # require_exact stays off where exactness is measured, not argued
    assert rc.resolve_require_exact(cfg, "invariant", backend="gpu") is False
