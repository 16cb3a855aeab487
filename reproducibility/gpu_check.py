"""The device check: on one GPU (H100/H200) or TPU, in about 8 minutes, everything the kernels'
accelerator form (`pallas-gpu` / `pallas-tpu`) must show before the trainer trusts it; writes
`report.json` and `report.md` under OUT_DIR.

    python reproducibility/gpu_check.py reproducibility/<device key>   # on the device
    python reproducibility/gpu_check.py --dry-run /tmp/check           # a CPU, tiny widths

Sections, each in a process of its own under a time budget (BUDGETS_S, about 400 s together):
an item (but the first) not started within its section's budget is `skipped`, which leaves the
section `incomplete`, never `pass`; a section past its budget by GRACE_S is killed (`timeout`).
  scan    row invariance of every kernel: `matmul` at every Ouro-1.4B weight shape, `rowsum`,
          `rms_norm`, `softmax` and `log_softmax` over the vocabulary, the selected-token
          log-prob, in fp32 and bf16: M rows alone against the same rows inside a 512-row
          call (at offsets 0 and 100); `attention` for one query in calls of other batch,
          cache, chunk and padding sizes. `stock_matmul` is scanned as a control (informative).
  verify  `looprl.verify.matrix.verify_rollout` cells at one layer of Ouro-1.4B width, random
          weights (q = 0.5): fp32 and bf16 x dense/deferred/copy, rollouts of 1 to 256 rows;
          a replay cell must be exact, a stock cell must not (else the check has no power).
  needle  a prompt alone and inside three batches (same bucket, larger bucket, a cache
          straddling a 128-key block): the same tokens, exit loops and log-prob bits.
  ratios  measured wall time invariant / stock: the learner step (one microbatch, forward and
          gradient, targets <= 1.3), the 256-row decode step over a 2,048-slot cache (one loop
          and the head, target <= 1.5), attention (decode, prefill) and matmul.
  smoke   3 GRPO steps (`GRPOLearner`, the smoke experiment's model, a task with a parity
          reward) with `learner.replay_impl=invariant`: `replay_exact_fraction` 1.0 each step.
`exactness` sums up, per `<dtype>/<kv policy>`, whether replay is exact here (every verify cell
exact, no needle or scan failure of that dtype); `looprl.rl.replay_choice` reads it to make
`learner.replay_impl=auto` take the invariant replay on this device kind. Commit OUT_DIR as
`reproducibility/<device key>/` (`replay_choice.device_key`). Exit status 0 when every
section passes. `--dry-run` runs every section at tiny widths with the CPU's form (or
`--form pallas-gpu`: the Pallas kernels interpreted) in seconds; its report never counts.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import subprocess
import sys
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this tree's looprl, not another checkout's editable install
_PREALLOCATE = os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE")  # the user's, for the sections
if "--section" not in sys.argv and "--in-process" not in sys.argv:  # the sections' processes
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # take the device's memory, not this

import looprl  # noqa: E402,F401  (sets looprl's XLA flags before jax starts)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from looprl import kernels as kn  # noqa: E402
from looprl.determinism import environment  # noqa: E402
from looprl.model import init_params, preset  # noqa: E402
from looprl.model.config import OuroConfig  # noqa: E402
from looprl.rl.replay_choice import REPORT_FORMAT, device_key  # noqa: E402

SECTIONS = ("scan", "verify", "needle", "ratios", "smoke")
BUDGETS_S = {"scan": 70, "verify": 150, "needle": 45, "ratios": 80, "smoke": 45}
GRACE_S = 40
DTYPES = ("float32", "bfloat16")
POLICIES = ("dense", "deferred", "copy")
TARGETS = {"learner_step": 1.3, "decode_step": 1.5}
SMOKE = ROOT / "experiments" / "tiny_arith_smoke.py"


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What a check runs at: the full device sizes or the dry run's."""
    model: OuroConfig  # verify, needle, ratios
    weights: dict  # scan: name -> (I, O)
    scan_rows: tuple
    big_rows: int  # the call the scan's rows are cut from
    control: str  # the weight whose stock matmul is scanned too (informative)
    verify_plan: tuple  # (dtype, policy, rows), most telling first
    min_tokens: int
    exit_q: float
    needle_new: int
    ratio_matmul: tuple  # (weight, M)
    decode: tuple  # (B, S, live slots)
    prefill: tuple  # (B, S)
    learner: tuple  # (B, S)
    smoke_dtypes: tuple
    repeats: int


