"""The rollout engine: jitted prefill + decode with per-token early exit and a (loop, layer) KV
cache, recording the schedule (docs/DESIGN.md §3).

Layout: B = prompts x G rows, left-padded to the longest prompt rounded up to a multiple of
`prompt_len_multiple` (P; the compiled shapes depend on P, so a multiple > 1 lets batches of
different prompts share one compilation); the cache holds S = P + max_new_tokens positions for
each of the T x L (loop, layer) slots: `[T, L, B, S, Hkv, K]` (`state.DecodeState`).
Prefill runs every prompt position through all T loops as one chunk; each decode step runs the
current position (plus the KV policy's pending window, `kv_policies`) as one chunk
(`chunk.run_chunk`), each loop only for the rows that still need it (`compaction`). All
matmuls and attention use the batch-invariant kernels of `looprl.kernels`, so a row's numbers
do not depend on the chunk or batch it ran in.

`forced` mode re-runs a recorded rollout (its tokens, exit loops and flushes) at other
parameters: the sampler "in forced mode" of the reproducibility matrix. With a thinking budget
(`thinking`), a completion that runs out of it gets its forced answer written over the drawn
tokens, recorded in `forced_BxS`.
"""
from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as PS

from looprl.config.sections import KERNELS
from looprl.distributed import mesh as ml
from looprl.distributed.mesh import ROW_AXES, mesh_record
from looprl.errors import SamplingError
from looprl.kernels import kernel_version, row_tile
from looprl.model.config import OuroConfig
from looprl.model.looped import cast_weights, embed, stacks_cast_once
from looprl.sampling import thinking
from looprl.sampling.chunk import run_chunk
from looprl.sampling.compaction import row_menu
from looprl.sampling.config import SamplingConfig
from looprl.sampling.fingerprint import params_fingerprint
from looprl.sampling.kv_policies import auto_max_pending, policy_named
from looprl.sampling.schedule import RolloutBatch, Schedule
from looprl.sampling.state import DecodeState, RowInfo, Static, kv_cache_bytes


