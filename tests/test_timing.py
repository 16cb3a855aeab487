"""looprl.timing: the benchmarks' side-by-side timer calls each contender in the stated order and
counts, and returns what its docstring says (medians; per-call seconds)."""
from looprl.timing import abba, interleaved


def _recorder():
    calls = []
    return calls, {name: (lambda name=name: calls.append(name)) for name in ("a", "b")}


def test_interleaved_warms_up_then_alternates_and_returns_medians():
    calls, fns = _recorder()
    ticks = iter(range(100))
    med = interleaved(fns, repeats=3, clock=lambda: next(ticks), warmup=2)
    assert calls == ["a", "a", "b", "b"] + ["a", "b"] * 3
    assert med == {"a": 1, "b": 1}  # each call spans one clock tick


def test_abba_runs_blocks_in_order_then_reversed_with_setups():
    calls, fns = _recorder()
    times = abba(fns, repeats=2, warmup=1, setups={"b": lambda: calls.append("setup b")})
    assert calls == (["a"] * 3 + ["setup b"] + ["b"] * 3 + ["setup b"] + ["b"] * 3
                     + ["a"] * 3)
    assert {k: len(v) for k, v in times.items()} == {"a": 4, "b": 4}
    assert all(t >= 0 for v in times.values() for t in v)
