"""`looprl verify --compare NEW OLD`: a copy of a committed report is the same cells and bits; a
changed cell, verdict or rollout array is named; wall seconds and an `.npz` file's packing
(compressed or not) are not differences; the report's `env` names looprl's kernel version and
form."""
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import looprl
from looprl.cli import main
from looprl.kernels import current_form, kernel_version
from looprl.verify.compare import first_difference
from looprl.verify.report import report_environment

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "reproducibility" / "cpu"
ROLLOUT = "trained_float32_dense.npz"


@pytest.fixture
def copy(tmp_path):
    new = tmp_path / "new"
    shutil.copytree(COMMITTED, new)
    return new


def _edit(new: Path, fn) -> None:
    r = json.loads((new / "report.json").read_text())
    fn(r)
    (new / "report.json").write_text(json.dumps(r))


def test_a_copy_is_the_same_cells_and_bits(copy, capsys):
    assert main(["verify", "--compare", str(copy), str(COMMITTED)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("looprl verify --compare: same cells, same bits (324 cells, 32 "
                          "rollout files)")


def test_wall_seconds_and_rewritten_npz_files_are_no_difference(copy):
    _edit(copy, lambda r: r["cells"][0].update(seconds=99.0) or r.update(wall_s=1.0))
    path = copy / "rollouts" / ROLLOUT
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    np.savez_compressed(path, **arrays)  # other file bytes, the same arrays
    assert path.read_bytes() != (COMMITTED / "rollouts" / ROLLOUT).read_bytes()
    assert first_difference(copy, COMMITTED) is None


def test_a_changed_cell_verdict_or_array_is_named(copy, capsys):
    _edit(copy, lambda r: r["cells"][7].update(exact_fraction=0.5))
    assert main(["verify", "--compare", str(copy), str(COMMITTED)]) == 1
    out = capsys.readouterr().out
    assert "differs from" in out and "cell 7 " in out and "exact_fraction is 0.5 in NEW, 1.0 in OLD" in out
    _edit(copy, lambda r: r["summary"].update(passed=False))
    assert first_difference(copy, COMMITTED) == "summary: passed is False in NEW, True in OLD"
    shutil.copy(COMMITTED / "report.json", copy / "report.json")
    path = copy / "rollouts" / ROLLOUT
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    arrays["logprob_BxS"] = arrays["logprob_BxS"].copy()
    arrays["logprob_BxS"].view(np.uint32)[0, -1] ^= 1  # one bit of one log-prob
    np.savez(path, **arrays)
    assert first_difference(copy, COMMITTED).startswith(
        f"rollouts/{ROLLOUT}: array 'logprob_BxS' differs")


def test_compare_arguments_are_checked(copy, tmp_path, capsys):
    assert main(["verify", "--compare", str(copy), str(COMMITTED), "--out", str(tmp_path)]) == 2
    assert "--compare takes NEW OLD" in capsys.readouterr().err
    assert main(["verify", "--compare", str(tmp_path / "none"), str(COMMITTED)]) == 2
    assert "--compare NEW: " in capsys.readouterr().err
    assert main(["verify", "--quick"]) == 2
    assert "--out DIR is required" in capsys.readouterr().err


def test_the_report_env_names_the_version_kernel_version_and_form():
    env = report_environment()
    assert env["looprl_version"] == looprl.__version__
    assert env["kernel_version"] == kernel_version() and env["kernel_form"] == current_form().name
    assert env["kernel_form"] in ("cpu-ordered", "cpu-xla")


def test_the_two_machines_reports_share_the_replay_bits(capsys):
    """The committed AVX2 and AVX-512 reports: every replay cell and rollout array equal; the
    stock control's figures and the schedules' row tile differ, and are named only when the
    machines agree."""
    avx2 = ROOT / "reproducibility" / "cpu_avx2"
    assert main(["verify", "--compare", str(avx2), str(COMMITTED)]) == 0
    assert "another machine: the stock control's figures" in capsys.readouterr().out


def test_on_another_machine_a_stock_verdict_or_a_replay_figure_still_counts(copy):
    def other_machine(r):
        r["env"]["cpu_isa"] = "other"
    _edit(copy, other_machine)
    stock = next(i for i, c in enumerate(json.loads((copy / "report.json").read_text())["cells"])
                 if c["method"] == "stock")
    _edit(copy, lambda r: r["cells"][stock].update(k3_kl=1.0))
    assert first_difference(copy, COMMITTED) is None  # a stock figure follows the machine
    _edit(copy, lambda r: r["cells"][stock].update(passed=False))
    assert f"cell {stock} " in first_difference(copy, COMMITTED)
    _edit(copy, lambda r: r["cells"][stock].update(passed=True) or
          r["cells"][0].update(exact_fraction=0.5))
    assert first_difference(copy, COMMITTED).startswith("cell 0 ")
    _edit(copy, lambda r: r["cells"][0].update(exact_fraction=1.0))
    assert first_difference(copy, COMMITTED) is None
    _edit(copy, lambda r: r["env"].update(cpu_isa=json.loads(
        (COMMITTED / "report.json").read_text())["env"]["cpu_isa"]))
    _edit(copy, lambda r: r["cells"][stock].update(k3_kl=1.0))
    assert f"cell {stock} " in first_difference(copy, COMMITTED)  # the same machine: compared
