"""Every figure the docs quote from a committed report equals the report's own value: the
replay and control counts, the largest fp32 control difference and the kernel version (one
home: the report; the docs quote it, and a regenerated report that changes one fails here)."""
import json
import re
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
REPORTS = ("cpu", "cpu_avx2")


def report(name: str) -> dict:
    return json.loads((ROOT / "reproducibility" / name / "report.json").read_text())


def fp32_control(r: dict) -> str:
    """The largest fp32 stock |d logprob|, as the docs write it (`7.9e-6`)."""
    worst = max(c["max_abs_diff"] for c in r["cells"]
                if c["method"] == "stock" and c["dtype"] == "float32")
    mantissa, exponent = f"{worst:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def recorded_kernel_version(name: str) -> str:
    """`env.kernel_version`, else (a report from before `env` held it) its rollouts' one."""
    r = report(name)
    if "kernel_version" in r["env"]:
        return r["env"]["kernel_version"]
    with np.load(ROOT / "reproducibility" / name / "rollouts" / "random_float32_dense.npz") as z:
        return json.loads(str(z["meta"]))["schedule"]["kernel_version"]


def counts(r: dict) -> tuple[str, str]:
    s = r["summary"]
    return (f"{s['replay_exact_cells']}/{s['replay_cells']}",
            f"{s['negative_control_mismatching']}/{s['negative_control_cells']}")


def test_the_readme_quotes_both_cpu_reports_counts():
    text = (ROOT / "README.md").read_text()
    m = re.search(r"\*\*PASS\*\*, (\d+/\d+) replay cells exact .*?, (\d+/\d+) stock controls "
                  r"mismatching", text)
    assert m, "README.md: the matrix's result line moved; update this test"
    for name in REPORTS:
        assert m.groups() == counts(report(name)), name


@pytest.mark.parametrize("name", REPORTS)
def test_the_reproducibility_table_quotes_its_report(name):
    text = (ROOT / "reproducibility" / "README.md").read_text()
    m = re.search(rf"^\| `{name}/` \|.*\| `([^`]+)` \| \*\*PASS\*\*: (\d+/\d+) replay cells exact, "
                  rf"(\d+/\d+) stock controls mismatching \(fp32 within ([0-9.e-]+)\) \|$", text,
                  re.M)
    assert m, f"reproducibility/README.md: no table row for {name}/"
    r = report(name)
    assert m.group(1) == recorded_kernel_version(name)
    assert (m.group(2), m.group(3)) == counts(r) and r["summary"]["passed"]
    assert m.group(4) == fp32_control(r)


@pytest.mark.parametrize("name", REPORTS)
def test_the_experiments_figures_quote_the_report(name):
    text = (ROOT / "experiments" / "README.md").read_text()
    m = re.search(rf"--out reproducibility/{name}` \| \*\*PASS: (\d+/\d+) replay cells exact, "
                  rf"(\d+/\d+) negative controls mismatching\*\*, fp32 controls within "
                  rf"([0-9.e-]+)", text)
    assert m, f"experiments/README.md: no result row for reproducibility/{name}"
    r = report(name)
    assert (m.group(1), m.group(2)) == counts(r) and m.group(3) == fp32_control(r)


def test_no_doc_quotes_a_reports_wall_time_or_commit_by_hand():
    """A report's wall time and commit change with every regeneration: the docs name the keys
    (`wall_s`, `env.git_commit`) instead of copying them."""
    for doc in ("README.md", "reproducibility/README.md", "experiments/README.md"):
        text = (ROOT / doc).read_text()
        for name in REPORTS:
            r = report(name)
            assert r["env"]["git_commit"][:7] not in text, (doc, name)
            wall = f"{r['wall_s']:,}"
            assert wall not in text and str(r["wall_s"]) not in text, (doc, name, wall)
