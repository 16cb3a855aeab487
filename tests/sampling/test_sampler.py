"""The rollout engine (looprl.sampling): determinism, alignment, KV policies, exit rule, I/O.

References: `all_loop_outputs` (the full teacher-forced forward) and `_np_copy_reference`, a
plain-numpy model that recomputes every step from scratch and reads K/V at loop d from loop
min(d, k) (the `copy` policy's semantics; with k = T everywhere it is the dense model).
"""
import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from looprl.errors import SamplingError, ScheduleError
from looprl.model.config import preset
from looprl.model.looped import (all_loop_outputs, cast_weights, exit_distribution, init_params,
                                 q_exit_loops)
from looprl.sampling.sampler import SamplingConfig, generate
from looprl.sampling.schedule import RolloutBatch

CFG = preset("tiny", vocab_size=32, hidden_size=64, intermediate_size=128, num_heads=2,
             num_kv_heads=2, head_dim=32)
PROMPTS = [[5, 9, 3, 7, 11], [4, 6], [8, 12, 13, 14, 15, 16, 17], [20]]
T = CFG.total_ut_steps


@pytest.fixture(scope="module")
def params():
    p = init_params(CFG, 0)
    p["early_exit_gate"]["bias"] = jnp.array([-0.3])  # lambda ~ 0.4: exits spread over loops
    return jax.tree.map(np.asarray, p)


def _bits(x):
    return np.asarray(x, np.float32).view(np.uint32)


def _emit(rb):
    return np.asarray(rb.exit_loop_BxS) > 0


# --- determinism --------------------------------------------------------------------------------

SCRIPT = """
import os, sys, json, hashlib
os.environ["XLA_FLAGS"] = "--xla_cpu_multi_thread_eigen=false"
sys.path.insert(0, {root!r})
import numpy as np, jax, jax.numpy as jnp
from looprl.model.config import preset
from looprl.model.looped import init_params
from looprl.sampling.sampler import SamplingConfig, generate
cfg = preset("tiny", vocab_size=32, hidden_size=64, intermediate_size=128, num_heads=2,
             num_kv_heads=2, head_dim=32)
p = init_params(cfg, 0)
p["early_exit_gate"]["bias"] = jnp.array([-0.3])
p = jax.tree.map(np.asarray, p)
rb = generate(cfg, p, {prompts!r}, SamplingConfig(max_new_tokens=12, exit_threshold=0.6,
              kv_policy="deferred"), group_size=2, seed=3)
print(json.dumps([np.asarray(rb.tokens_BxS).tolist(),
                  np.asarray(rb.logprob_BxS, np.float32).view(np.uint32).tolist()]))
"""


def test_same_seed_same_batch_gives_identical_tokens_and_logprob_bits(params):
    scfg = SamplingConfig(max_new_tokens=12, exit_threshold=0.6, kv_policy="deferred")
    a = generate(CFG, params, PROMPTS, scfg, group_size=2, seed=3)
    b = generate(CFG, params, PROMPTS, scfg, group_size=2, seed=3)
    np.testing.assert_array_equal(a.tokens_BxS, b.tokens_BxS)
    np.testing.assert_array_equal(_bits(a.logprob_BxS), _bits(b.logprob_BxS))
    np.testing.assert_array_equal(a.exit_loop_BxS, b.exit_loop_BxS)
    c = generate(CFG, params, PROMPTS, scfg, group_size=2, seed=4)
    assert not np.array_equal(a.tokens_BxS, c.tokens_BxS)  # the seed matters
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", SCRIPT.format(root=root, prompts=PROMPTS)],
                         capture_output=True, text=True, timeout=120, check=True)
    tokens, bits = json.loads(out.stdout.strip().splitlines()[-1])
    np.testing.assert_array_equal(np.asarray(tokens), a.tokens_BxS)
    np.testing.assert_array_equal(np.asarray(bits, np.uint32), _bits(a.logprob_BxS))


# --- alignment against the full forward ---------------------------------------------------------

def _full_forward(params, rb, dtype="float32"):
    w = cast_weights(jax.tree.map(jnp.asarray, params), dtype)
    return all_loop_outputs(CFG, w, jnp.asarray(rb.tokens_BxS), jnp.asarray(rb.pad_B))


