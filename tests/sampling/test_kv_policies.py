"""The KV policy objects (`looprl.sampling.kv_policies`): the registry is the config's option
list, and each policy's chunk, flush rule, copy and learner K/V, checked on hand-built states."""
import re
import typing
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from looprl.config import KVPolicy
from looprl.errors import SamplingError
from looprl.sampling.kv_policies import KV_POLICIES, POLICIES, policy_named
from looprl.sampling.state import DecodeState

ROOT = Path(__file__).resolve().parents[2] / "looprl"


def test_registry_holds_the_config_names_in_order():
    assert tuple(POLICIES) == KV_POLICIES == typing.get_args(KVPolicy)
    assert all(POLICIES[n].name == n for n in KV_POLICIES)


def test_unknown_name_is_a_sampling_error_naming_the_choices():
    with pytest.raises(SamplingError, match=r"'sparse'.*'dense', 'deferred', 'copy'"):
        policy_named("sparse")


def test_no_policy_name_is_compared_outside_the_registry():
    """Callers ask the policy object; a `kv_policy == "..."` compare elsewhere is a rule that
    went around it."""
    compare = re.compile(r"""kv_policy\s*(==|!=|\bin\b)|(==|!=)\s*["'](dense|deferred|copy)["']""")
    found = [f"{p.relative_to(ROOT.parent)}:{i}" for p in sorted(ROOT.rglob("*.py"))
             if p.name != "kv_policies.py"
             for i, line in enumerate(p.read_text().splitlines(), 1) if compare.search(line)
             and "method" not in line]  # (`method == "dense"` names a log-prob method)
    assert not found


def test_chunk_sizes():
    assert [POLICIES[n].chunk_size(5) for n in KV_POLICIES] == [1, 6, 1]
    assert POLICIES["deferred"].chunk_size(0) == 1  # max_pending 0: dense's execution


def test_learner_reads_every_loop_own_kv_except_under_copy():
    depth = np.array([[4, 2, 1]], np.int32)
    assert POLICIES["dense"].learner_kv_depth(depth) is None
    assert POLICIES["deferred"].learner_kv_depth(depth) is None
    assert POLICIES["copy"].learner_kv_depth(depth) is depth


def _state(depth_BxS, exit_loop_BxS=None, cache=None):
    B, S = depth_BxS.shape
    z = jnp.zeros((B, S), jnp.int32)
    return DecodeState(tokens_BxS=z, h_BxSxD=None, depth_BxS=jnp.asarray(depth_BxS, jnp.int32),
                       k_cache=cache, v_cache=None if cache is None else -cache,
                       exit_loop_BxS=z if exit_loop_BxS is None else jnp.asarray(exit_loop_BxS),
                       logprob_BxS=None, logprob_processed_BxS=None,
                       flush_BxS=jnp.zeros((B, S), bool), done_B=jnp.zeros((B,), bool),
                       completion_len_B=None, loop_rows_1xSxTxW=None, p=None)


def test_deferred_flushes_rows_with_a_full_window_and_records_it():
    """P = 2, T = 3, step p = 5, chunk 3: row 0 has positions 3 and 4 pending (2 >= chunk - 1:
    flushed), row 1 none, row 2 two but is done (not live: not flushed)."""
    depth = np.array([[3, 3, 3, 1, 2, 0], [3, 3, 3, 3, 3, 0], [3, 3, 1, 1, 1, 0]])
    live = jnp.array([True, True, False])
    s, full = POLICIES["deferred"].step_start(_state(depth), 5, live, None, prompt_len=2, T=3,
                                              chunk=3)
    assert full.tolist() == [True, False, False]
    assert np.asarray(s.flush_BxS).tolist() == [[False] * 5 + [f] for f in (True, False, False)]


def test_deferred_forced_takes_the_recorded_flushes():
    depth = np.zeros((2, 4), np.int32)
    forced = jnp.array([[0, 0, 1, 0], [0, 0, 1, 0]], bool)
    s, full = POLICIES["deferred"].step_start(_state(depth), 2, jnp.array([True, False]), forced,
                                              prompt_len=1, T=3, chunk=2)
    assert full.tolist() == [True, False]
    assert np.asarray(s.flush_BxS)[:, 2].tolist() == [True, False]


def test_dense_runs_every_live_row_to_T_and_copy_none():
    live = jnp.array([True, False])
    s = _state(np.zeros((2, 3), np.int32))
    for name, want in (("dense", [True, False]), ("copy", [False, False])):
        s2, full = POLICIES[name].step_start(s, 1, live, None, prompt_len=1, T=2, chunk=1)
        assert full.tolist() == want and s2 is s


def test_copy_fills_the_exit_loops_kv_into_the_later_slots():
    """T = 3 loops, one layer, S = 2, position 1 exits at loop 1 (row 0) or 3 (row 1): row 0's
    slots 2 and 3 take loop 1's K/V and its depth becomes T; row 1 keeps its own."""
    T, B, S = 3, 2, 2
    cache = (jnp.arange(1, T + 1, dtype=jnp.float32)[:, None, None, None, None, None]
             * jnp.ones((T, 1, B, S, 1, 1)))  # slot t holds t
    exit_loop = np.array([[0, 1], [0, 3]])
    s = POLICIES["copy"].step_end(_state(np.zeros((B, S)), exit_loop, cache), 1,
                                  jnp.array([True, True]), T)
    k = np.asarray(s.k_cache)[:, 0, :, :, 0, 0]  # [T, B, S]
    assert k[:, 0, 1].tolist() == [1, 1, 1] and k[:, 1, 1].tolist() == [1, 2, 3]
    assert k[:, :, 0].tolist() == [[1, 1], [2, 2], [3, 3]]  # other positions untouched
    assert np.array_equal(np.asarray(s.v_cache), -np.asarray(s.k_cache))
    assert np.asarray(s.depth_BxS)[:, 1].tolist() == [T, T]
    assert POLICIES["dense"].step_end(s, 1, jnp.array([True, True]), T) is s
