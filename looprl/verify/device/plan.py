"""What the device check runs, in order of value, each item with its time budget.

The order: bf16 replay with `deferred` and `copy` KV at one Ouro-1.4B-width layer at 1, 3, 5,
64 and 256 rows; the needle; fp32 (and bf16 `dense`) replay; the kernel scans; the speed
pairs, looprl's programs against its stock kernels and then against the fair baselines (what a
user would run); the first cell again in a fresh process (run-to-run). Budgets add up to at most
`TOTAL_BUDGET_S`. An item starts only while the time spent is under the budgets up to and
including its own (time an item leaves unused passes on); one that cannot is `skipped`, and a
skip says nothing about its dtype. A dry run records each item's time against its budget and
skips nothing but the fair speed pairs, which it keeps to report their skip (`speed`).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable

from looprl.model import preset
from looprl.model.config import OuroConfig
from looprl.verify.device.speed import PAIRS, pair

TOTAL_BUDGET_S = 360
DTYPES = ("bfloat16", "float32")
POLICIES = ("deferred", "copy", "dense")


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What a check runs at: the device's sizes or the dry run's."""
    model: OuroConfig
    rows: tuple  # the replay rows of the first group
    more_rows: tuple  # the replay rows of the fp32 group
    weights: dict  # scan: name -> (I, O)
    scan_rows: tuple
    big_rows: int  # the call the scan's rows are cut from
    control: str  # the weight whose stock matmul is scanned too (informative)
    min_tokens: int
    exit_q: float
    needle_new: int
    speed_matmul: tuple  # (weight, M)
    decode: tuple  # (B, S, live slots)
    prefill: tuple  # (B, S)
    learner: tuple  # (B, S)
    repeats: int
    per_group: int | None = None  # after the first group, the items kept of each (None: all)


FULL = Sizes(model=preset("ouro-1.4b", num_layers=1), rows=(1, 3, 5, 64, 256),
             more_rows=(1, 64),
             weights={"q_proj": (2048, 2048), "gate_proj": (2048, 5632),
                      "down_proj": (5632, 2048), "lm_head": (2048, 49152),
                      "exit_gate": (2048, 1)},
             scan_rows=(1, 3, 64, 256, 300), big_rows=512, control="gate_proj",
             min_tokens=256, exit_q=0.5, needle_new=24,
             speed_matmul=(("gate_proj", 256), ("lm_head", 256)),
             decode=(256, 2048, 1024), prefill=(8, 1024), learner=(16, 1024), repeats=5)
DRY = Sizes(model=preset("tiny", num_layers=1), rows=(1,), more_rows=(1,),
            weights={"q_proj": (128, 128), "lm_head": (128, 64)},
            scan_rows=(1, 3), big_rows=24, control="q_proj",
            min_tokens=8, exit_q=0.85, needle_new=4, speed_matmul=(("q_proj", 16),),
            decode=(4, 32, 16), prefill=(2, 32), learner=(2, 16), repeats=1, per_group=1)


@dataclasses.dataclass(frozen=True)
class Item:
    """One item: its name (`group/...`), its group, its budget in seconds, the facts the report
    keys on (`dtype`, `kv_policy`, `rows`), and what runs it (`kind`, `args`)."""
    name: str
    group: str
    budget_s: float
    meta: dict
    kind: str
    args: tuple = ()


def _replay(dtype, policy, rows, budget_s, group):
    return Item(f"{group}/{dtype}/{policy}/rows{rows}", group, budget_s,
                {"dtype": dtype, "kv_policy": policy, "rows": rows}, "replay",
                (dtype, policy, rows))


# seconds per first-group item by rows, deferred then copy (estimated: cold compiles, one H100)
_FIRST_S = {1: (20, 12), 3: (10, 8), 5: (10, 8), 64: (12, 10), 256: (14, 12)}


def items(sz: Sizes) -> list[Item]:
    """Every item of a check at `sz`, in order (module doc)."""
    out = [_replay("bfloat16", p, r, _FIRST_S.get(r, (10, 8))[k], "replay")
           for k, p in enumerate(("deferred", "copy")) for r in sz.rows]
    out += [Item(f"needle/{d}/{p}", "needle", b, {"dtype": d, "kv_policy": p}, "needle", (d, p))
            for d, p, b in (("bfloat16", "deferred", 15), ("bfloat16", "copy", 10),
                            ("bfloat16", "dense", 8), ("float32", "deferred", 8))]
    out += [_replay(d, p, r, 8, "replay_more") for d, p in
            (("float32", "deferred"), ("float32", "copy"), ("float32", "dense"),
             ("bfloat16", "dense")) for r in sz.more_rows]
    for d in DTYPES:
        out += [Item(f"scan/matmul/{w}/{d}", "scan", 3, {"dtype": d}, "scan_matmul", (d, w))
                for w in sz.weights]
        out += [Item(f"scan/{op}/{d}", "scan", 3, {"dtype": d}, f"scan_{op}", (d,))
                for op in ("attention", "rms_norm", "token_logprob")]
    out += [Item(f"scan/{op}/float32", "scan", 2, {"dtype": "float32"}, "scan_rows", (op,))
            for op in ("rowsum", "softmax", "log_softmax")]
    out += [Item(f"speed/{p.name}/{d}", "speed", p.budget_s, {"dtype": d}, "speed",
                 (p.name, d)) for p in PAIRS for d in p.dtypes]
    if sz.per_group is not None:  # the dry run: every group, fewer items
        kept, count = [], {}
        for i in out:
            count[i.group] = count.get(i.group, 0) + 1
            shown = i.kind == "speed" and pair(i.args[0]).device_only  # its skip is reported
            if i.group == "replay" or count[i.group] <= sz.per_group or shown:
                kept.append(i)
        out = kept
    first = out[0]
    out.append(Item("run_to_run/" + first.name, "run_to_run", 20, dict(first.meta),
                    "run_to_run", first.args))
    return out


def total_budget_s(plan: list[Item]) -> float:
    return sum(i.budget_s for i in plan)


def run_items(plan: list[Item], run: Callable[[Item], dict], enforce: bool = True,
              sink: Callable[[dict], None] = lambda rec: None, clock=time.time) -> list[dict]:
    """`run(item)` -> record for each item in order, each record with name, group, budget_s,
    meta, `status` and `seconds`. With `enforce`, an item starts only while the seconds spent
    are under the budgets up to and including its own; the others are `skipped`. An item
    that raises is `error` (the others still run). `sink` gets each record as it is made."""
    t0, allowed, out = clock(), 0.0, []
    for item in plan:
        allowed += item.budget_s
        rec = {"name": item.name, "group": item.group, "budget_s": item.budget_s, **item.meta}
        if enforce and clock() - t0 >= allowed:
            rec.update(status="skipped", seconds=0.0, why="the time budget was spent")
        else:
            t = clock()
            try:
                rec.update(run(item))
            except Exception as e:  # one broken item must not lose the others
                rec.update(status="error", error=f"{type(e).__name__}: {e}"[:1500])
            rec["seconds"] = round(clock() - t, 2)
        out.append(rec)
        sink(rec)
    return out