def _plan(rows):
    """(dtype, policy, rows): each (dtype, policy) once at rows[0], then the others."""
    pairs = [(d, p) for p in POLICIES for d in DTYPES]
    rest = [(d, p, r) for i, r in enumerate(rows[1:]) for j, (d, p) in enumerate(pairs)
            if (i + j) % 2 == 0]  # every other pair at each further row count
    return tuple([(d, p, rows[0]) for d, p in pairs] + rest)


OURO = preset("ouro-1.4b", num_layers=1)
FULL = Sizes(model=OURO, weights={"q_proj": (2048, 2048), "gate_proj": (2048, 5632),
                                  "down_proj": (5632, 2048), "lm_head": (2048, 49152),
                                  "exit_gate": (2048, 1)},
             scan_rows=(1, 3, 64, 256, 300), big_rows=512, control="gate_proj",
             verify_plan=_plan((256, 1, 3, 64)),
             min_tokens=256, exit_q=0.5, needle_new=24,
             ratio_matmul=(("gate_proj", 256), ("gate_proj", 4096), ("lm_head", 256),
                           ("down_proj", 4096)),
             decode=(256, 2048, 1024), prefill=(8, 1024), learner=(16, 1024),
             smoke_dtypes=DTYPES, repeats=5)
DRY = Sizes(model=preset("tiny", num_layers=1), weights={"q_proj": (128, 128),
                                                         "lm_head": (128, 64)},
            scan_rows=(1, 3), big_rows=24, control="q_proj",
            verify_plan=(("float32", "deferred", 4),),
            min_tokens=8, exit_q=0.85, needle_new=4, ratio_matmul=(("q_proj", 16),),
            decode=(4, 32, 16), prefill=(2, 32), learner=(2, 16), smoke_dtypes=("float32",),
            repeats=1)


class Budget:
    """A section's time: `left()` seconds until its budget is spent."""

    def __init__(self, seconds: float):
        self.end = time.time() + seconds

    def left(self) -> float:
        return self.end - time.time()


def _items(budget: Budget, plan, run) -> list[dict]:
    """`run(*entry)` -> item dict for each plan entry while the budget lasts (the first always
    runs); entries not started in time are `skipped`; an entry that raises is `error` (the
    others still run)."""
    out = []
    for entry in plan:
        name, meta = entry[0], entry[1]
        if out and budget.left() <= 0:
            out.append({"name": name, **meta, "status": "skipped"})
            continue
        t = time.time()
        try:
            item = {"name": name, **meta, **run(*entry[2:])}
        except Exception as e:  # one broken item must not lose the others
            item = {"name": name, **meta, "status": "error",
                    "error": f"{type(e).__name__}: {e}"[:1500]}
        item["seconds"] = round(time.time() - t, 2)
        out.append(item)
    return out


def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    if np.issubdtype(a.dtype, np.integer):
        return a.astype(np.int32)
    return np.asarray(jnp.asarray(a).astype(jnp.float32)).view(np.uint32)


def row_scan(fn, args, rows, offsets=(0, 100)) -> list[int]:
    """The row counts M for which `fn(*args cut to M rows)` differs in bits from the same rows of
    `fn(*args)` (each arg's axis 0 is the row axis; the M rows taken at each offset)."""
    f = jax.jit(fn)
    big = _bits(f(*args))
    n = args[0].shape[0]
    bad = []
    for m in rows:
        for off in dict.fromkeys(min(o, n - m) for o in offsets):
            part = _bits(f(*(a[off:off + m] for a in args)))
            if not np.array_equal(part, big[off:off + m]):
                bad.append(m)
                break
    return bad