def layout_prompts(prompts: list[list[int]], max_new_tokens: int, max_seq_len: int | None,
                   prompt_len_multiple: int = 1):
    """Left-pad prompts into `[B, S]` int32; returns (tokens, pad_B, P, S), P = the longest prompt
    rounded up to a multiple of `prompt_len_multiple`. Raises SamplingError for an empty prompt
    or a prompt that does not fit the cache."""
    if not prompts:
        raise SamplingError("no prompts given")
    for i, pr in enumerate(prompts):
        if len(pr) == 0:
            raise SamplingError(f"prompt {i} is empty (needs at least one token)")
    P = -(-max(len(pr) for pr in prompts) // prompt_len_multiple) * prompt_len_multiple
    S = P + max_new_tokens
    if max_seq_len is not None:
        if P >= max_seq_len:
            raise SamplingError(f"prompt of {P} tokens does not fit the cache of "
                                f"{max_seq_len} positions (needs room for at least one new token)")
        S = min(S, max_seq_len)
    tokens = np.zeros((len(prompts), S), np.int32)
    pad = np.zeros((len(prompts),), np.int32)
    for b, pr in enumerate(prompts):
        pad[b] = P - len(pr)
        tokens[b, pad[b]:P] = pr
    return tokens, pad, P, S


def generate(cfg: OuroConfig, params, prompts: list[list[int]], scfg: SamplingConfig, *,
             group_size: int = 1, seed: int = 0, step: int = 0,
             prompt_indices: list[int] | None = None, decode_steps_per_call: int | None = None,
             progress=None, forced: RolloutBatch | None = None, mesh=None,
             timings: dict | None = None, master_fingerprint: str | None = None) -> RolloutBatch:
    """Sample `group_size` completions for each prompt; returns a `RolloutBatch` with schedule.

    Args:
      params: fp32 master parameter dict (`looprl.model.looped.param_dict`), or its copy in
        the compute dtype (`looprl.sampling.resident.ComputeWeights`: the same bits, half the
        memory in bf16), which needs `master_fingerprint`.
      prompts: token id lists (non-empty). Row b = prompt b // G, sample b % G.
      prompt_indices: each prompt's global index in its dataset (seeds its noise); default 0..n-1.
      decode_steps_per_call: decode steps per jitted call (progress granularity); default all.
      progress: optional callable(n_new_tokens_so_far, total) for a progress bar.
      forced: re-run this recorded rollout (tokens, exits, flushes, layout) at `params`.
      mesh: a `jax.sharding.Mesh` (`looprl.distributed.mesh`): rows and the KV cache are split
        over its row axes and each device runs this one-device program on its rows
        (`shard_map`; params all-gathered), so every row gets the bits it gets on one device.
      timings: a dict to fill with wall seconds `prefill_s` (prefill, which emits the first new
        token; waits for it to finish) and `decode_s` (the decode steps, which emit the rest),
        `decode_steps` (steps run), so decode throughput can be told from prefill, and
        `kv_cache_bytes` (`state.kv_cache_bytes` of the whole batch).
      master_fingerprint: `params_fingerprint` of the fp32 master when `params` is a
        compute-dtype copy; the schedule records it (else the fingerprint of `params`).
    Raises: SamplingError on bad input (see `SamplingConfig.validate`, `layout_prompts`), or
      for weights held in a dtype other than fp32 without `master_fingerprint` or with another
      compute dtype (their bits would not be the master's cast).
    """
    T = cfg.total_ut_steps
    scfg.validate(T)
    held = jnp.dtype(params["layers"]["q_proj"].dtype)
    if held != jnp.float32 and (held != jnp.dtype(scfg.compute_dtype)
                                or master_fingerprint is None):
        found = jnp.dtype(scfg.compute_dtype).name
        raise SamplingError(f"parameters held in {held.name}: sampling from them needs "
                            f"compute_dtype {held.name} (found {found}) and master_fingerprint, "
                            f"the fp32 master's (ComputeWeights)")
    if forced is not None:
        fb = forced.to_numpy()
        sched = fb.schedule
        tokens = np.where(np.arange(sched.seq_len)[None] < sched.prompt_len, fb.tokens_BxS, 0)
        tokens = tokens.astype(np.int32)
        pad, P, S = fb.pad_B.astype(np.int32), sched.prompt_len, sched.seq_len
        prompt_index, sample_index = fb.prompt_index_B, fb.sample_index_B
        seed, step = sched.seed, sched.step
        frows = (jnp.asarray(fb.tokens_BxS, jnp.int32), jnp.asarray(fb.exit_loop_BxS, jnp.int32),
                 jnp.asarray(fb.flush_BxS, bool))
        scfg = dataclasses.replace(scfg, noise_keying=sched.noise_keying)  # tokens are forced
        budget = sched.thinking_budget  # recorded, not drawn: the tokens are forced
    else:
        G = group_size
        idx = list(range(len(prompts))) if prompt_indices is None else list(prompt_indices)
        rows_prompts = [pr for pr in prompts for _ in range(G)]
        tokens, pad, P, S = layout_prompts(rows_prompts, scfg.max_new_tokens, scfg.max_seq_len,
                                           scfg.prompt_len_multiple)
        prompt_index = np.repeat(np.asarray(idx, np.int32), G)
        sample_index = np.tile(np.arange(G, dtype=np.int32), len(prompts))
        frows = (None, None, None)
        budget = (None if scfg.thinking_budget is None else
                  thinking.draw_budget(seed, step, *scfg.thinking_budget))
    for pr in prompts:
        bad = [t for t in pr if not (0 <= t < cfg.vocab_size)]
        if bad:
            raise SamplingError(f"prompt token ids {bad[:5]} outside the vocabulary "
                                f"[0, {cfg.vocab_size})")
    policy = policy_named(scfg.kv_policy)
    if forced is not None and policy.pending:  # the recorded window
        rec = sched.deferred_max_pending
        if scfg.deferred_max_pending not in (None, rec):
            raise SamplingError(f"forced re-run with deferred_max_pending "
                                f"{scfg.deferred_max_pending}, but the rollout was sampled with "
                                f"{rec}")
        scfg = dataclasses.replace(scfg, deferred_max_pending=rec)
    local_rows = -(-tokens.shape[0] // (mesh.size if mesh is not None else 1))
    if scfg.deferred_max_pending is None:  # resolved here, recorded in the schedule
        scfg = dataclasses.replace(scfg, deferred_max_pending=auto_max_pending(local_rows))
    menu = row_menu(local_rows) if scfg.row_compaction else ()
    C = min(policy.chunk_size(scfg.deferred_max_pending), S)
    widths = policy.window_widths(C, local_rows)
    if forced is not None and sched.row_menu and sched.row_menu[-1] == local_rows:
        menu = tuple(sched.row_menu)  # the recorded compaction, on the recorded rows per device
        recorded = tuple(sorted({min(W, C) for W in sched.window_widths}))
        if recorded[:1] == (1,) and recorded[-1:] == (C,):  # (another policy's: not used)
            widths = recorded
    st = Static(cfg, scfg, int(P), int(S), int(seed), forced is not None, menu, widths)
    rows = RowInfo(jnp.asarray(pad), jnp.asarray(prompt_index, jnp.int32),
                   jnp.asarray(sample_index, jnp.int32), *frows,
                   None if budget is None else jnp.full((len(pad),), budget, jnp.int32))
    if not all(isinstance(x, jax.Array) for x in jax.tree.leaves(params)):
        params = jax.device_put(params)  # once per call; callers should pass device arrays
    step_arr = jnp.int32(step)
    prefill, decode, fetch = _prefill, _decode, np.asarray
    B = tokens.shape[0]
    tokens_in = jnp.asarray(tokens)
    if mesh is not None and mesh.size > 1:
        prefill, decode, fetch, tokens_in, rows, step_arr = _on_mesh(mesh, tokens, rows, step)
    t0 = time.perf_counter()
    s = prefill(st, params, tokens_in, rows, step_arr)
    if timings is not None:
        jax.block_until_ready(s)
        t1 = time.perf_counter()
        timings["prefill_s"] = t1 - t0
    n_total = S - 1 - P
    per_call = decode_steps_per_call or max(n_total, 1)
    done_steps = 0
    while done_steps < n_total:
        s = decode(st, params, s, rows, step_arr, per_call)
        done_steps = int(jnp.max(s.p)) - P  # on a mesh: the furthest device (module doc)
        if progress is not None:
            progress(done_steps + 1, n_total + 1)
        if bool(jnp.all(s.done_B)):
            break
    if timings is not None:
        jax.block_until_ready(s)
        timings["decode_s"] = time.perf_counter() - t1
        timings["decode_steps"] = done_steps
        timings["kv_cache_bytes"] = kv_cache_bytes(cfg, B, S, scfg.compute_dtype)
    sched = Schedule(
        kv_policy=scfg.kv_policy,
        exit_threshold=None if scfg.fixed_depth is not None else float(scfg.exit_threshold),
        fixed_depth=scfg.fixed_depth, deferred_max_pending=scfg.deferred_max_pending,
        chunk_size=policy.chunk_size(scfg.deferred_max_pending),
        prompt_len=int(P), seq_len=int(S), batch_size=int(tokens.shape[0]),
        total_ut_steps=T, compute_dtype=scfg.compute_dtype, temperature=float(scfg.temperature),
        top_k=int(scfg.top_k), top_p=float(scfg.top_p), seed=int(seed), step=int(step),
        params_fingerprint=master_fingerprint or params_fingerprint(params),
        devices=1 if mesh is None else int(mesh.size),
        backend=jax.default_backend(), stop_ids=tuple(scfg.stop_ids),
        row_tile=row_tile() if scfg.kernels == "invariant" else 1, kernels=scfg.kernels,
        mesh=_mesh_record(mesh, params), noise_keying=scfg.noise_keying,
        kernel_version=kernel_version(), row_menu=menu,
        window_widths=widths if menu else (), **_thinking_record(scfg, budget))
    forced_BxS = None
    if forced is not None:
        forced_BxS = fb.forced_BxS
    elif budget is not None:
        forced_BxS = fetch(s.forced_BxS)[:B]
    return RolloutBatch(
        tokens_BxS=fetch(s.tokens_BxS)[:B], pad_B=np.asarray(pad),
        exit_loop_BxS=fetch(s.exit_loop_BxS)[:B], logprob_BxS=fetch(s.logprob_BxS)[:B],
        logprob_processed_BxS=fetch(s.logprob_processed_BxS)[:B],
        flush_BxS=fetch(s.flush_BxS)[:B], prompt_index_B=np.asarray(prompt_index, np.int32),
        sample_index_B=np.asarray(sample_index, np.int32),
        completion_len_B=fetch(s.completion_len_B)[:B], schedule=sched,
        loop_rows=fetch(s.loop_rows_1xSxTxW) if menu else None, forced_BxS=forced_BxS)


def _thinking_record(scfg: SamplingConfig, budget: int | None) -> dict:
    """The schedule's thinking-budget fields: the budget this rollout used (None: off)."""
    if budget is None:
        return {}
    return dict(thinking_budget=int(budget), answer_budget=int(scfg.answer_budget),
                forced_answer_ids=tuple(scfg.forced_answer_ids),
                think_close_ids=tuple(scfg.think_close_ids))


@functools.partial(jax.jit, static_argnums=(0,))
def _prefill(st: Static, params, tokens_BxS, rows: RowInfo, step):
    cfg = st.cfg
    w = cast_weights(params, st.scfg.compute_dtype, layers=stacks_cast_once())
    B = tokens_BxS.shape[0]
    T, L, Hkv, K = cfg.total_ut_steps, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    dt = w["embed_tokens"].dtype
    cache = jnp.zeros((T, L, B, st.S, Hkv, K), dt)
    s = DecodeState(
        tokens_BxS=tokens_BxS, h_BxSxD=embed(w, tokens_BxS), depth_BxS=jnp.zeros((B, st.S),
                                                                                 jnp.int32),
        k_cache=cache, v_cache=cache, exit_loop_BxS=jnp.zeros((B, st.S), jnp.int32),
        logprob_BxS=jnp.zeros((B, st.S), jnp.float32),
        logprob_processed_BxS=jnp.zeros((B, st.S), jnp.float32),
        flush_BxS=jnp.zeros((B, st.S), bool), done_B=jnp.zeros((B,), bool),
        completion_len_B=jnp.zeros((B,), jnp.int32),
        loop_rows_1xSxTxW=jnp.zeros((1, st.S, T, len(st.window_widths)), jnp.int32),
        p=jnp.int32(st.P),
        **(thinking.init_state(B, st.S) if _thinking(st) else {}))
    ones = jnp.ones((B,), bool)
    return run_chunk(st, w, s, rows, step, w0=0, C=st.P, emit_p=st.P - 1,
                     eligible_C=jnp.ones((st.P,), bool), force_full_B=ones, running_B=ones)


@functools.partial(jax.jit, static_argnums=(0, 5), donate_argnums=(2,))
def _decode(st: Static, params, s: DecodeState, rows: RowInfo, step, n_steps: int):
    """Run up to `n_steps` decode steps (fewer when every row is done or the cache is full)."""
    cfg, scfg = st.cfg, st.scfg
    T = cfg.total_ut_steps
    w = cast_weights(params, scfg.compute_dtype, layers=stacks_cast_once())
    policy = policy_named(scfg.kv_policy)
    C = min(policy.chunk_size(scfg.deferred_max_pending), st.S)

    def one_step(carry):
        s, i = carry
        p = s.p
        w0 = jnp.maximum(p - C + 1, 0)
        layout_C = w0 + jnp.arange(C)
        h_p = embed(w, jax.lax.dynamic_index_in_dim(s.tokens_BxS, p, 1, True))
        s = s._replace(h_BxSxD=jax.lax.dynamic_update_slice_in_dim(s.h_BxSxD, h_p, p, 1),
                       depth_BxS=jax.lax.dynamic_update_index_in_dim(
                           s.depth_BxS, jnp.zeros_like(s.done_B, jnp.int32), p, 1))
        live_B = ~s.done_B
        s, full_B = policy.step_start(s, p, live_B, rows.forced_flush_BxS if st.forced else None,
                                      prompt_len=st.P, T=T, chunk=C)
        eligible = (layout_C <= p) & ((layout_C >= st.P) | (layout_C == p))
        s = run_chunk(st, w, s, rows, step, w0=w0, C=C, emit_p=p, eligible_C=eligible,
                      force_full_B=full_B, running_B=live_B, peel_first_loop=True,
                      compact_rows=True)
        s = policy.step_end(s, p, live_B, T)
        return s._replace(p=p + 1), i + 1

    def cond(carry):
        s, i = carry
        return (i < n_steps) & (s.p < st.S - 1) & jnp.any(~s.done_B)

    s, _ = jax.lax.while_loop(cond, one_step, (s, jnp.int32(0)))
    return s


def _thinking(st: Static) -> bool:
    """Whether the programs run the thinking budget (forced re-runs take recorded tokens)."""
    return st.scfg.thinking_budget is not None and not st.forced


# --- on a mesh: the same programs, one per device on its rows ----------------------------------

def _mesh_record(mesh, params):
    return mesh_record(mesh if mesh is not None and mesh.size > 1 else None, params)


def _state_specs(st: Static):
    row, kv = PS(ROW_AXES), PS(None, None, ROW_AXES)  # the caches are [T, L, B, S, Hkv, K]
    extra = (row, row, row) if _thinking(st) else ()
    return DecodeState(row, row, row, kv, kv, row, row, row, row, row, row, row, row, *extra)


@functools.lru_cache(maxsize=32)
def _mesh_prefill(st: Static, mesh):
    def body(params, tokens_BxS, rows, step):
        s = _prefill(st, params, tokens_BxS, rows, step)
        return s._replace(p=s.p[None])  # each device's position: p is [devices] on the mesh
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(PS(), PS(ROW_AXES), PS(ROW_AXES),
                                                             PS()),
                                 out_specs=_state_specs(st), check_vma=False))