def test_greedy_dense_q1_matches_argmax_of_full_forward(params):
    rb = generate(CFG, params, PROMPTS, SamplingConfig(max_new_tokens=10, temperature=0.0,
                                                       exit_threshold=1.0, stop_ids=()))
    emit = _emit(rb)
    assert (np.asarray(rb.exit_loop_BxS)[emit] == T).all()
    logits = np.asarray(_full_forward(params, rb).logits[T - 1])
    nxt = np.asarray(rb.tokens_BxS)[:, 1:]
    np.testing.assert_array_equal(np.argmax(logits, -1)[:, :-1][emit[:, :-1]],
                                  nxt[emit[:, :-1]])


def test_logprobs_at_temperature_half_equal_log_softmax_of_scaled_logits_at_exit_loop(params):
    rb = generate(CFG, params, PROMPTS, SamplingConfig(max_new_tokens=10, temperature=0.5,
                                                       exit_threshold=0.6, stop_ids=()),
                  seed=1)
    emit = _emit(rb)
    out = _full_forward(params, rb)
    logits = np.asarray(out.logits)  # T,B,S,V
    k = np.asarray(rb.exit_loop_BxS)
    # exit loops follow the Q-exit rule on the full forward's gate
    np.testing.assert_array_equal(np.asarray(q_exit_loops(out.exit_lambda, 0.6))[emit], k[emit])
    picked = np.take_along_axis(logits, np.maximum(k - 1, 0)[None, ..., None], axis=0)[0]
    ref = jax.nn.log_softmax(jnp.asarray(picked) / 0.5, axis=-1)
    nxt = np.concatenate([np.asarray(rb.tokens_BxS)[:, 1:], np.zeros((len(k), 1), int)], 1)
    ref_lp = np.take_along_axis(np.asarray(ref), nxt[..., None], -1)[..., 0]
    np.testing.assert_allclose(np.asarray(rb.logprob_BxS)[emit], ref_lp[emit], atol=1e-5)
    assert (k[emit] < T).mean() > 0.2  # the check covers early exits


@pytest.mark.slow  # one compile per loop (~30 s)
def test_cached_prefill_decode_equals_full_forward_at_every_loop(params):
    prompts = [[5, 9, 3, 7, 11, 2, 3], [4], [8, 12, 13]]  # mixed lengths, a one-token prompt
    for d in range(1, T + 1):
        rb = generate(CFG, params, prompts, SamplingConfig(max_new_tokens=6, fixed_depth=d,
                                                           stop_ids=()), seed=d)
        emit = _emit(rb)
        assert (np.asarray(rb.exit_loop_BxS)[emit] == d).all()
        logits = np.asarray(_full_forward(params, rb).logits[d - 1])
        nxt = np.concatenate([np.asarray(rb.tokens_BxS)[:, 1:],
                              np.zeros((len(prompts), 1), int)], 1)
        ref = np.take_along_axis(np.asarray(jax.nn.log_softmax(logits, -1)), nxt[..., None],
                                 -1)[..., 0]
        np.testing.assert_allclose(np.asarray(rb.logprob_BxS)[emit], ref[emit], atol=1e-5)


def test_deferred_gives_dense_greedy_tokens_and_logprobs_within_1e5(params):
    kw = dict(max_new_tokens=16, temperature=0.0, exit_threshold=0.6, stop_ids=(),
              deferred_max_pending=3)
    dense = generate(CFG, params, PROMPTS, SamplingConfig(kv_policy="dense", **kw))
    deferred = generate(CFG, params, PROMPTS, SamplingConfig(kv_policy="deferred", **kw))
    np.testing.assert_array_equal(dense.tokens_BxS, deferred.tokens_BxS)
    np.testing.assert_array_equal(dense.exit_loop_BxS, deferred.exit_loop_BxS)
    emit = _emit(dense)
    np.testing.assert_allclose(deferred.logprob_BxS[emit], dense.logprob_BxS[emit], atol=1e-5)
    assert deferred.flush_BxS.any() and (dense.exit_loop_BxS[emit] < T).any()


