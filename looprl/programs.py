"""The process's compiled programs, against the kernel's memory-map limit.

Every compiled XLA CPU program holds its JIT code in memory maps until it is freed, and jax
keeps every program it compiled, so a process that compiles many shapes (the reproducibility
matrix, a sweep of variants) can pass Linux's default `vm.max_map_count` (65,530): LLVM then
fails with "Cannot allocate memory" and the process dies with SIGSEGV. The callers drop the
programs between groups and variants; the test suite after each module (tests/conftest.py).
"""
from __future__ import annotations

import jax

MAP_SOFT_LIMIT = 40_000  # well below 65,530: one more group or variant must still fit


def memory_maps() -> int | None:
    """How many memory maps this process holds (`/proc/self/maps` lines); None without /proc."""
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:
        return None


def release_programs_near_map_limit(soft_limit: int = MAP_SOFT_LIMIT) -> bool:
    """Drop jax's in-memory compiled programs (`jax.clear_caches()`) if this process holds more
    than `soft_limit` memory maps; nothing where there is no /proc. Returns whether it dropped
    them. A dropped program is compiled again when next used: the same program and flags, so the
    same bits; only the compile time is paid again."""
    maps = memory_maps()
    if maps is None or maps <= soft_limit:
        return False
    jax.clear_caches()
    return True