@functools.lru_cache(maxsize=32)
def _mesh_decode(st: Static, mesh, n_steps: int):
    def body(params, s, rows, step):
        s = _decode(st, params, s._replace(p=s.p[0]), rows, step, n_steps)
        return s._replace(p=s.p[None])
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(PS(), _state_specs(st), PS(ROW_AXES),
                                                             PS()),
                                 out_specs=_state_specs(st), check_vma=False), donate_argnums=(1,))


def _on_mesh(mesh, tokens, rows: RowInfo, step: int):
    """Place a rollout on `mesh`: rows padded (copies of row 0) to a multiple of the row shards
    and split; returns (prefill, decode, fetch, tokens, rows, step) for `generate`'s loop.

    Each device's decode loop stops when its own rows are done, so `p` differs per device;
    devices still running advance together, hence `generate` counts steps by the largest p."""
    n = ml.padded_rows(tokens.shape[0], mesh)
    put = lambda a: ml.put_global(ml.pad_rows(np.asarray(a), n, fill="first"),  # noqa: E731
                                  ml.row_sharding(mesh, np.ndim(a)))
    rows = RowInfo(*(None if a is None else put(a) for a in rows))
    step_arr = ml.put_global(np.int32(step), ml.replicated(mesh))

    def prefill(st, params, tokens_BxS, rows, step):
        return _mesh_prefill(st, mesh)(params, tokens_BxS, rows, step)

    def decode(st, params, s, rows, step, n_steps):
        return _mesh_decode(st, mesh, n_steps)(params, s, rows, step)
    return prefill, decode, ml.to_host, put(tokens), rows, step_arr
