"""Per-loop row compaction: a loop runs only the rows that need it, in a sub-batch whose size
comes from `compaction.row_menu`, and no bit of the rollout changes.

The model exits early often (gate bias -0.3, q = 0.5), rows differ in prompt length, stop ids
are off so every row decodes every step, and the deferred window is short (max_pending 3), so
flushes, pending windows and the width-1 group all occur."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from looprl.model.config import preset
from looprl.model.looped import init_params
from looprl.sampling import sampler as sm
from looprl.sampling.compaction import row_menu, window_block_rows
from looprl.sampling.kv_policies import POLICIES
from looprl.sampling.sampler import SamplingConfig, generate
from looprl.sampling.schedule import RolloutBatch
from looprl.sampling.state import RowInfo, Static

CFG = preset("tiny", vocab_size=32, hidden_size=64, intermediate_size=128, num_heads=2,
             num_kv_heads=1, head_dim=32)
T = CFG.total_ut_steps
PROMPTS = [[5, 9, 3, 7, 11], [4, 6], [8, 12, 13, 14, 15, 16, 17], [20], [1, 2, 3],
           [30, 29, 28, 27], [7], [9, 9]]
G = 3  # 24 rows: menu (16, 24): a gathered sub-batch of 16 and the whole batch in place
ARRAYS = ("tokens_BxS", "exit_loop_BxS", "logprob_BxS", "logprob_processed_BxS", "flush_BxS",
          "completion_len_B")


@pytest.fixture(scope="module")
def params():
    p = init_params(CFG, 1)
    p["early_exit_gate"]["bias"] = jnp.array([-0.3])
    return jax.device_put(jax.tree.map(np.asarray, p))


def _scfg(policy, dtype):
    return SamplingConfig(max_new_tokens=10, temperature=1.0, exit_threshold=0.5,
                          kv_policy=policy, compute_dtype=dtype, stop_ids=(),
                          deferred_max_pending=3)


def _raw(x):
    a = np.asarray(x)
    return a.view(np.uint8) if a.dtype != bool else a


def test_row_menu_sizes():
    assert row_menu(1) == (1,)
    assert row_menu(16) == (16,)
    assert row_menu(17) == (16, 17)
    assert row_menu(24) == (16, 24)
    assert row_menu(100) == (16, 24, 32, 48, 64, 96, 100)
    assert row_menu(256) == (16, 24, 32, 48, 64, 96, 128, 192, 256)


def test_window_widths():
    window_widths = POLICIES["deferred"].window_widths
    assert window_widths(1, 256) == (1,)  # a chunk of one: max_pending 0
    assert POLICIES["dense"].window_widths(1, 256) == POLICIES["copy"].window_widths(1, 256) == (1,)
    assert window_widths(8, 16) == (1, 8)  # one menu size: the position alone or the window
    assert window_widths(4, 24) == (1, 2, 4)
    assert window_widths(5, 256) == (1, 2, 4, 5)
    assert window_widths(8, 256) == (1, 2, 4, 8)
    assert window_widths(2, 17) == (1, 2)


def test_window_block_rows():
    """A window pass runs blocks of 64 positions, then blocks of 16 for the rows left over."""
    assert window_block_rows(2) == (32, 8)
    assert window_block_rows(5) == (12, 3)
    assert window_block_rows(8) == (8, 2)
    assert window_block_rows(32) == (2, 1)
    assert window_block_rows(64) == (1, 1)


class _Rollouts(dict):
    """(policy, dtype) -> (compacted, uncompacted) rollouts of the same prompts and seed,
    sampled the first time a test asks (the bf16 cases run under `-m slow`)."""

    def __init__(self, params):
        super().__init__()
        self.params = params

    def __missing__(self, key):
        policy, dtype = key
        sc = _scfg(policy, dtype)
        self[key] = (generate(CFG, self.params, PROMPTS, sc, group_size=G, seed=5),
                     generate(CFG, self.params, PROMPTS,
                              dataclasses.replace(sc, row_compaction=False), group_size=G,
                              seed=5))
        return self[key]


@pytest.fixture(scope="module")
def rollouts(params):
    return _Rollouts(params)


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.slow)])
@pytest.mark.parametrize("policy", ["dense", "deferred", "copy"])
def test_compacted_rollout_equals_the_uncompacted_one_bit_for_bit(rollouts, policy, dtype):
    a, b = rollouts[policy, dtype]
    for k in ARRAYS:
        assert np.array_equal(_raw(getattr(a, k)), _raw(getattr(b, k))), k
    assert a.schedule.row_menu == (16, 24) and b.schedule.row_menu == ()
    widths = (1, 2, 4) if policy == "deferred" else (1,)
    assert a.schedule.window_widths == widths and b.schedule.window_widths == ()
    assert b.loop_rows is None and a.loop_rows.shape == (1, a.schedule.seq_len, T, len(widths))


def _deferred_policy(rb, exits, widths, flush=None):
    """The deferred policy's definition (`kv_policies.Deferred`) replayed in numpy on `rb`'s
    layout, for exit loops `exits` `[B, S]`: at step p a row flushes when C - 1 completion
    positions are pending (or as `flush` says, when given); loop d runs a row iff it has not
    yet exited (flushed rows: up to T); its positions needing loop d are those in its window
    [p - C + 1, p] (completion positions, and p) with d - 1 loops computed, and it belongs to
    the pass of the narrowest of `widths` covering them.
    Returns (flushes `[B, S]` bool, rows per pass `[S, T, len(widths)]`)."""
    P, S, C = rb.schedule.prompt_len, rb.schedule.seq_len, rb.schedule.chunk_size
    flushed = np.zeros(exits.shape, bool)
    counts = np.zeros((S, T, len(widths)), int)
    for b in range(exits.shape[0]):
        depth = np.full(S, T)
        for p in range(P, S - 1):
            depth[p] = 0
            flushed[b, p] = (np.sum(depth[P:p] < T) >= C - 1 if flush is None
                             else flush[b, p])
            for d in range(1, (T if flushed[b, p] else exits[b, p]) + 1):
                lo = max(p - C + 1, 0)
                act = [j for j in range(lo, p + 1) if (j >= P or j == p) and depth[j] == d - 1]
                need = p + 1 - min(act)
                counts[p, d - 1, int(np.searchsorted(widths, need))] += 1
                depth[act] = d
    return flushed, counts


def _with_exits(rb, seed: int):
    """`rb` (a deferred rollout) with random exit loops 1..T at its emitting positions and the
    flushes the policy then takes: a schedule whose rows need their windows at different steps
    and loops, for forced re-runs (the random tiny model exits every row at the same loop)."""
    exits = np.where(rb.exit_loop_BxS > 0, np.random.default_rng(seed).integers(
        1, T + 1, rb.exit_loop_BxS.shape), 0).astype(np.int32)
    flush, _ = _deferred_policy(rb, exits, (rb.schedule.chunk_size,))
    return dataclasses.replace(rb, exit_loop_BxS=exits, flush_BxS=flush)


@pytest.mark.parametrize("rows", [4, pytest.param(24, marks=pytest.mark.slow)])
def test_deferred_windows_run_every_row_that_needs_them(params, rollouts, rows):
    """Forced re-runs of a schedule with mixed exit loops, compacted and not, agree bit for
    bit, and their windows run every row that needs them: at 4 rows (one menu size, widths
    (1, 4), full and tail blocks alike of 4 rows: a tail of 1-3 rows once went unrun) and at
    24 (widths (1, 2, 4))."""
    sc = _scfg("deferred", "float32")
    mixed = _with_exits(rollouts["deferred", "float32"][0].select(np.arange(rows)), rows)
    a = generate(CFG, params, [], sc, forced=mixed)
    b = generate(CFG, params, [], dataclasses.replace(sc, row_compaction=False),
                 forced=dataclasses.replace(mixed, schedule=dataclasses.replace(
                     mixed.schedule, row_menu=(), window_widths=())))  # (else: the recorded)
    assert b.loop_rows is None
    assert np.array_equal(a.exit_loop_BxS, mixed.exit_loop_BxS)
    for k in ARRAYS:
        assert np.array_equal(_raw(getattr(a, k)), _raw(getattr(b, k))), k
    want = _deferred_passes(a, a.schedule.window_widths)
    assert ((want[..., 1:] > 0) & (want[..., 1:] < rows)).any()  # windows of some rows only
    assert want[..., 1:].sum() > 0


@pytest.mark.parametrize("policy", ["dense", "copy"])
def test_recorded_sizes_are_the_smallest_menu_size_holding_the_running_rows(rollouts, policy):
    """dense runs every live row through all T loops; copy runs a row through loop d iff its
    token exits at d or later: the recorded size at (p, d) is the smallest menu size >= that
    count. The first loops run all 24 rows; deeper loops of copy run fewer."""
    a, _ = rollouts[policy, "float32"]
    menu = np.asarray(a.schedule.row_menu)
    P, S = a.schedule.prompt_len, a.schedule.seq_len
    exits = np.asarray(a.exit_loop_BxS)
    lr = a.loop_rows[0]
    assert lr.shape[-1] == 1  # one pass per loop: the current position
    for p in range(P, S - 1):
        for d in range(1, T + 1):
            n = int(np.sum(exits[:, p] >= d)) if policy == "copy" else len(exits)
            want = 0 if n == 0 else int(menu[np.searchsorted(menu, n)])
            assert lr[p, d - 1, 0] == want, (p, d, n)
    if policy == "copy":
        assert lr[P:S - 1, T - 1, 0].sum() < 24 * (S - 1 - P)


def _deferred_passes(rb, widths):
    """The rows each deferred decode loop's passes must run, rebuilt from the recorded exits
    and flushes by the policy's definition (`_deferred_policy`). Returns `[S, T,
    len(widths)]` row counts."""
    return _deferred_policy(rb, np.asarray(rb.exit_loop_BxS), widths,
                            np.asarray(rb.flush_BxS))[1]


def test_deferred_rows_run_in_the_narrowest_window_holding_their_pending_positions(rollouts):
    """Under deferred (window of C = 4), each loop's rows run in passes of width 1 (the
    current position alone), 2 or 4: the recorded rows of every pass are those the policy's
    definition puts in it, as the pass runs them: width 1 the smallest row-menu size holding
    them, a window in blocks (`window_block_rows`, at most the 24 rows: 24 then 8 rows for
    width 2, 16 then 4 for width 4). Loop 1 runs every row alone, the
    narrower windows are used, and the work (rows x width) is below what the two passes of
    format version 2 (widths 1 and C) would have run."""
    a, _ = rollouts["deferred", "float32"]
    P, S = a.schedule.prompt_len, a.schedule.seq_len
    widths = a.schedule.window_widths
    want = _deferred_passes(a, widths)
    menu = np.asarray(a.schedule.row_menu)
    n = want[..., 0]
    assert np.array_equal(a.loop_rows[0, ..., 0],
                          np.where(n == 0, 0, menu[np.searchsorted(menu, n)]))
    for i, W in enumerate(widths[1:], 1):
        R, R_tail = (min(r, 24) for r in window_block_rows(W))
        n = want[..., i]
        full = n // R
        tail = -(-(n - full * R) // R_tail)
        assert np.array_equal(a.loop_rows[0, ..., i], full * R + tail * R_tail), W
    lr = a.loop_rows[0, P:S - 1]
    assert (lr[:, 0, 0] == 24).all() and not lr[:, 0, 1:].any()
    assert want[..., 1].sum() > 0 and want[..., 2].sum() > 0  # both windows occur
    v2 = want[..., 0].sum() + 4 * want[..., 1:].sum()
    assert (want * np.asarray(widths)).sum() < v2


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.slow)])
@pytest.mark.parametrize("policy", ["deferred", pytest.param("copy", marks=pytest.mark.slow)])
def test_forced_rerun_reproduces_the_compaction(params, rollouts, policy, dtype):
    a, _ = rollouts[policy, dtype]
    f = generate(CFG, params, [], _scfg(policy, dtype), forced=a)
    assert f.schedule.row_menu == a.schedule.row_menu
    assert np.array_equal(f.loop_rows, a.loop_rows)
    assert np.array_equal(_raw(f.logprob_BxS), _raw(a.logprob_BxS))


def test_forced_rerun_on_other_rows_per_device_uses_their_menu(params, rollouts):
    """A rollout sampled with 4 rows per device (menu (4,)) re-run in forced mode on one device
    holding all 24 rows: the menu must be the 24 rows' (a menu not ending at the rows per device
    would leave rows uncomputed), and the bits are the sampler's."""
    a, _ = rollouts["deferred", "float32"]
    as_if_sharded = dataclasses.replace(a, schedule=dataclasses.replace(a.schedule,
                                                                        row_menu=(4,)))
    f = generate(CFG, params, [], _scfg("deferred", "float32"), forced=as_if_sharded)
    assert f.schedule.row_menu == (16, 24)
    assert np.array_equal(_raw(f.logprob_BxS), _raw(a.logprob_BxS))


def test_version_3_round_trip_and_version_2_and_1_files_still_load(params, rollouts, tmp_path):
    a, _ = rollouts["deferred", "float32"]
    a.save(tmp_path / "v3.npz")
    back = RolloutBatch.load(tmp_path / "v3.npz")
    assert back.schedule == a.schedule and np.array_equal(back.loop_rows, a.loop_rows)
    # a version-2 file: two passes per loop, the current position alone and the whole window
    # of 4; its forced re-run takes those widths from the file and reproduces its compaction
    sc = _scfg("deferred", "float32")
    two = generate(CFG, params, [], sc, forced=dataclasses.replace(
        a, schedule=dataclasses.replace(a.schedule, window_widths=(1, 4))))
    assert two.loop_rows.shape[-1] == 2 and two.loop_rows[..., 1].sum() > 0
    assert np.array_equal(_raw(two.logprob_BxS), _raw(a.logprob_BxS))
    two.save(tmp_path / "v2.npz")
    with np.load(tmp_path / "v2.npz") as z:
        data = {k: z[k] for k in z.files}
    meta = json.loads(str(data["meta"]))
    meta["format_version"] = 2
    del meta["schedule"]["window_widths"]
    data["meta"] = np.asarray(json.dumps(meta))
    np.savez(tmp_path / "v2.npz", **data)
    old2 = RolloutBatch.load(tmp_path / "v2.npz")
    assert old2.schedule.window_widths == (1, 4)
    again = generate(CFG, params, [], sc, forced=old2)
    assert np.array_equal(again.loop_rows, two.loop_rows)
    assert np.array_equal(_raw(again.logprob_BxS), _raw(a.logprob_BxS))
    with np.load(tmp_path / "v3.npz") as z:  # the same rollout as a version-1 writer wrote it
        data = {k: z[k] for k in z.files if k != "loop_rows"}
    meta = json.loads(str(data["meta"]))
    meta["format_version"] = 1
    del meta["schedule"]["row_menu"], meta["schedule"]["window_widths"]
    data["meta"] = np.asarray(json.dumps(meta))
    np.savez(tmp_path / "v1.npz", **data)
    old = RolloutBatch.load(tmp_path / "v1.npz")
    assert old.schedule.row_menu == () and old.schedule.window_widths == ()
    assert old.loop_rows is None
    assert np.array_equal(_raw(old.logprob_BxS), _raw(a.logprob_BxS))


def _scans_of_length(jaxpr, n: int) -> int:
    """`scan` equations of length n in a jaxpr and every jaxpr nested in it."""
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive.name == "scan" and eqn.params["length"] == n
        for v in eqn.params.values():
            for sub in v if isinstance(v, (tuple, list)) else (v,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    count += _scans_of_length(inner, n)
    return count


@pytest.mark.parametrize("policy, widths", [("dense", (1,)), ("deferred", (1, 2, 4))])
def test_decode_program_holds_one_layer_stack_per_pass_and_menu_size(policy, widths):
    """The decode program compiles the layer stack (`lax.scan` over the L layers) once per
    compaction pass and menu size: `dense` runs loop d on the current position only (one pass),
    `deferred` one pass per window width: the current position alone (a copy per menu size),
    windows of 2 and 4 (each a loop of full blocks and one of tail blocks: two copies);
    loop 1 needs no peeled copy of its own. Traced only, nothing compiled."""
    cfg = dataclasses.replace(CFG, num_layers=3)  # no other scan in the program is 3 long
    p = jax.eval_shape(lambda: init_params(cfg, 0))
    sc = _scfg(policy, "float32")
    tokens, pad, P, S = sm.layout_prompts([pr for pr in PROMPTS for _ in range(G)],
                                          sc.max_new_tokens, None, sc.prompt_len_multiple)
    st = Static(cfg, sc, P, S, 5, False, row_menu(24), widths)
    rows = RowInfo(jnp.asarray(pad), jnp.zeros((24,), jnp.int32), jnp.zeros((24,), jnp.int32),
                   None, None, None)
    s = jax.eval_shape(lambda p: sm._prefill(st, p, jnp.asarray(tokens), rows, jnp.int32(0)), p)
    jaxpr = jax.make_jaxpr(lambda p, s: sm._decode(st, p, s, rows, jnp.int32(0), 4))(p, s)
    assert _scans_of_length(jaxpr.jaxpr, 3) == (2 if policy == "dense" else 2 + 2 + 2)
