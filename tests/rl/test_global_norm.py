"""The gradient clip's norm on `cpu-ordered` is a sum whose order the program fixes
(`kernels.global_norm`, docs/NUMERICS.md "The whole CPU run"): each leaf's squares as column
chains over the rows, then one chain over the columns, the leaves in tree order."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from looprl.kernels import global_norm, use_form
from looprl.kernels.cpu import ordered as cpu_ordered
from looprl.rl.optimizer import clip_by_global_norm


def _chains(rows: np.ndarray) -> np.ndarray:
    """`ordered_matmul`'s sum per column of `rows` [M, D] (docs/NUMERICS.md, "The ordered CPU
    form"): an add chain over 256-row chunks from -0.0, the chunk sums added left to right."""
    total = None
    for c in range(0, rows.shape[0], 256):
        acc = np.full(rows.shape[1], -0.0, np.float32)
        for r in rows[c:c + 256]:
            acc = (acc + r).astype(np.float32)
        total = acc if total is None else (total + acc).astype(np.float32)
    return total


def _chain_sum(a: np.ndarray) -> np.float32:
    """float32 reference of `cpu_ordered.sum_all`: column chains, then one chain over them."""
    rows = a.reshape(-1, a.shape[-1] if a.ndim else 1).astype(np.float32)
    return _chains(_chains(rows)[:, None])[0]


def _tree():
    rng = np.random.default_rng(3)
    return {"a": jnp.asarray(rng.standard_normal((300, 7)) * 1e3, jnp.float32),
            "b": {"w": jnp.asarray(rng.standard_normal((5,)), jnp.float32),
                  "z": jnp.asarray(rng.standard_normal((2, 3, 4)) * 1e-3, jnp.float32)}}


def test_sum_all_is_the_documented_chain():
    a = np.random.default_rng(0).standard_normal((513, 33)).astype(np.float32) * 1e4
    got = np.asarray(jax.jit(cpu_ordered.sum_all)(jnp.asarray(a)))
    assert got.view(np.uint32) == _chain_sum(a).view(np.uint32)


def test_global_norm_bits_on_cpu_ordered_and_optax_elsewhere():
    tree = _tree()
    total = np.float32(0.0)
    for leaf in jax.tree.leaves(tree):
        x = np.asarray(leaf)
        total = np.float32(total + _chain_sum((x * x).astype(np.float32)))
    with use_form("cpu-ordered"):
        got = np.asarray(jax.jit(global_norm)(tree))
    assert got.view(np.uint32) == np.sqrt(total).view(np.uint32)
    with use_form("cpu-xla"):
        other = np.asarray(jax.jit(lambda t: global_norm(t))(tree))  # a fresh trace
        stock = np.asarray(jax.jit(optax.tree.norm)(tree))
    assert other.view(np.uint32) == stock.view(np.uint32)


def test_clip_scales_like_optax_by_the_ordered_norm():
    tree = _tree()
    with use_form("cpu-ordered"):
        clip = clip_by_global_norm(1.0)
        out, _ = jax.jit(lambda t: clip.update(t, clip.init(t)))(tree)
        norm = jax.jit(global_norm)(tree)
    assert float(norm) > 1.0  # the clip scales
    for x, y in zip(jax.tree.leaves(tree), jax.tree.leaves(out)):
        want = ((np.asarray(x) / np.asarray(norm)) * np.float32(1.0)).astype(np.float32)
        assert np.array_equal(np.asarray(y).view(np.uint32), want.view(np.uint32))
