"""`reproducibility/gpu_check.py`, the prepared accelerator check, from the CPU: its
command line parses, its row-invariance scan runs every kernel form this backend can trace
(the CPU form, and both accelerator forms traced as for a device) and finds no differing row,
and its Markdown names every scanned form and the kernel versions. The whole script in its
reduced mode takes minutes, so it runs by hand (the issue note gives its figures)."""
import importlib.util
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from looprl import kernels as kn
from looprl.kernels import accel

SCRIPT = Path(__file__).resolve().parents[1] / "reproducibility" / "gpu_check.py"


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_gpu_check_help_runs():
    out = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "--reduced" in out.stdout and "OUT_DIR" in out.stdout


@pytest.mark.slow  # 75 s; the script's scan loop runs by default in the failing-form test below
def test_gpu_check_scans_every_form_and_reports_it():
    gc = _module()
    res = gc.scan_forms(gc.REDUCED_ONE, rows=(1, 9))
    assert res["kernel_versions"] == {"cpu-ordered": kn.cpu_kernel_version(),
                                      "accel-xla": f"{kn.KERNEL_VERSION_ACCEL}/xla",
                                      "pallas-gpu": f"{kn.KERNEL_VERSION_ACCEL}/pallas"}
    assert sorted(res["results"]) == sorted([f"{f}/q_proj_{d}" for f in res["kernel_versions"]
                                             for d in ("float32", "bfloat16")] +
                                            [f"{f}/attention" for f in res["kernel_versions"]])
    assert all(v["rows_differing"] == [] for v in res["results"].values())
    assert all(v["rows_tested"] == [1, 9] for k, v in res["results"].items()
               if "q_proj" in k)
    assert len(res["results"]["accel-xla/attention"]["calls"]) == 6
    assert kn.current_form().name == "cpu-ordered"  # restored
    assert kn.kernel_version() == kn.cpu_kernel_version()
    md = gc.report_md({"env": {"device_kind": "cpu", "jax": jax.__version__,
                               "accelerator_pins": {"NVIDIA_TF32_OVERRIDE": True}},
                       "wall_s": 1.0, "reduced": True, "scan": res, "errors": {}})
    assert "pallas-gpu/q_proj_bfloat16 | none" in md
    assert f"accel-xla `{kn.KERNEL_VERSION_ACCEL}/xla`" in md and "`NVIDIA_TF32_OVERRIDE`" in md
    assert "pins in force: none" in gc.report_md({"env": {}, "wall_s": 1.0, "reduced": True})


def test_a_form_that_fails_keeps_the_other_forms_results(monkeypatch):
    """One kernel form raising (say the Pallas kernel on a backend it cannot be built for) is
    recorded as that form's error; the other forms' scans stay, and the report says so."""
    gc = _module()

    def broken(*a, **k):
        raise ValueError("kernel exceeds available shared memory")
    monkeypatch.setattr(accel, "pallas_matmul", broken)
    res = gc.scan_forms(gc.REDUCED_ONE, rows=(1,))
    assert res["results"]["pallas-gpu/error"]["error"].startswith("ValueError: kernel exceeds")
    assert res["results"]["accel-xla/q_proj_float32"]["rows_differing"] == []
    assert kn.current_form().name == "cpu-ordered"  # the form in force again
    md = gc.report_md({"env": {}, "wall_s": 1.0, "reduced": True, "scan": res, "errors": {}})
    assert "| pallas-gpu/error | ValueError: kernel exceeds" in md