def attention_scan(dtype: str, H: int, J: int, K: int, live: int = 100) -> list[str]:
    """`kernels.attention` for the last live query of batch row 0 in calls (B, S, C, pad) of
    other batch, cache, chunk and padding sizes: the calls whose bits differ from the first."""
    rng = np.random.default_rng(1)
    q_all = rng.standard_normal((5, 64, H, K)).astype(np.float32)
    kv = rng.standard_normal((2, 5, live, J, K)).astype(np.float32)
    f = jax.jit(lambda q, k, v, m: kn.attention(q, k, v, m, K ** -0.5))
    ref, bad = None, []
    for B, S, C, pad in ((1, 256, 1, 0), (1, 256, 8, 0), (5, 256, 8, 0), (1, 640, 64, 0),
                         (5, 640, 1, 30), (5, 256, 64, 30)):
        k = np.zeros((B, S, J, K), np.float32)
        v = np.zeros((B, S, J, K), np.float32)
        k[:, pad:pad + live], v[:, pad:pad + live] = kv[0, :B], kv[1, :B]
        qpos = pad + live - C + np.arange(C)
        mask = (np.arange(S)[None] >= pad) & (np.arange(S)[None] <= qpos[:, None])
        o = f(*(jnp.asarray(a, dtype) for a in (q_all[:B, 64 - C:], k, v)),
              jnp.asarray(np.broadcast_to(mask, (B, C, S))))
        bits = _bits(o[0, -1])
        if ref is None:
            ref = bits
        elif not np.array_equal(bits, ref):
            bad.append(f"B={B},S={S},C={C},pad={pad}")
    return bad


def section_scan(sz: Sizes, budget: Budget) -> dict:
    rng = np.random.default_rng(0)
    cfg = sz.model
    D, V, n = cfg.hidden_size, cfg.vocab_size, sz.big_rows

    def arr(shape, dtype, scale=1.0):
        return jnp.asarray(rng.standard_normal(shape) * scale, dtype)

    def rows_item(fn, *args, control=None):
        bad = row_scan(fn, args, sz.scan_rows)
        item = {"rows_tested": list(sz.scan_rows), "rows_differing": bad,
                "status": "fail" if bad else "pass"}
        if control is not None:  # the same scan of the stock kernel: not pass/fail
            item["stock_rows_differing"] = row_scan(control, args, sz.scan_rows)
        return item

    plan = []
    for dtype in DTYPES[::-1]:  # bf16 first: the real configs' dtype
        for name, (i, o) in sz.weights.items():
            out = jnp.float32 if name == "lm_head" else None
            w = arr((i, o), dtype, i ** -0.5)
            control = (lambda x, w=w, out=out: kn.stock_matmul(x, w, out)) \
                if name == sz.control else None
            plan.append((f"matmul/{name}/{dtype}", {"dtype": dtype}, functools.partial(
                rows_item, lambda x, w=w, out=out: kn.matmul(x, w, out), arr((n, i), dtype),
                control=control)))
        plan.append((f"attention/{dtype}", {"dtype": dtype}, lambda d=dtype: (lambda bad: {
            "calls_differing": bad, "status": "fail" if bad else "pass"})(
            attention_scan(d, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim))))
        gain = arr((D,), dtype)
        plan.append((f"rms_norm/{dtype}", {"dtype": dtype}, functools.partial(
            rows_item, lambda x, g=gain: kn.rms_norm(x, g, 1e-6), arr((n, D), dtype))))
        w_lm = arr((D, V), dtype, D ** -0.5)
        targets = jnp.asarray(rng.integers(0, V, (n, 1)), jnp.int32)
        plan.append((f"token_logprob/{dtype}", {"dtype": dtype}, functools.partial(
            rows_item, lambda h, t, w=w_lm: jnp.take_along_axis(
                kn.log_softmax(kn.matmul(h, w, jnp.float32)), t, axis=-1),
            arr((n, D), dtype), targets)))
    logits = arr((n, V), jnp.float32, 4.0)
    for name, fn in (("rowsum", kn.rowsum), ("softmax", kn.softmax),
                     ("log_softmax", kn.log_softmax)):
        plan.append((f"{name}/float32", {"dtype": "float32"},
                     functools.partial(rows_item, fn, logits)))
    return {"items": _items(budget, plan, lambda f: f())}


