"""The device check's exactness items: replay cells, the needle and the kernel row scans.

Each returns a record with `status` (`pass` / `fail`) and its facts. A replay cell samples a
rollout at one layer of the check's model width with random weights and runs
`looprl.verify.matrix.verify_rollout` on it: every replay cell must be exact and every stock
cell must not (else the check has no power). Its `digest` (SHA-256 of the rollout's tokens,
exit loops and log-prob bits, and of the replay's bits) is what the run-to-run item compares.
"""
from __future__ import annotations

import functools
import hashlib

import jax
import jax.numpy as jnp
import numpy as np

from looprl import kernels as kn
from looprl.model import init_params
from looprl.sampling.sampler import SamplingConfig, generate
from looprl.verify.matrix import VerifyOptions, verify_rollout


def bits(a) -> np.ndarray:
    """An array's raw bits: int32 for integers, the float32 bit pattern (uint32) otherwise."""
    a = np.asarray(a)
    if np.issubdtype(a.dtype, np.integer):
        return a.astype(np.int32)
    return np.asarray(jnp.asarray(a).astype(jnp.float32)).view(np.uint32)


def row_scan(fn, args, rows, offsets=(0, 100)) -> list[int]:
    """The row counts M for which `fn(*args cut to M rows)` differs in bits from the same rows of
    `fn(*args)` (each arg's axis 0 is the row axis; the M rows taken at each offset)."""
    f = jax.jit(fn)
    big = bits(f(*args))
    n = args[0].shape[0]
    bad = []
    for m in rows:
        for off in dict.fromkeys(min(o, n - m) for o in offsets):
            part = bits(f(*(a[off:off + m] for a in args)))
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
        got = bits(o[0, -1])
        if ref is None:
            ref = got
        elif not np.array_equal(got, ref):
            bad.append(f"B={B},S={S},C={C},pad={pad}")
    return bad


class Scans:
    """The kernel row scans at sizes `sz`: each method one item's record."""

    def __init__(self, sz):
        self.sz, self.cfg = sz, sz.model
        self.rng = np.random.default_rng(0)

    def _arr(self, shape, dtype, scale=1.0):
        return jnp.asarray(self.rng.standard_normal(shape) * scale, dtype)

    def _rows(self, fn, *args, control=None) -> dict:
        bad = row_scan(fn, args, self.sz.scan_rows)
        rec = {"rows_tested": list(self.sz.scan_rows), "rows_differing": bad,
               "status": "fail" if bad else "pass"}
        if control is not None:  # the same scan of the stock kernel: not pass/fail
            rec["stock_rows_differing"] = row_scan(control, args, self.sz.scan_rows)
        return rec

    def matmul(self, dtype: str, weight: str) -> dict:
        i, o = self.sz.weights[weight]
        out = jnp.float32 if weight == "lm_head" else None
        w = self._arr((i, o), dtype, i ** -0.5)
        control = ((lambda x: kn.stock_matmul(x, w, out)) if weight == self.sz.control
                   else None)
        return self._rows(lambda x: kn.matmul(x, w, out), self._arr((self.sz.big_rows, i), dtype),
                          control=control)

    def attention(self, dtype: str) -> dict:
        c = self.cfg
        bad = attention_scan(dtype, c.num_heads, c.num_kv_heads, c.head_dim)
        return {"calls_differing": bad, "status": "fail" if bad else "pass"}

    def rms_norm(self, dtype: str) -> dict:
        D, n = self.cfg.hidden_size, self.sz.big_rows
        gain = self._arr((D,), dtype)
        return self._rows(lambda x: kn.rms_norm(x, gain, 1e-6), self._arr((n, D), dtype))

    def token_logprob(self, dtype: str) -> dict:
        D, V, n = self.cfg.hidden_size, self.cfg.vocab_size, self.sz.big_rows
        w = self._arr((D, V), dtype, D ** -0.5)
        targets = jnp.asarray(self.rng.integers(0, V, (n, 1)), jnp.int32)
        return self._rows(lambda h, t: jnp.take_along_axis(
            kn.log_softmax(kn.matmul(h, w, jnp.float32)), t, axis=-1),
            self._arr((n, D), dtype), targets)

    def rows(self, op: str) -> dict:
        fn = {"rowsum": kn.rowsum, "softmax": kn.softmax, "log_softmax": kn.log_softmax}[op]
        return self._rows(fn, self._arr((self.sz.big_rows, self.cfg.vocab_size), jnp.float32, 4.0))


def _prompts(vocab: int, n: int, seed: int = 5) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[1] + [int(t) for t in rng.integers(3, vocab, int(rng.integers(6, 30)))]
            for _ in range(n)]


