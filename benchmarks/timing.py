"""Side-by-side timing shared by the kernel benchmarks (`kernels.py`, `attention_profile.py`).

`interleaved` calls every compiled function once per round, in turn, so a change in machine
load hits all of them alike, and returns each one's median by `CLOCK`.
"""
from __future__ import annotations

import statistics
import time

import jax

# CPU seconds where XLA runs on this process's thread; wall seconds on an accelerator, whose work
# the host's CPU clock does not see (the host only waits)
CLOCK = time.process_time if jax.default_backend() == "cpu" else time.perf_counter


def interleaved(fns: dict, repeats: int, clock=CLOCK) -> dict:
    """Median seconds by `CLOCK` (CPU seconds of this process, every thread; wall seconds off
    the CPU) of each zero-argument callable in `fns` (name -> fn, already compiled) over
    `repeats` rounds that call every fn once in turn. With one intra-op XLA thread, on a quiet
    machine CPU seconds are wall seconds; on a shared one they do not count the time other
    processes held the core (wall-clock pairs moved by 1.6x between two loaded runs), and they
    count both cores where XLA splits a loop fusion over them. `clock=time.perf_counter` for wall
    seconds."""
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = clock()
            jax.block_until_ready(fn())
            times[name].append(clock() - t0)
    return {name: statistics.median(t) for name, t in times.items()}
