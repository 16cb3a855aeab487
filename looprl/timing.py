"""Side-by-side timing of compiled functions, shared by the scripts under `benchmarks/`
(`kernels.py`, `attention_profile.py`, `rollout.py`, `decode_vs_torch.py`, `forward.py`,
`learner.py`; a helper, not a benchmark, so it lives in the package and not beside them).

Two orders, both so that a change in machine load hits every contender alike:
`interleaved` calls every compiled function once per round, in turn, and returns each one's
median; `abba` runs each contender in a block of calls, in the given order and then in reverse,
for contenders that need a setup between blocks (torch's thread count) or leave worker threads
spinning behind them.
"""
from __future__ import annotations

import statistics
import time

import jax

def default_clock():
    """`time.process_time` where XLA runs on this process's threads (the CPU backend);
    `time.perf_counter` (wall) on an accelerator, whose work the host's CPU clock does not see
    (the host only waits). Asks jax for its backend, so call it after XLA_FLAGS are final."""
    return time.process_time if jax.default_backend() == "cpu" else time.perf_counter


def interleaved(fns: dict, repeats: int, clock=None, warmup: int = 0) -> dict:
    """Median seconds by `clock` (default `default_clock()`: CPU seconds of this process, every
    thread; wall seconds off the CPU) of each zero-argument callable in `fns` (name -> fn) over
    `repeats` rounds that call every fn once in turn, after `warmup` untimed calls of each (0:
    the fns are already compiled). With one intra-op XLA thread, on a quiet machine CPU seconds
    are wall seconds; on a shared one they do not count the time other processes held the core,
    and they count both cores where XLA splits a loop fusion over them. `clock=time.perf_counter` for wall seconds."""
    clock = clock or default_clock()
    for fn in fns.values():
        for _ in range(warmup):
            jax.block_until_ready(fn())
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = clock()
            jax.block_until_ready(fn())
            times[name].append(clock() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def abba(fns: dict, repeats: int, warmup: int = 1, setups: dict | None = None,
         clock=time.perf_counter) -> dict:
    """Seconds by `clock` (default wall) of every call: `{name: [2 * repeats floats]}`. Each
    zero-argument callable in `fns` runs a block of `warmup` untimed then `repeats` timed calls,
    in the given order and then in reverse (ABBA), so slow drift of a shared machine hits all
    alike and the spinning worker threads one library leaves behind are absorbed by the next
    block's warm-up. `setups` (name -> zero-argument callable, optional) runs before the
    contender's block (torch's thread count)."""
    setups = setups or {}
    times = {name: [] for name in fns}
    order = list(fns)
    for names in (order, order[::-1]):
        for name in names:
            setups.get(name, lambda: None)()
            for _ in range(warmup):
                jax.block_until_ready(fns[name]())
            for _ in range(repeats):
                t0 = clock()
                jax.block_until_ready(fns[name]())
                times[name].append(clock() - t0)
    return times