@functools.cache
def _init(cfg):
    return init_params(cfg, 0)


def _params(sz):
    """The check's random weights at `sz` (seed 0), made once per process."""
    return _init(sz.model)


def replay_cell(sz, dtype: str, policy: str, rows: int) -> dict:
    """One replay cell: a `rows`-row rollout in `dtype` with `policy` KV (groups of 4 from 8
    rows), verified by `verify_rollout`; `digest` for the run-to-run item."""
    cfg, params = sz.model, _params(sz)
    opts = VerifyOptions(min_tokens=sz.min_tokens, exit_threshold_random=sz.exit_q)
    group = 4 if rows >= 8 else 1
    scfg = SamplingConfig(max_new_tokens=max(4, -(-sz.min_tokens // rows)), temperature=1.0,
                          exit_threshold=sz.exit_q, kv_policy=policy,
                          deferred_max_pending=opts.deferred_max_pending, stop_ids=(),
                          compute_dtype=dtype)
    rb = generate(cfg, params, _prompts(cfg.vocab_size, 64)[:rows // group], scfg,
                  group_size=group, seed=0)
    cells = verify_rollout(cfg, params, rb, opts, weights="random", log=lambda m: None)
    replay = [c for c in cells if c["method"] == "replay"]
    stock = [c for c in cells if c["method"] == "stock"]
    unmet = cells[0]["requirements_unmet"]
    ok = (not unmet and all(c["exact_fraction"] == 1.0 for c in replay)
          and all(c["exact_fraction"] < 1.0 for c in stock))
    h = hashlib.sha256()
    for a in (rb.tokens_BxS, rb.exit_loop_BxS, rb.logprob_BxS):
        h.update(bits(a).tobytes())
    return {"tokens": cells[0]["tokens"],
            "early_exit_fraction": round(cells[0]["early_exit_fraction"], 3),
            "replay_exact_cells": sum(c["exact_fraction"] == 1.0 for c in replay),
            "replay_cells": len(replay),
            "replay_min_exact_fraction": min(c["exact_fraction"] for c in replay),
            "replay_max_abs_diff": max(c["max_abs_diff"] for c in replay),
            "stock_mismatching_cells": sum(c["exact_fraction"] < 1.0 for c in stock),
            "stock_cells": len(stock), "requirements_unmet": unmet, "digest": h.hexdigest(),
            "status": "pass" if ok else "fail"}


def needle(sz, dtype: str, policy: str) -> dict:
    """A prompt alone and inside three batches (the same bucket, a larger bucket, a cache
    straddling a 128-key block): its tokens, exit loops and log-prob bits must not change."""
    cfg, params = sz.model, _params(sz)
    rng = np.random.default_rng(7)
    tok = functools.partial(rng.integers, 3, cfg.vocab_size)
    one = [1] + [int(t) for t in tok(7)]
    mates = [[1] + [int(t) for t in tok(4)], [1] + [int(t) for t in tok(5)]]
    longer = [1] + [int(t) for t in tok(39)]  # the batch moves to the 48 bucket
    straddle = [1] + [int(t) for t in tok(99)]  # 112 bucket: the needle's keys cross slot 128
    batches = {"alone": ([one], 0), "same_bucket": ([mates[0], one, mates[1]], 1),
               "larger_bucket": ([longer, mates[0], one], 2),
               "straddling": ([one, straddle], 0)}
    scfg = SamplingConfig(max_new_tokens=sz.needle_new, temperature=1.0,
                          exit_threshold=sz.exit_q, kv_policy=policy, compute_dtype=dtype,
                          stop_ids=(), prompt_len_multiple=16)
    got = {}
    for name, (prompts, i) in batches.items():
        ids = [1234 if j == i else 10 + j for j in range(len(prompts))]
        b = generate(cfg, params, prompts, scfg, seed=3, step=2, prompt_indices=ids)
        P = b.schedule.prompt_len
        got[name] = (np.asarray(b.tokens_BxS)[i, P:], np.asarray(b.exit_loop_BxS)[i, P - 1:],
                     bits(np.asarray(b.logprob_BxS, np.float32)[i, P - 1:]))
    differing = [f"{name}: {what}" for name, v in got.items() if name != "alone"
                 for what, a, b in zip(("tokens", "exit loops", "log-prob bits"),
                                       got["alone"], v) if not np.array_equal(a, b)]
    exits = got["alone"][1][got["alone"][1] > 0]
    return {"differing": differing, "early_exits": int((exits < cfg.total_ut_steps).sum()),
            "status": "fail" if differing else "pass"}