@pytest.mark.slow  # 16 s; tests/sampling/test_needle.py (sampled, not greedy)
def test_prompt_alone_and_inside_a_batch_gives_the_same_tokens(params):
    scfg = SamplingConfig(max_new_tokens=10, temperature=0.0, exit_threshold=0.6, stop_ids=())
    alone = generate(CFG, params, [PROMPTS[0]], scfg)
    batch = generate(CFG, params, PROMPTS, scfg)  # longer and shorter prompts around it
    na, nb = alone.schedule.prompt_len, batch.schedule.prompt_len
    np.testing.assert_array_equal(alone.tokens_BxS[0, na:], batch.tokens_BxS[0, nb:nb + 10])


# --- copy policy vs a from-scratch reference ----------------------------------------------------

def _np_rms(x, w, eps):
    return (x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)) * w


def _np_rope(x, pos, theta):
    K = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, K, 2, dtype=np.float64) / K)
    f = pos[:, None] * inv[None]
    emb = np.concatenate([f, f], -1)
    cos, sin = np.cos(emb)[:, None], np.sin(emb)[:, None]
    rot = np.concatenate([-x[..., K // 2:], x[..., :K // 2]], -1)
    return x * cos + rot * sin


def _np_copy_reference(p, ids, depth):
    """Plain numpy (fp64) forward of one unpadded row `ids` where position j's K/V at loop d
    are those it computed at loop min(d, depth[j]). Returns logits [T, S, V] and gate [T, S]."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
    lw = p["layers"]
    S = len(ids)
    H, K, eps = CFG.num_heads, CFG.head_dim, CFG.rms_norm_eps
    pos = np.arange(S, dtype=np.float64)
    h = p["embed_tokens"][ids]
    kv = {}
    logits, gates = [], []
    for d in range(1, T + 1):
        x = h
        for layer in range(CFG.num_layers):
            g = lambda n: lw[n][layer]  # noqa: E731
            z = _np_rms(x, g("input_layernorm"), eps)
            q = _np_rope((z @ g("q_proj")).reshape(S, H, K), pos, CFG.rope_theta)
            k = _np_rope((z @ g("k_proj")).reshape(S, H, K), pos, CFG.rope_theta)
            v = (z @ g("v_proj")).reshape(S, H, K)
            kv[d, layer] = (k, v)
            src = np.minimum(d, depth)
            ks = np.stack([kv[int(src[j]), layer][0][j] for j in range(S)])
            vs = np.stack([kv[int(src[j]), layer][1][j] for j in range(S)])
            sc = np.einsum("qhk,shk->hqs", q, ks) / np.sqrt(K)
            sc = np.where(np.tril(np.ones((S, S), bool))[None], sc, -np.inf)
            pr = np.exp(sc - sc.max(-1, keepdims=True))
            pr /= pr.sum(-1, keepdims=True)
            o = np.einsum("hqs,shk->qhk", pr, vs).reshape(S, H * K)
            a = x + _np_rms(o @ g("o_proj"), g("input_layernorm_2"), eps)
            zz = _np_rms(a, g("post_attention_layernorm"), eps)
            gate = zz @ g("gate_proj")
            m = (gate / (1 + np.exp(-gate)) * (zz @ g("up_proj"))) @ g("down_proj")
            x = a + _np_rms(m, g("post_attention_layernorm_2"), eps)
        h = _np_rms(x, p["norm"], eps)
        logits.append(h @ p["lm_head"])
        ge = p["early_exit_gate"]
        gates.append(1 / (1 + np.exp(-(h @ ge["kernel"][:, 0] + ge["bias"][0]))))
    return np.stack(logits), np.stack(gates)


def test_copy_matches_from_scratch_reference_of_its_semantics(params):
    q = 0.6
    rb = generate(CFG, params, PROMPTS[:2], SamplingConfig(max_new_tokens=8, exit_threshold=q,
                                                           kv_policy="copy", stop_ids=()),
                  seed=2)
    P = rb.schedule.prompt_len
    checked = early = 0
    for b in range(2):
        pad = int(rb.pad_B[b])
        n = int(rb.completion_len_B[b])
        row = np.asarray(rb.tokens_BxS[b, pad:P + n])
        exits = np.asarray(rb.exit_loop_BxS[b, pad:P + n])
        plen = P - pad
        for i in range(plen - 1, len(row) - 1):  # step emitting row[i + 1]
            # from scratch on the prefix: prompt positions hold all T loops, completion
            # positions their recorded exit loop; the current position runs to its own exit
            depth = np.where(np.arange(i + 1) < plen, T, exits[:i + 1])
            depth[i] = T  # the query position's own later loops are not read by earlier ones
            logits, lam = _np_copy_reference(params, row[:i + 1], depth)
            k = int(np.asarray(q_exit_loops(jnp.asarray(lam[:, i:i + 1, None], jnp.float32),
                                            q))[0, 0])
            assert k == exits[i]
            z = logits[k - 1, i]
            ref = z[row[i + 1]] - (z.max() + np.log(np.exp(z - z.max()).sum()))
            np.testing.assert_allclose(rb.logprob_BxS[b, pad + i], ref, atol=1e-5)
            checked += 1
            early += k < T
    assert checked >= 16 and early >= 4


# --- exit rule ----------------------------------------------------------------------------------

def test_q_exit_rule_matches_direct_computation():
    rng = np.random.default_rng(0)
    lam = rng.uniform(0.05, 0.95, size=(T, 50)).astype(np.float32)
    for q in (0.3, 0.5, 0.8, 0.95):
        got = np.asarray(q_exit_loops(jnp.asarray(lam), q))
        for j in range(lam.shape[1]):
            surv, cdf, want = np.float32(1), np.float32(0), T
            for t in range(T):
                pt = surv if t == T - 1 else np.float32(lam[t, j] * surv)
                cdf = np.float32(cdf + pt)
                surv = np.float32(surv * (np.float32(1) - lam[t, j]))
                if cdf >= np.float32(q):
                    want = t + 1
                    break
            assert got[j] == want, (q, j)
    # q = 1.0 is loop T even where the gate saturates so CDF rounds to 1 at loop 1
    assert (np.asarray(q_exit_loops(jnp.ones((T, 3), jnp.float32), 1.0)) == T).all()


def test_q1_means_loop_T_even_with_bf16_saturated_gate(params):
    p = jax.tree.map(np.asarray, params)
    p = {**p, "early_exit_gate": {"kernel": p["early_exit_gate"]["kernel"],
                                  "bias": np.array([8.0], np.float32)}}  # > 6.3: 1.0 in bf16
    assert float(jnp.asarray(jax.nn.sigmoid(8.0), jnp.bfloat16)) == 1.0
    rb = generate(CFG, p, PROMPTS[:1], SamplingConfig(max_new_tokens=4, exit_threshold=1.0,
                                                      compute_dtype="bfloat16", stop_ids=()))
    assert (rb.exit_loop_BxS[_emit(rb)] == T).all()
    rb = generate(CFG, p, PROMPTS[:1], SamplingConfig(max_new_tokens=4, exit_threshold=0.99,
                                                      compute_dtype="bfloat16", stop_ids=()))
    assert (rb.exit_loop_BxS[_emit(rb)] == 1).all()  # the literal rule exits at once


def test_exit_distribution_sums_to_one():
    lam = jnp.asarray(np.random.default_rng(1).uniform(0, 1, (T, 3, 5)), jnp.float32)
    p = np.asarray(exit_distribution(lam))
    np.testing.assert_allclose(p.sum(0), 1.0, atol=1e-6)
    assert (p >= 0).all()
    np.testing.assert_allclose(p[0], lam[0], rtol=1e-6)


# --- bad input ----------------------------------------------------------------------------------

@pytest.mark.parametrize("prompts, kw, match", [
    ([[]], {}, "empty"),
    ([list(range(3, 13))], {"max_seq_len": 8}, "does not fit"),
    ([[3]], {"kv_policy": "paged"}, "kv_policy"),
    ([[3]], {"exit_threshold": 0.0}, "exit_threshold"),
    ([[3]], {"exit_threshold": 1.5}, "exit_threshold"),
    ([[3]], {"top_p": 0.0}, "top_p"),
    ([[3]], {"top_p": 1.1}, "top_p"),
    ([[3]], {"top_k": -1}, "top_k"),
])
def test_bad_input_raises_sampling_error(params, prompts, kw, match):
    with pytest.raises(SamplingError, match=match):
        generate(CFG, params, prompts, SamplingConfig(max_new_tokens=4, **kw))


# --- save / load --------------------------------------------------------------------------------

def test_rollout_save_load_round_trip_keeps_bits_and_checks_version(params, tmp_path):
    rb = generate(CFG, params, PROMPTS, SamplingConfig(max_new_tokens=12, exit_threshold=0.6,
                                                       kv_policy="deferred"), group_size=2,
                  seed=3)
    path = tmp_path / "r.npz"
    rb.save(path)
    back = RolloutBatch.load(path)
    for k in ("tokens_BxS", "pad_B", "exit_loop_BxS", "flush_BxS", "completion_len_B"):
        np.testing.assert_array_equal(getattr(back, k), getattr(rb, k))
    np.testing.assert_array_equal(_bits(back.logprob_BxS), _bits(rb.logprob_BxS))
    assert back.schedule == rb.schedule
    with np.load(path) as z:
        data = {k: z[k] for k in z.files}
    meta = json.loads(str(data["meta"]))
    meta["format_version"] = 99
    data["meta"] = np.asarray(json.dumps(meta))
    np.savez(tmp_path / "bad.npz", **data)
    with pytest.raises(ScheduleError, match="format_version"):
        RolloutBatch.load(tmp_path / "bad.npz")


# --- stock kernels ------------------------------------------------------------------------------

@pytest.mark.slow  # 36 s; forced re-runs of stock rollouts: tests/rl/test_learner.py, tests/verify
def test_stock_kernels_same_math_and_replayed_exactly_by_forced_rerun(params):
    """`kernels="stock"` (plain matmuls) samples the same distribution (greedy tokens equal to the
    invariant sampler's, log-probs within 1e-5), records its kernels in the schedule, and its
    `replay` is the forced re-run: bit-exact, whereas the invariant learner pass is not."""
    from looprl.logprobs import batch_logprobs

    kw = dict(max_new_tokens=10, temperature=0.0, exit_threshold=0.6, kv_policy="deferred",
              deferred_max_pending=3, stop_ids=())
    inv = generate(CFG, params, PROMPTS, SamplingConfig(**kw))
    stk = generate(CFG, params, PROMPTS, SamplingConfig(kernels="stock", **kw))
    assert stk.schedule.kernels == "stock" and stk.schedule.row_tile == 1
    assert inv.schedule.kernels == "invariant"
    np.testing.assert_array_equal(stk.tokens_BxS, inv.tokens_BxS)
    np.testing.assert_array_equal(stk.exit_loop_BxS, inv.exit_loop_BxS)
    emit = _emit(stk)
    assert np.max(np.abs(stk.logprob_BxS - inv.logprob_BxS)[emit]) < 1e-5
    assert not np.array_equal(_bits(stk.logprob_BxS)[emit], _bits(inv.logprob_BxS)[emit])
    replay, _ = batch_logprobs(CFG, params, stk, "replay", rows=[2, 0])
    assert np.array_equal(_bits(replay), _bits(stk.logprob_BxS[[2, 0]]))
    dense, _ = batch_logprobs(CFG, params, stk, "dense")
    assert not np.array_equal(_bits(dense)[emit], _bits(stk.logprob_BxS)[emit])


def test_unknown_kernels_is_a_clear_error(params):
    with pytest.raises(SamplingError, match="kernels must be one of"):
        generate(CFG, params, PROMPTS, SamplingConfig(kernels="fast"))


@pytest.mark.slow  # 16 s; timings: tests/cli/test_generate_cli.py
def test_timings_split_prefill_from_decode_without_changing_the_rollout(params):
    scfg = SamplingConfig(max_new_tokens=6, temperature=1.0, kv_policy="deferred",
                          exit_threshold=0.7, deferred_max_pending=2, stop_ids=())
    timings = {}
    a = generate(CFG, params, PROMPTS, scfg, seed=3, timings=timings)
    b = generate(CFG, params, PROMPTS, scfg, seed=3)
    assert set(timings) == {"prefill_s", "decode_s", "decode_steps", "kv_cache_bytes"}
    assert timings["prefill_s"] > 0 and timings["decode_s"] > 0
    S = a.schedule.seq_len  # keys and values, [T, L, B, S, Hkv, K] fp32 each
    assert timings["kv_cache_bytes"] == 2 * CFG.total_ut_steps * CFG.num_layers * len(PROMPTS) \
        * S * CFG.num_kv_heads * CFG.head_dim * 4
    assert timings["decode_steps"] == scfg.max_new_tokens - 1  # prefill emits the first token
    assert np.array_equal(a.tokens_BxS, b.tokens_BxS)
    assert np.array_equal(_bits(a.logprob_BxS), _bits(b.logprob_BxS))


@pytest.mark.slow  # 56 s: four batch sizes
def test_default_pending_bound_follows_the_batch_and_forced_reruns_keep_the_recorded_one(params):
    scfg = SamplingConfig(max_new_tokens=5, temperature=1.0, kv_policy="deferred",
                          exit_threshold=0.7, stop_ids=())
    four = generate(CFG, params, PROMPTS, scfg, seed=1)  # 4 rows: 64 // 4 - 1
    one = generate(CFG, params, PROMPTS[:1], scfg, seed=1)
    many = generate(CFG, params, PROMPTS, scfg, group_size=4, seed=1)  # 16 rows: none pending
    assert [r.schedule.deferred_max_pending for r in (one, four, many)] == [63, 15, 0]
    assert [r.schedule.chunk_size for r in (one, four, many)] == [64, 16, 1]
    again = generate(CFG, params, [[0]], scfg, forced=four)  # re-run: 15, not 63 for 1 prompt
    assert again.schedule.deferred_max_pending == 15
    assert np.array_equal(_bits(again.logprob_BxS), _bits(four.logprob_BxS))
    with pytest.raises(SamplingError, match="sampled with 15"):
        generate(CFG, params, [[0]], dataclasses.replace(scfg, deferred_max_pending=4),
                 forced=four)


def test_deferred_with_no_pending_window_is_dense_bit_for_bit_and_replays(params):
    """`deferred_max_pending=0` (the automatic bound from 16 rows per device): every live row
    is flushed at every decode step, so the rollout is dense's (tokens, exit loops, log-prob
    bits, the rows of every loop's pass), recorded as deferred with a flush per decode step;
    a forced re-run and the learner's replay reproduce its bits."""
    from looprl.logprobs import batch_logprobs
    kw = dict(max_new_tokens=9, temperature=1.0, exit_threshold=0.7, stop_ids=(5,))
    dense = generate(CFG, params, PROMPTS, SamplingConfig(kv_policy="dense", **kw), seed=4)
    got = generate(CFG, params, PROMPTS, SamplingConfig(kv_policy="deferred",
                                                        deferred_max_pending=0, **kw), seed=4)
    assert got.schedule.kv_policy == "deferred" and got.schedule.deferred_max_pending == 0
    assert got.schedule.chunk_size == 1
    mask = got.exit_loop_BxS > 0
    assert (got.exit_loop_BxS[mask] < CFG.total_ut_steps).mean() >= 0.2  # early exits happen
    np.testing.assert_array_equal(got.tokens_BxS, dense.tokens_BxS)
    np.testing.assert_array_equal(got.exit_loop_BxS, dense.exit_loop_BxS)
    assert np.array_equal(_bits(got.logprob_BxS), _bits(dense.logprob_BxS))
    P = got.schedule.prompt_len
    decode = mask.copy()
    decode[:, P] = False  # the prefill emits the first token; each later one is a decode step
    assert np.array_equal(got.flush_BxS[:, P + 1:], decode[:, P + 1:])
    assert got.schedule.window_widths == dense.schedule.window_widths == (1,)
    np.testing.assert_array_equal(got.loop_rows, dense.loop_rows)  # the passes dense ran
    again = generate(CFG, params, [[0]], SamplingConfig(kv_policy="deferred", **kw),
                     forced=got)
    assert again.schedule.deferred_max_pending == 0
    assert np.array_equal(_bits(again.logprob_BxS), _bits(got.logprob_BxS))
    lp, _ = batch_logprobs(CFG, params, got, "replay")
    assert np.array_equal(_bits(np.where(mask, lp, 0)), _bits(np.where(mask, got.logprob_BxS, 0)))
