"""The sampler's state between decode steps, the per-row inputs, and what its programs are
compiled for.

Layout (docs/DESIGN.md §3): B rows, left-padded to P prompt positions; S = P + max_new_tokens
positions; the K/V cache holds every (loop, layer) slot: `[T, L, B, S, Hkv, K]`.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from looprl.model.config import OuroConfig
from looprl.sampling.config import SamplingConfig


class DecodeState(NamedTuple):
    tokens_BxS: jax.Array
    h_BxSxD: jax.Array  # latest hidden state of each position (its h(depth))
    depth_BxS: jax.Array  # loops whose KV the position has computed
    k_cache: jax.Array  # [T, L, B, S, Hkv, K]
    v_cache: jax.Array
    exit_loop_BxS: jax.Array
    logprob_BxS: jax.Array
    logprob_processed_BxS: jax.Array
    flush_BxS: jax.Array
    done_B: jax.Array
    completion_len_B: jax.Array
    loop_rows_1xSxTxW: jax.Array  # rows run per (decode step, loop, pass): a menu size or a
    #                               window's blocks x their rows
    p: jax.Array  # next position to run (int32 scalar)
    # the thinking budget (`looprl.sampling.thinking`): emitting positions whose token was
    # teacher-forced, the completion index where the forced answer starts (`thinking.NEVER`:
    # not interrupted), and whether the completion has closed its thinking
    forced_BxS: jax.Array | None = None
    force_at_B: jax.Array | None = None
    closed_B: jax.Array | None = None


class RowInfo(NamedTuple):
    pad_B: jax.Array
    prompt_index_B: jax.Array
    sample_index_B: jax.Array
    forced_tokens_BxS: jax.Array | None
    forced_exit_BxS: jax.Array | None
    forced_flush_BxS: jax.Array | None
    think_budget_B: jax.Array | None = None  # int32: the thinking budget (None: off)


@dataclasses.dataclass(frozen=True)
class Static:
    """What the prefill and decode programs are compiled for (their static argument)."""
    cfg: OuroConfig
    scfg: SamplingConfig
    P: int
    S: int
    seed: int
    forced: bool
    row_menu: tuple[int, ...] = ()  # sub-batch sizes of row compaction; () = off
    window_widths: tuple[int, ...] = (1,)  # widths of a decode loop's passes (the policy's
    #                                        `window_widths`), with compaction


def kv_cache_bytes(cfg, rows: int, seq_len: int, compute_dtype) -> int:
    """Bytes of the sampler's KV cache for `rows` rows of `seq_len` positions: keys and values,
    `[T, L, B, S, Hkv, K]` each in the compute dtype (every loop keeps its own cache)."""
    per = (cfg.total_ut_steps * cfg.num_layers * rows * seq_len * cfg.num_kv_heads *
           cfg.head_dim)
    return 2 * per * jnp.dtype(compute_dtype).itemsize
