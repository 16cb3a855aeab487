"""Per-loop row compaction (issue 18): a loop runs only the rows that need it, in a sub-batch
whose size comes from `policies.row_menu`, and no bit of the rollout changes.

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
from looprl.sampling.policies import row_menu
from looprl.sampling.sampler import SamplingConfig, generate
from looprl.sampling.schedule import RolloutBatch

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
    assert b.loop_rows is None and a.loop_rows.shape == (1, a.schedule.seq_len, T, 2)


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
    assert not lr[..., 1].any()  # no deferred windows
    for p in range(P, S - 1):
        for d in range(1, T + 1):
            n = int(np.sum(exits[:, p] >= d)) if policy == "copy" else len(exits)
            want = 0 if n == 0 else int(menu[np.searchsorted(menu, n)])
            assert lr[p, d - 1, 0] == want, (p, d, n)
    if policy == "copy":
        assert lr[P:S - 1, T - 1, 0].sum() < 24 * (S - 1 - P)


def test_deferred_runs_rows_without_pending_work_on_their_own_position(rollouts):
    """Under deferred, loop 1 runs every row alone (class 0, 24 rows); at deeper loops some
    rows run their whole window (class 1) and others only their current position, and no loop
    runs more rows than the batch."""
    a, _ = rollouts["deferred", "float32"]
    P, S = a.schedule.prompt_len, a.schedule.seq_len
    lr = a.loop_rows[0, P:S - 1]
    assert (lr[:, 0, 0] == 24).all() and not lr[:, 0, 1].any()
    assert lr[:, 1:, 1].sum() > 0 and lr[:, 1:, 0].sum() > 0
    assert set(np.unique(lr)) <= {0, 16, 24}


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.slow)])
@pytest.mark.parametrize("policy", ["deferred", "copy"])
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


def test_version_2_round_trip_and_version_1_files_still_load(rollouts, tmp_path):
    a, _ = rollouts["deferred", "float32"]
    a.save(tmp_path / "v2.npz")
    back = RolloutBatch.load(tmp_path / "v2.npz")
    assert back.schedule == a.schedule and np.array_equal(back.loop_rows, a.loop_rows)
    with np.load(tmp_path / "v2.npz") as z:  # the same rollout as a version-1 writer wrote it
        data = {k: z[k] for k in z.files if k != "loop_rows"}
    meta = json.loads(str(data["meta"]))
    meta["format_version"] = 1
    del meta["schedule"]["row_menu"]
    data["meta"] = np.asarray(json.dumps(meta))
    np.savez(tmp_path / "v1.npz", **data)
    old = RolloutBatch.load(tmp_path / "v1.npz")
    assert old.schedule.row_menu == () and old.loop_rows is None
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


@pytest.mark.parametrize("policy, passes", [("dense", 1), ("deferred", 2)])
def test_decode_program_holds_one_layer_stack_per_pass_and_menu_size(policy, passes):
    """The decode program compiles the layer stack (`lax.scan` over the L layers) once per
    compaction pass and menu size: `dense` runs loop d on the current position only (one pass),
    `deferred` the current position alone and the pending windows (two passes); loop 1 needs
    no peeled copy of its own (a third deferred pass until 2026-12-02: 24 -> 14 s of compile at
    40 rows). Traced only, nothing compiled."""
    cfg = dataclasses.replace(CFG, num_layers=3)  # no other scan in the program is 3 long
    p = jax.eval_shape(lambda: init_params(cfg, 0))
    sc = _scfg(policy, "float32")
    tokens, pad, P, S = sm.layout_prompts([pr for pr in PROMPTS for _ in range(G)],
                                          sc.max_new_tokens, None, sc.prompt_len_multiple)
    st = sm._Static(cfg, sc, P, S, 5, False, row_menu(24))
    rows = sm.RowInfo(jnp.asarray(pad), jnp.zeros((24,), jnp.int32), jnp.zeros((24,), jnp.int32),
                      None, None, None)
    s = jax.eval_shape(lambda p: sm._prefill(st, p, jnp.asarray(tokens), rows, jnp.int32(0)), p)
    jaxpr = jax.make_jaxpr(lambda p, s: sm._decode(st, p, s, rows, jnp.int32(0), 4))(p, s)
    assert _scans_of_length(jaxpr.jaxpr, 3) == passes * len(row_menu(24))
