"""`looprl verify --device --carry DIR`, proven on the CPU: the carry holds looprl's wheel and
what a device image lacks (never jax), its device line installs it with --no-deps, and a
clean environment with only device-image-style packages runs the check's dry run from it
(interpreted kernels, tiny widths) to a report. The whole path needs the package registry
and takes 10-30 minutes on a 2-core host: `slow`, and the README's test command (what CI runs)
runs it as a second step (`python -m pytest -m carry`)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from looprl.verify.device import carry, plan

ROOT = Path(__file__).resolve().parents[2]
# what the GPU image brings (docs: /KINDS.md's list), as pip installs them here
IMAGE_STYLE = ["jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "chex", "numpy",
               "ml-dtypes", "safetensors", "tokenizers", "matplotlib", "rich", "tqdm",
               "packaging", "pyyaml", "sympy", "tabulate", "protobuf"]


def test_the_device_line_installs_without_deps_and_copies_the_report():
    line = carry.device_line(Path(".carry"))
    assert line.startswith("python3 -m pip install -q --no-index --no-deps --no-compile "
                           "--target /tmp/looprl-site .carry/*.whl && ")
    assert "python3 -m looprl.cli verify --device /tmp/looprl-check" in line
    assert 'cp /tmp/looprl-check/report.json /tmp/looprl-check/report.md "$OUT"/' in line


def test_the_device_image_has_jax_and_lacks_the_task_packages():
    reqs = carry.runtime_requirements()
    names = {carry.normalize(r.split(">")[0].split("=")[0].split("<")[0]) for r in reqs}
    lacking = sorted(n for n in names if n not in carry.DEVICE_IMAGE)
    assert lacking == ["math-verify", "reasoning-gym", "tensorboardx"]
    assert {"jax", "jaxlib", "flax", "numpy", "ml-dtypes"} <= carry.DEVICE_IMAGE


@pytest.mark.slow
@pytest.mark.carry
def test_a_clean_image_style_env_runs_the_dry_run_from_the_carry(tmp_path):
    here = "%d.%d" % sys.version_info[:2]
    left_out: list = []
    wheels = carry.build(tmp_path / "carry", here, left_out=left_out)
    names = {carry._wheel_name(w) for w in wheels}
    assert "looprl" in names and not names & carry.DEVICE_IMAGE
    assert sum(w.stat().st_size for w in wheels) < carry.LIMIT_BYTES
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    subprocess.run([py, "-m", "pip", "install", "-q", "-c", str(ROOT / "constraints.txt"),
                    *IMAGE_STYLE], check=True)
    site = tmp_path / "site"
    subprocess.run([py, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                    "--no-compile", "--target", str(site), *map(str, wheels)], check=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
    env["PYTHONPATH"] = str(site)
    out = tmp_path / "check"
    p = subprocess.run([py, "-m", "looprl.cli", "verify", "--device", str(out), "--dry-run"],
                       cwd=tmp_path, env=env, capture_output=True, text=True)
    rep = json.loads((out / "report.json").read_text())
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-3000:], rep.get("errors"))
    assert p.stdout.strip().splitlines()[-1] == rep["verdict"]
    assert rep["verdict"].startswith("looprl verify --device: PASS") and rep["dry_run"]
    assert [i["name"] for i in rep["items"]] == [i.name for i in plan.items(plan.DRY)]
    device_only = {i.name for i in plan.items(plan.DRY)
                   if i.kind == "speed" and plan.pair(i.args[0]).device_only}
    assert device_only  # the fair pairs: their skip is what the dry run shows of them
    for i in rep["items"]:
        if i["name"] in device_only:
            assert i["status"] == "skipped" and i["why"], i
        else:
            assert i["status"] in ("pass", "recorded"), i
    assert sorted(p.name for p in out.iterdir()) == ["report.json", "report.md"]
