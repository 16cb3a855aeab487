"""Where the replay value comes from: `learner.replay_impl=auto` resolved for this process.

On a CPU kernel form the invariant replay (the learner's dense pass) is exact by construction
(`docs/NUMERICS.md`), and auto takes it. Off the CPU it is measured, not argued: auto takes it
only where a committed device report, `<reports dir>/<device key>/report.json` written by
`looprl verify --device` (`looprl.device_reports`: package data `looprl/reports/`, or
`LOOPRL_DEVICE_REPORTS`), shows exact replay for this device kind, kernel version and
jax build, in the run's compute dtype and KV policy; elsewhere the forced re-run of the sampler
(exact wherever the sampler is deterministic). The device key is `device_key` of
`jax.devices()[0].device_kind` (`NVIDIA H100 80GB HBM3` -> `h100_80gb_hbm3`, `TPU v5 lite` ->
`tpu_v5_lite`). Off the CPU the choice is said in one line on stderr.
"""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import jax

from looprl import kernels as kn
from looprl.config import ExperimentConfig
from looprl.device_reports import REPORT_FORMAT, device_key  # noqa: F401
from looprl.device_reports import reports_dir as default_reports_dir


@dataclasses.dataclass(frozen=True)
class DeviceFacts:
    """What a device report must match: `jax.devices()[0].device_kind`, the kernel version of
    the form in force (`kernels.kernel_version`) and the jax build."""
    kind: str
    kernel_version: str
    jax: str


def this_device() -> DeviceFacts:
    """The facts of this process's first device and kernel form."""
    return DeviceFacts(jax.devices()[0].device_kind, kn.kernel_version(), jax.__version__)


def report_choice(facts: DeviceFacts, dtype: str, kv_policy: str,
                  reports_dir: Path | None = None) -> tuple[str, str]:
    """(`invariant` or `forced`, the one-line reason) for a run in `dtype` with `kv_policy` on
    the device `facts` describes: `invariant` only where `reports_dir/<device_key>/report.json`
    (default `device_reports.reports_dir()`) is a full (not dry-run) check of this device kind, kernel version
    and jax build whose `exactness.replay_exact["<dtype>/<kv_policy>"]` is true."""
    path = Path(reports_dir or default_reports_dir()) / device_key(facts.kind) / "report.json"
    where = f"{facts.kind} ({dtype}, {kv_policy}, kernels {facts.kernel_version}, jax {facts.jax})"
    if not path.is_file():
        return "forced", f"no committed device report for {where} at {path}"
    try:
        ex = json.loads(path.read_text())["exactness"]
        found = {"device_kind": ex["device_kind"], "kernel version": ex["kernel_version"],
                 "jax": ex["jax"]}
        cell = ex["replay_exact"].get(f"{dtype}/{kv_policy}")
        dry = ex.get("dry_run", True)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return "forced", f"{path} is not a device report ({type(e).__name__}: {e})"
    wanted = {"device_kind": facts.kind, "kernel version": facts.kernel_version,
              "jax": facts.jax}
    for key, value in wanted.items():
        if found[key] != value:
            return "forced", f"{path} is for {key} {found[key]!r}, this run has {value!r}"
    if dry:
        return "forced", f"{path} is a dry run (no device measured it)"
    if cell is not True:
        state = "not measured" if cell is None else "not exact"
        return "forced", f"{path}: replay {state} for {where}"
    return "invariant", f"{path} shows exact replay for {where}"


def _exact_by_construction(backend: str | None) -> bool:
    """A CPU kernel form is in force (`docs/NUMERICS.md`); `backend` ("cpu", "gpu") overrides."""
    return backend == "cpu" if backend is not None else kn.current_form().cpu


def resolve_replay_impl(exp_cfg: ExperimentConfig, backend: str | None = None,
                        facts: DeviceFacts | None = None, reports_dir: Path | None = None,
                        say=None) -> str:
    """`learner.replay_impl` with "auto" resolved: "invariant" under a CPU kernel form with
    invariant sampler kernels; off the CPU "invariant" where a device report shows it exact
    (`report_choice` of `facts`, default `this_device()`), else "forced", said in one line by
    `say` (default: printed to stderr). A stock-kernel rollout is always "forced"."""
    if exp_cfg.learner.replay_impl != "auto":
        return exp_cfg.learner.replay_impl
    if exp_cfg.rollout.kernels != "invariant":
        return "forced"
    if _exact_by_construction(backend):
        return "invariant"
    impl, why = report_choice(facts or this_device(), exp_cfg.model.compute_dtype,
                              exp_cfg.rollout.kv_policy, reports_dir)
    line = f"looprl: learner.replay_impl=auto -> {impl}: {why}"
    (say or (lambda s: print(s, file=sys.stderr, flush=True)))(line)
    return impl


def resolve_require_exact(exp_cfg: ExperimentConfig, replay_impl: str,
                          backend: str | None = None) -> bool:
    """`learner.require_exact` with none (auto) resolved: true where exact replay is claimed (a
    CPU form, invariant kernels, invariant replay), false where it is measured, not claimed."""
    if exp_cfg.learner.require_exact is not None:
        return bool(exp_cfg.learner.require_exact)
    return (_exact_by_construction(backend) and exp_cfg.rollout.kernels == "invariant"
            and replay_impl == "invariant")
