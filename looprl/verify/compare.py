"""`looprl verify --compare NEW OLD`: whether two report directories hold the same cells and
the same bits, or the first difference.

Compared: the summary (the verdicts), every cell's fields but its wall seconds, and each file
under `rollouts/` array by array (dtype, shape and bytes; a difference names the array, and the
file's packing does not count). Not compared: `env` (the machine; a difference there is shown
beside a difference in the bits), `setup`, `command`, `notes` and `wall_s`.

Two reports from different machines (`MACHINE_KEYS` of `env` differ) share the replay bits but
not everything. The stock control's figures follow the machine's XLA dots, so a stock cell's
`STOCK_FIGURES` are not compared then (its verdict is). A schedule records the machine's row
tile and the kernel version's ISA suffix (`SCHEDULE_MACHINE_KEYS`), so a rollout's `meta` is
compared without them then.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from looprl.errors import ConfigError

CELL_TIMING_KEYS = ("seconds",)  # a cell's wall time: the only field that may differ
MACHINE_KEYS = ("backend", "device_kind", "cpu_isa", "jax", "jaxlib")
STOCK_FIGURES = ("exact_fraction", "max_abs_diff", "mean_abs_diff", "k3_kl")
SCHEDULE_MACHINE_KEYS = ("row_tile", "kernel_version")
ENV_KEYS_SHOWN = ("jax", "jaxlib", "backend", "device_kind", "cpu_isa", "kernel_version",
                  "kernel_form", "git_commit", "git_dirty")


def read_report(directory: str | Path, flag: str) -> dict:
    """`directory/report.json`. Raises ConfigError naming `flag` and the file when it is
    missing or not JSON."""
    path = Path(directory) / "report.json"
    if not path.is_file():
        raise ConfigError(f"{flag}: {str(directory)!r} holds no report.json (a `looprl verify "
                          f"--out DIR` directory)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{flag}: {path}: not JSON ({e.msg}, line {e.lineno})") from None


def _meta_without_machine(a: np.ndarray) -> np.ndarray:
    """A rollout's `meta` JSON without `SCHEDULE_MACHINE_KEYS` in its schedule."""
    meta = json.loads(str(a.item()))
    for k in SCHEDULE_MACHINE_KEYS:
        meta.get("schedule", {}).pop(k, None)
    return np.asarray(json.dumps(meta, sort_keys=True))


def array_digests(path: Path, same_machine: bool = True) -> dict[str, str]:
    """{array name: SHA-256 of its dtype, shape and bytes} of one `.npz` file; with
    `same_machine` False, `meta` without the schedule's machine keys."""
    with np.load(path, allow_pickle=False) as z:
        out = {}
        for name in sorted(z.files):
            a = np.ascontiguousarray(z[name])
            if name == "meta" and not same_machine:
                a = _meta_without_machine(a)
            h = hashlib.sha256(f"{a.dtype.str}{a.shape}".encode())
            h.update(a.tobytes())
            out[name] = h.hexdigest()
        return out


def _cell_key(c: dict) -> tuple:
    return tuple(c.get(k) for k in ("weights", "dtype", "kv_policy", "rollout_rows",
                                    "batching", "params", "devices", "method"))


def _first_cell_difference(new: list[dict], old: list[dict],
                           same_machine: bool = True) -> str | None:
    if len(new) != len(old):
        return f"{len(new)} cells in NEW, {len(old)} in OLD"
    for i, (a, b) in enumerate(zip(new, old)):
        if _cell_key(a) != _cell_key(b):
            return f"cell {i} is {_cell_key(a)} in NEW, {_cell_key(b)} in OLD"
        skipped = (*CELL_TIMING_KEYS,
                   *(STOCK_FIGURES if a.get("method") == "stock" and not same_machine else ()))
        for k in sorted(set(a) | set(b)):
            if k not in skipped and a.get(k) != b.get(k):
                return (f"cell {i} {'/'.join(map(str, _cell_key(a)))}: {k} is {a.get(k)!r} in "
                        f"NEW, {b.get(k)!r} in OLD")
    return None


