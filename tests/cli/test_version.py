"""`looprl --version` and the version CITATION.cff cites."""
import json
import re
import subprocess
import sys
from pathlib import Path

import looprl
from looprl.kernels import kernel_version

ROOT = Path(__file__).resolve().parents[2]


def test_version_prints_version_commit_jax_and_kernel_version():
    p = subprocess.run([sys.executable, "-m", "looprl.cli", "--version"], capture_output=True,
                       text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert re.match(rf"looprl {re.escape(looprl.__version__)} \(commit ([0-9a-f]{{40}}|no git "
                    rf"checkout)", lines[0])
    import jax
    assert lines[1].startswith(f"jax {jax.__version__}, jaxlib ")
    assert lines[2].startswith(f"kernel version {kernel_version()} (backend cpu")


def test_citation_cites_this_version():
    cff = (ROOT / "CITATION.cff").read_text()
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r"^version: (\S+)$", cff, re.M).group(1) == looprl.__version__
    assert re.search(r'^version = "(\S+)"$', pyproject, re.M).group(1) == looprl.__version__


def test_citation_names_a_commit_of_this_history():
    commit = re.search(r'^commit: "([0-9a-f]{40})"$', (ROOT / "CITATION.cff").read_text(), re.M)
    assert commit, "CITATION.cff names no commit (40 hex digits)"
    if (ROOT / ".git").exists():
        p = subprocess.run(["git", "cat-file", "-e", f"{commit.group(1)}^{{commit}}"], cwd=ROOT,
                           capture_output=True)
        assert p.returncode == 0, f"CITATION.cff's commit {commit.group(1)} is not in this history"


def test_reports_of_this_version_come_from_the_cited_clean_commit():
    """A committed report written by this version of looprl (`env.looprl_version`) records the
    commit CITATION.cff cites, from a clean checkout: the report one cites is that commit's."""
    commit = re.search(r'^commit: "([0-9a-f]{40})"$', (ROOT / "CITATION.cff").read_text(),
                       re.M).group(1)
    for path in sorted((ROOT / "reproducibility").glob("cpu*/report.json")):
        env = json.loads(path.read_text())["env"]
        if env.get("looprl_version") == looprl.__version__:
            assert (env["git_commit"], env["git_dirty"]) == (commit, False), path
