"""`looprl --version` and the version CITATION.cff cites."""
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