def _first_rollout_difference(new_dir: Path, old_dir: Path,
                              same_machine: bool = True) -> str | None:
    new = {p.name for p in (new_dir / "rollouts").glob("*.npz")}
    old = {p.name for p in (old_dir / "rollouts").glob("*.npz")}
    if new != old:
        return (f"rollout files differ: only in NEW {sorted(new - old)}, only in OLD "
                f"{sorted(old - new)}")
    for name in sorted(new):
        a = array_digests(new_dir / "rollouts" / name, same_machine)
        b = array_digests(old_dir / "rollouts" / name, same_machine)
        if a.keys() != b.keys():
            return f"rollouts/{name}: arrays {sorted(a)} in NEW, {sorted(b)} in OLD"
        for k in a:
            if a[k] != b[k]:
                return f"rollouts/{name}: array {k!r} differs (SHA-256 {a[k][:12]} in NEW, " \
                       f"{b[k][:12]} in OLD)"
    return None


def first_difference(new_dir: str | Path, old_dir: str | Path) -> str | None:
    """None when the two report directories hold the same verdicts, cells and rollout arrays,
    else a sentence naming the first difference (summary, then cells, then rollouts). Raises
    ConfigError when either holds no readable report.json."""
    new_dir, old_dir = Path(new_dir), Path(old_dir)
    new, old = read_report(new_dir, "--compare NEW"), read_report(old_dir, "--compare OLD")
    for k in sorted(set(new.get("summary", {})) | set(old.get("summary", {}))):
        a, b = new.get("summary", {}).get(k), old.get("summary", {}).get(k)
        if a != b:
            return f"summary: {k} is {a!r} in NEW, {b!r} in OLD"
    same = same_machine(new, old)
    return (_first_cell_difference(new.get("cells", []), old.get("cells", []), same)
            or _first_rollout_difference(new_dir, old_dir, same))


def same_machine(new: dict, old: dict) -> bool:
    """Whether two reports' `env` agree on every `MACHINE_KEYS` entry."""
    a, b = new.get("env", {}), old.get("env", {})
    return all(a.get(k) == b.get(k) for k in MACHINE_KEYS)


def environment_differences(new_dir: str | Path, old_dir: str | Path) -> list[str]:
    """`key: NEW value, OLD value` for each of `ENV_KEYS_SHOWN` whose values differ."""
    a = read_report(new_dir, "--compare NEW").get("env", {})
    b = read_report(old_dir, "--compare OLD").get("env", {})
    return [f"{k}: {a.get(k)!r} vs {b.get(k)!r}" for k in ENV_KEYS_SHOWN if a.get(k) != b.get(k)]


def compare_lines(new_dir: str | Path, old_dir: str | Path) -> tuple[bool, list[str]]:
    """(same, the lines `looprl verify --compare` prints): `same cells, same bits` with the
    cell and rollout counts, or `differs: ...` with the first difference, and the environment
    keys that differ."""
    diff = first_difference(new_dir, old_dir)
    new = read_report(new_dir, "--compare NEW")
    n_cells = len(new.get("cells", []))
    n_files = len(list((Path(new_dir) / "rollouts").glob("*.npz")))
    machine = ("" if same_machine(new, read_report(old_dir, "--compare OLD")) else
               "; another machine: the stock control's figures and the schedules' row tile "
               "and ISA suffix not compared")
    head = (f"looprl verify --compare: same cells, same bits ({n_cells} cells, {n_files} "
            f"rollout files{machine}): {new_dir} equals {old_dir}" if diff is None else
            f"looprl verify --compare: {new_dir} differs from {old_dir}: {diff}")
    env = environment_differences(new_dir, old_dir)
    return diff is None, [head] + ([f"  environments differ: {'; '.join(env)}"] if env else [])