def _prompts(vocab: int, n: int, seed: int = 5) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[1] + [int(t) for t in rng.integers(3, vocab, int(rng.integers(6, 30)))]
            for _ in range(n)]


def section_verify(sz: Sizes, budget: Budget) -> dict:
    from looprl.sampling.sampler import SamplingConfig, generate
    from looprl.verify.matrix import VerifyOptions, verify_rollout
    cfg, params = sz.model, init_params(sz.model, 0)
    prompts = _prompts(cfg.vocab_size, 64)
    opts = VerifyOptions(min_tokens=sz.min_tokens, exit_threshold_random=sz.exit_q)

    def run(dtype, policy, rows):
        group = 4 if rows >= 8 else 1
        scfg = SamplingConfig(max_new_tokens=max(4, -(-sz.min_tokens // rows)),
                              temperature=1.0, exit_threshold=sz.exit_q, kv_policy=policy,
                              deferred_max_pending=opts.deferred_max_pending, stop_ids=(),
                              compute_dtype=dtype)
        rb = generate(cfg, params, prompts[:rows // group], scfg, group_size=group, seed=0)
        cells = verify_rollout(cfg, params, rb, opts, weights="random", log=lambda m: None)
        replay = [c for c in cells if c["method"] == "replay"]
        stock = [c for c in cells if c["method"] == "stock"]
        unmet = cells[0]["requirements_unmet"]
        ok = (not unmet and all(c["exact_fraction"] == 1.0 for c in replay)
              and all(c["exact_fraction"] < 1.0 for c in stock))
        return {"tokens": cells[0]["tokens"],
                "early_exit_fraction": round(cells[0]["early_exit_fraction"], 3),
                "replay_exact_cells": sum(c["exact_fraction"] == 1.0 for c in replay),
                "replay_cells": len(replay),
                "replay_min_exact_fraction": min(c["exact_fraction"] for c in replay),
                "replay_max_abs_diff": max(c["max_abs_diff"] for c in replay),
                "stock_mismatching_cells": sum(c["exact_fraction"] < 1.0 for c in stock),
                "stock_cells": len(stock), "requirements_unmet": unmet,
                "status": "pass" if ok else "fail"}

    plan = [(f"{d}/{p}/rows{r}", {"dtype": d, "kv_policy": p, "rows": r}, d, p, r)
            for d, p, r in sz.verify_plan]
    return {"items": _items(budget, plan, run)}


def section_needle(sz: Sizes, budget: Budget) -> dict:
    from looprl.sampling.sampler import SamplingConfig, generate
    cfg, params = sz.model, init_params(sz.model, 0)
    rng = np.random.default_rng(7)
    tok = functools.partial(rng.integers, 3, cfg.vocab_size)
    needle = [1] + [int(t) for t in tok(7)]
    mates = [[1] + [int(t) for t in tok(4)], [1] + [int(t) for t in tok(5)]]
    longer = [1] + [int(t) for t in tok(39)]  # the batch moves to the 48 bucket
    straddle = [1] + [int(t) for t in tok(99)]  # 112 bucket: the needle's keys cross slot 128
    batches = {"alone": ([needle], 0), "same_bucket": ([mates[0], needle, mates[1]], 1),
               "larger_bucket": ([longer, mates[0], needle], 2),
               "straddling": ([needle, straddle], 0)}

    def run(dtype, policy):
        scfg = SamplingConfig(max_new_tokens=sz.needle_new, temperature=1.0,
                              exit_threshold=sz.exit_q, kv_policy=policy, compute_dtype=dtype,
                              stop_ids=(), prompt_len_multiple=16)
        got = {}
        for name, (prompts, i) in batches.items():
            ids = [1234 if j == i else 10 + j for j in range(len(prompts))]
            b = generate(cfg, params, prompts, scfg, seed=3, step=2, prompt_indices=ids)
            P = b.schedule.prompt_len
            got[name] = (np.asarray(b.tokens_BxS)[i, P:], np.asarray(b.exit_loop_BxS)[i, P - 1:],
                         _bits(np.asarray(b.logprob_BxS, np.float32)[i, P - 1:]))
        differing = [f"{name}: {what}" for name, v in got.items() if name != "alone"
                     for what, a, b in zip(("tokens", "exit loops", "log-prob bits"),
                                           got["alone"], v) if not np.array_equal(a, b)]
        exits = got["alone"][1][got["alone"][1] > 0]
        return {"differing": differing, "early_exits": int((exits < cfg.total_ut_steps).sum()),
                "status": "fail" if differing else "pass"}

    plan = [(f"{d}/{p}", {"dtype": d, "kv_policy": p}, d, p)
            for p in ("deferred", "dense", "copy") for d in DTYPES]
    return {"items": _items(budget, plan, run)}


def _decode_program(cfg, stock: bool):
    """One decode step's loop at B rows: the L layers reading the cache in place
    (`layers.stack_pass`, the sampler's form), the final norm, the head and its log-softmax."""
    from looprl.model.layers import stack_pass
    from looprl.model.looped import lm_logits

    def step(w, x_BxCxD, k_cache, v_cache, pad_B, w0):
        B, C, _ = x_BxCxD.shape
        layout = w0 + jnp.arange(C)
        positions = jnp.broadcast_to(layout[None] - pad_B[:, None], (B, C))
        h, _, _ = stack_pass(cfg, w, x_BxCxD, positions, layout, pad_B, k_cache, v_cache,
                             layout[None] >= pad_B[:, None], w0, stock, bits=True,
                             loop=jnp.int32(0))
        logits = lm_logits(w, h, stock)
        return jax.nn.log_softmax(logits, axis=-1) if stock else kn.log_softmax(logits)
    return jax.jit(step)


def section_ratios(sz: Sizes, budget: Budget, form: str) -> dict:
    from looprl.logprobs import sequence_logprobs
    from looprl.model.looped import cast_weights
    from looprl.timing import interleaved
    if form == "stock":
        raise ValueError("the form in force is stock: its ratio to stock says nothing")
    cfg, rng = sz.model, np.random.default_rng(4)
    params = init_params(cfg, 0)

    def timed(inv, stock, *args, target=None):
        for f in (inv, stock):
            jax.block_until_ready(f(*args))  # compile, warm
        med = interleaved({"inv": lambda: inv(*args), "stock": lambda: stock(*args)},
                          sz.repeats)
        r = med["inv"] / med["stock"]
        item = {"invariant_ms": round(med["inv"] * 1e3, 3),
                "stock_ms": round(med["stock"] * 1e3, 3), "ratio": round(r, 3)}
        if target is not None:
            item.update(target=target, status="pass" if r <= target else "fail")
        return {"status": "pass", **item}

    def learner(dtype):
        B, S = sz.learner
        T = cfg.total_ut_steps
        exits = np.where(np.arange(S)[None] < S - 1, rng.integers(1, T + 1, (B, S)), 0)
        args = (params, jnp.asarray(rng.integers(3, cfg.vocab_size, (B, S)), jnp.int32),
                jnp.zeros((B,), jnp.int32), jnp.asarray(exits, jnp.int32),
                jnp.full((B, S), T, jnp.int32))

        def loss(p, tokens, pad, exit_loop, depth, method):
            lp, _ = sequence_logprobs(cfg, p, tokens, pad, exit_loop, depth, kv_policy="dense",
                                      compute_dtype=dtype, temperature=1.0, method=method)
            return jnp.sum(lp)
        f = {m: jax.jit(jax.value_and_grad(functools.partial(loss, method=m)))
             for m in ("hybrid", "stock")}
        return timed(f["hybrid"], f["stock"], *args, target=TARGETS["learner_step"])

    def decode(dtype):
        B, S, live = sz.decode
        w = cast_weights(params, dtype)
        shape = (1, cfg.num_layers, B, S, cfg.num_kv_heads, cfg.head_dim)
        cache = jnp.asarray(rng.standard_normal(shape), dtype)
        args = (w, jnp.asarray(rng.standard_normal((B, 1, cfg.hidden_size)), dtype), cache,
                cache, jnp.zeros((B,), jnp.int32), jnp.int32(live))
        return timed(_decode_program(cfg, False), _decode_program(cfg, True), *args,
                     target=TARGETS["decode_step"])

    def attention(dtype, kind):
        H, J, K = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        if kind == "decode":
            B, S, live = sz.decode
            C, mask = 1, np.broadcast_to(np.arange(S) < live, (B, 1, S))
        else:
            (B, S), C = sz.prefill, sz.prefill[1]
            mask = np.broadcast_to(np.tril(np.ones((S, S), bool)), (B, S, S))
        q, k, v = (jnp.asarray(rng.standard_normal(s), dtype)
                   for s in ((B, C, H, K), (B, S, J, K), (B, S, J, K)))
        f = {s: jax.jit(lambda q, k, v, m, s=s: (kn.stock_attention if s else kn.attention)(
            q, k, v, m, K ** -0.5)) for s in (False, True)}
        return timed(f[False], f[True], q, k, v, jnp.asarray(mask))

    def matmul(dtype, weight, m):
        i, o = sz.weights.get(weight, (cfg.hidden_size, cfg.hidden_size))
        out = jnp.float32 if weight == "lm_head" else None
        x = jnp.asarray(rng.standard_normal((m, i)), dtype)
        w = jnp.asarray(rng.standard_normal((i, o)) * i ** -0.5, dtype)
        return timed(jax.jit(lambda x, w: kn.matmul(x, w, out)),
                     jax.jit(lambda x, w: kn.stock_matmul(x, w, out)), x, w)

    plan = [("learner_step/bfloat16", {"dtype": "bfloat16"}, learner, "bfloat16"),
            ("decode_step/bfloat16", {"dtype": "bfloat16"}, decode, "bfloat16"),
            ("attention_decode/bfloat16", {"dtype": "bfloat16"}, attention, "bfloat16", "decode"),
            ("attention_prefill/bfloat16", {"dtype": "bfloat16"}, attention, "bfloat16",
             "prefill")]
    plan += [(f"matmul/{w}/M{m}/{d}", {"dtype": d}, matmul, d, w, m) for d in DTYPES
             for w, m in sz.ratio_matmul]
    plan += [("learner_step/float32", {"dtype": "float32"}, learner, "float32"),
             ("decode_step/float32", {"dtype": "float32"}, decode, "float32")]
    return {"items": _items(budget, plan, lambda fn, *a: fn(*a))}


class _ParityTask:
    """A task for the smoke: prompts `a+b=` of the character tokenizer, reward the completion's
    CRC parity (groups score differently, so every step has a gradient)."""
    prompt_style = "compact"

    def train_problems(self, n: int, start: int = 0):
        from looprl.tasks.base import Problem
        return [Problem(i, "train", f"{i % 10}+{i // 10 % 10}=", "")
                for i in range(start, start + n)]

    def format_prompt(self, problem) -> str:
        from looprl.tokenizer import chat_prompt
        return chat_prompt(problem.prompt, self.prompt_style)

    def reward(self, problem, text: str) -> float:
        return float(zlib.crc32(text.encode()) % 2)


def section_smoke(sz: Sizes, budget: Budget) -> dict:
    from looprl.config import apply_overrides, load_experiment
    from looprl.model.config import from_model_section
    from looprl.rl.learner import GRPOLearner
    from looprl.tokenizer import build_char_tokenizer

    def run(dtype):
        cfg = apply_overrides(load_experiment(SMOKE), [
            "learner.replay_impl=invariant", "learner.require_exact=false",
            f"model.compute_dtype={dtype}", "prompts_per_step=4", "group_size=4",
            "learner.minibatches=2", "learner.microbatch_size=0"])
        mcfg = from_model_section(cfg.model)
        learner = GRPOLearner(cfg, mcfg, init_params(mcfg, 0), _ParityTask(),
                              build_char_tokenizer())
        steps = [learner.step(i) for i in range(3)]
        keys = ("replay_impl", "replay_exact_fraction", "stock_max_abs_diff", "grad_norm")
        rows = [{k: s.get(k) for k in keys} for s in steps]
        ok = all(r["replay_exact_fraction"] == 1.0 and np.isfinite(r["grad_norm"]) for r in rows)
        return {"steps": rows, "status": "pass" if ok else "fail"}

    plan = [(f"grpo3/{d}", {"dtype": d}, d) for d in sz.smoke_dtypes]
    return {"items": _items(budget, plan, run)}


def run_section(name: str, sz: Sizes, form: str, budget_s: float) -> dict:
    """One section under kernel form `form` (`kernels.use_form`), with its status: `pass` when
    every item passed, `fail` when one failed or raised, else `incomplete` (items skipped)."""
    t = time.time()
    fn = {"scan": section_scan, "verify": section_verify, "needle": section_needle,
          "ratios": functools.partial(section_ratios, form=form),
          "smoke": section_smoke}[name]
    with kn.use_form(form):
        jax.clear_caches()  # programs traced under another form must not be reused
        try:
            res = fn(sz, Budget(budget_s))
        except Exception as e:
            res = {"items": [], "error": f"{type(e).__name__}: {e}"[:2000]}
        finally:
            jax.clear_caches()
    states = [i["status"] for i in res["items"]]
    res["status"] = ("error" if "error" in res or not states else
                     "fail" if any(s in ("fail", "error") for s in states) else
                     "incomplete" if "skipped" in states else "pass")
    res.update(budget_s=budget_s, seconds=round(time.time() - t, 1))
    return res


def exactness(report: dict) -> dict:
    """Per `<dtype>/<policy>`: replay exact here, i.e. at least one verify item of it and every
    one passed, no needle item of it failed, and every scan item of the dtype ran and passed
    (what `looprl.rl.replay_choice` reads, with the facts it matches)."""
    sec = report["sections"]

    def items(name, **meta):
        return [i for i in sec.get(name, {}).get("items", [])
                if all(i.get(k) == v for k, v in meta.items())]
    out = {}
    for d in DTYPES:
        scan = items("scan", dtype=d)
        scan_ok = bool(scan) and all(i["status"] == "pass" for i in scan)
        for p in POLICIES:
            ver = [i for i in items("verify", dtype=d, kv_policy=p) if i["status"] != "skipped"]
            needle = items("needle", dtype=d, kv_policy=p)
            out[f"{d}/{p}"] = (scan_ok and bool(ver) and all(i["status"] == "pass" for i in ver)
                               and not any(i["status"] in ("fail", "error") for i in needle))
    env = report["env"]
    return {"device_kind": report["device_kind"], "kernel_version": report["kernel_version"],
            "jax": env.get("jax"), "jaxlib": env.get("jaxlib"), "form": report["form"],
            "dry_run": report["dry_run"], "replay_exact": out}


def report_md(report: dict) -> str:
    ex = report["exactness"]
    lines = [f"# Device check: {report['device_kind']} (`{report['device_key']}`)", "",
             f"Form `{report['form']}`, kernel version `{report['kernel_version']}`, jax "
             f"{ex['jax']}, {report['wall_s']:.0f} s"
             f"{', DRY RUN (counts for nothing)' if report['dry_run'] else ''}. "
             f"Verdict: **{'PASS' if report['ok'] else 'FAIL'}**.", "",
             "Replay exact (what `learner.replay_impl=auto` reads): " + ", ".join(
                 f"{k} {'yes' if v else 'no'}" for k, v in ex["replay_exact"].items()), "",
             "Accelerator pins in force: " + (", ".join(
                 f"`{k}`" for k, on in (report["env"].get("accelerator_pins") or {}).items()
                 if on) or "none"), ""]
    skip = {"name", "status", "seconds", "dtype", "kv_policy", "rows"}
    for name, s in report["sections"].items():
        lines += [f"## {name}: {s.get('status')} ({s.get('seconds', 0):.0f} s of "
                  f"{s.get('budget_s')} s)", ""]
        if s.get("error"):
            lines += [f"`{s['error']}`", ""]
        if s.get("items"):
            lines += ["| item | status | s | details |", "|---|---|---|---|"]
            for i in s["items"]:
                details = "; ".join(f"{k} {json.dumps(v)}" for k, v in i.items() if k not in skip)
                lines.append(f"| {i['name']} | {i['status']} | {i.get('seconds', '')} | "
                             f"{details.replace('|', '/')} |")
            lines.append("")
    return "\n".join(lines) + "\n"


def default_form(dry_run: bool) -> str:
    platform = jax.default_backend()
    if platform == "cpu":
        if not dry_run:
            raise SystemExit("gpu_check: no GPU or TPU here; --dry-run checks the script")
        return kn.current_form().name
    return "pallas-tpu" if platform == "tpu" else "pallas-gpu"


def _section_process(name, args, form, budget_s) -> dict:
    path = Path(args.out_dir) / f".section_{name}.json"
    cmd = [sys.executable, __file__, args.out_dir, "--section", name, "--form", form,
           "--section-json", str(path)] + (["--dry-run"] if args.dry_run else [])
    env = {k: v for k, v in os.environ.items() if k != "XLA_PYTHON_CLIENT_PREALLOCATE"}
    if _PREALLOCATE is not None:
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = _PREALLOCATE
    limit = budget_s + GRACE_S * (4 if args.dry_run else 1)  # a busy CPU starts jax slowly
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=limit)
    except subprocess.TimeoutExpired as e:
        tail = ((e.stderr or b"").decode() if isinstance(e.stderr, bytes) else e.stderr or "")
        return {"status": "timeout", "items": [], "budget_s": budget_s,
                "error": f"killed after {limit:.0f} s", "tail": tail[-1500:]}
    if p.returncode != 0 or not path.exists():
        return {"status": "error", "items": [], "budget_s": budget_s,
                "error": f"exit status {p.returncode}", "tail": (p.stdout + p.stderr)[-1500:]}
    res = json.loads(path.read_text())
    path.unlink()
    return res


def main(argv=None) -> int:
    head, _, rest = __doc__.partition("\n\n")
    p = argparse.ArgumentParser(description=head, epilog=rest,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir", metavar="OUT_DIR", help="directory for report.json and report.md")
    p.add_argument("--dry-run", action="store_true",
                   help="tiny widths on any backend: checks the script, counts for nothing")
    p.add_argument("--form", help="kernel form to check (default: pallas-gpu on a GPU, "
                                  "pallas-tpu on a TPU, the CPU's form in a dry run)")
    p.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset")
    p.add_argument("--budget-scale", type=float, default=1.0,
                   help="multiply every section's time budget")
    p.add_argument("--in-process", action="store_true",
                   help="run the sections in this process (tests; no hard timeout)")
    p.add_argument("--section", help=argparse.SUPPRESS)
    p.add_argument("--section-json", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    sz = DRY if args.dry_run else FULL
    form = args.form or default_form(args.dry_run)
    names = [s for s in args.sections.split(",") if s]
    unknown = sorted(set(names) - set(SECTIONS))
    if unknown:
        p.error(f"unknown sections {unknown}: expected some of {', '.join(SECTIONS)}")
    budgets = {s: BUDGETS_S[s] * args.budget_scale for s in SECTIONS}
    if args.section:  # one section's process
        res = run_section(args.section, sz, form, budgets[args.section])
        Path(args.section_json).write_text(json.dumps(res))
        return 0
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with kn.use_form(form):
        version = kn.kernel_version()
    kind = jax.devices()[0].device_kind
    report = {"format": REPORT_FORMAT, "command": " ".join(sys.argv), "env": environment(),
              "device_kind": kind, "device_key": device_key(kind), "form": form,
              "kernel_version": version, "dry_run": args.dry_run, "sections": {}}
    for name in names:
        t = time.time()
        report["sections"][name] = (run_section(name, sz, form, budgets[name])
                                    if args.in_process else
                                    _section_process(name, args, form, budgets[name]))
        print(f"gpu_check: {name} {report['sections'][name]['status']} in "
              f"{time.time() - t:.0f} s", file=sys.stderr, flush=True)
    report["wall_s"] = round(time.time() - t0, 1)
    report["exactness"] = exactness(report)
    report["ok"] = all(s["status"] == "pass" for s in report["sections"].values()) and \
        names == list(SECTIONS)
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "report.md").write_text(report_md(report))
    print(json.dumps({"benchmark": "gpu_check", "device_key": report["device_key"],
                      "dry_run": args.dry_run, "ok": report["ok"], "wall_s": report["wall_s"],
                      "replay_exact": report["exactness"]["replay_exact"]}))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
