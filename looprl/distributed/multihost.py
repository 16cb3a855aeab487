"""Multi-process start on JAX's own machinery (`jax.distributed.initialize`), no launcher of ours.

Every process runs the same `looprl train` command; they meet at a coordinator and then see one
global device list, over which `looprl.distributed.mesh` builds the mesh. Where the coordinator
address, process count and process id come from, first match wins:

1. explicit arguments (`looprl train --coordinator HOST:PORT --num-processes N --process-id I`);
2. the environment: `LOOPRL_COORDINATOR`, `LOOPRL_NUM_PROCESSES`, `LOOPRL_PROCESS_ID`;
3. `--distributed` / `LOOPRL_DISTRIBUTED=1` without an address: JAX's auto-detection (TPU pod
   slices from the TPU metadata, SLURM from `SLURM_*` under `srun`, Open MPI, ...).

With none of these the process runs alone (no call to `jax.distributed.initialize`).
CPU-only processes use gloo for cross-process collectives (`jax_cpu_collectives_implementation`),
set before the backend starts.

Only process 0 writes logs, metrics and reports (`is_main_process`); every process takes part in
(orbax) checkpointing, which coordinates the writes itself.
"""
from __future__ import annotations

import os
from typing import Any

import jax
from jax.experimental import multihost_utils

from looprl.determinism import backend_initialized
from looprl.errors import ConfigError


def distributed_settings(coordinator: str | None = None, num_processes: int | None = None,
                         process_id: int | None = None, auto: bool = False
                         ) -> dict[str, Any] | None:
    """The `jax.distributed.initialize` keyword arguments the arguments and environment ask for;
    {} for auto-detection; None for a single process. Raises ConfigError for an incomplete or
    inconsistent set (naming the argument / variable)."""
    env = os.environ
    coordinator = coordinator or env.get("LOOPRL_COORDINATOR") or None
    if num_processes is None and env.get("LOOPRL_NUM_PROCESSES"):
        num_processes = _int(env["LOOPRL_NUM_PROCESSES"], "LOOPRL_NUM_PROCESSES")
    if process_id is None and env.get("LOOPRL_PROCESS_ID"):
        process_id = _int(env["LOOPRL_PROCESS_ID"], "LOOPRL_PROCESS_ID")
    auto = auto or env.get("LOOPRL_DISTRIBUTED", "0") not in ("", "0", "false")
    if coordinator is None:
        if num_processes is not None or process_id is not None:
            if not auto:
                raise ConfigError("--num-processes/--process-id need --coordinator HOST:PORT "
                                  "(or LOOPRL_COORDINATOR), or --distributed to auto-detect")
        if not auto:
            return None
        kw: dict[str, Any] = {}
    else:
        if ":" not in coordinator:
            raise ConfigError(f"--coordinator: expected HOST:PORT, found {coordinator!r}")
        kw = {"coordinator_address": coordinator}
    if num_processes is not None:
        if num_processes < 1:
            raise ConfigError(f"--num-processes: expected a positive int, found {num_processes}")
        kw["num_processes"] = num_processes
    if process_id is not None:
        if num_processes is not None and not 0 <= process_id < num_processes:
            raise ConfigError(f"--process-id: expected 0..{num_processes - 1}, found "
                              f"{process_id}")
        kw["process_id"] = process_id
    return kw


def _int(text: str, name: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{name}: expected an int, found {text!r}") from None


def init_distributed(coordinator: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None, auto: bool = False) -> bool:
    """Join the other processes of this run (see module doc). Must run before jax creates its
    backends. Returns True if `jax.distributed.initialize` was called."""
    kw = distributed_settings(coordinator, num_processes, process_id, auto)
    if kw is None:
        return False
    if backend_initialized():
        raise ConfigError("init_distributed: jax's backends already exist; call it first")
    if os.environ.get("LOOPRL_CPU_COLLECTIVES", "gloo"):
        jax.config.update("jax_cpu_collectives_implementation",
                          os.environ.get("LOOPRL_CPU_COLLECTIVES", "gloo"))
    jax.distributed.initialize(**kw)
    return True


def is_main_process() -> bool:
    """True on process 0 (the one that writes logs, metrics, reports and summaries)."""
    return jax.process_index() == 0


def sync(name: str) -> None:
    """A barrier across processes (no-op for one process)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)
