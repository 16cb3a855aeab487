"""Where committed device reports live, and the key of a device kind.

A device report (`looprl verify --device`) is committed as `<reports dir>/<device key>/
report.json`. The reports dir is `LOOPRL_DEVICE_REPORTS` when set, else `looprl/reports/`,
package data: an editable checkout and an installed wheel both find it. A leaf: `rl`
(`replay_choice` reads the reports) and `verify` (the check writes them) both import it.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

REPORT_FORMAT = "looprl-device-check/2"
PACKAGE_REPORTS = Path(__file__).resolve().with_name("reports")
ENV = "LOOPRL_DEVICE_REPORTS"


def reports_dir() -> Path:
    """`LOOPRL_DEVICE_REPORTS` when set, else the package's `looprl/reports/`."""
    return Path(os.environ[ENV]) if os.environ.get(ENV) else PACKAGE_REPORTS


def device_key(device_kind: str) -> str:
    """The directory name of a device kind's report: lower case, a leading `nvidia` dropped,
    every run of other characters than letters and digits one `_` (`NVIDIA H200` -> `h200`)."""
    s = re.sub(r"^nvidia\s+", "", device_kind.strip().lower())
    return re.sub(r"[^a-z0-9]+", "_", s).strip("_") or "unknown"
