"""`layers.stack_pass`'s bit-sliced bf16 weights (issue 19): the same bits, no fp32 stack."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from looprl.model.config import preset
from looprl.model.layers import layer_bits, stack_pass
from looprl.model.looped import cast_weights, init_params

CFG = preset("tiny", num_layers=4)


def _pass(bits):
    B, C, S = 2, 3, 8
    Hkv, K = CFG.num_kv_heads, CFG.head_dim

    def f(w, x):
        kv = jnp.zeros((CFG.num_layers, B, S, Hkv, K), jnp.bfloat16)
        pos = jnp.broadcast_to(jnp.arange(C), (B, C))
        return stack_pass(CFG, w, x, pos, jnp.arange(C), jnp.zeros((B,), jnp.int32), kv, kv,
                          jnp.ones((B, C), bool), 0, bits=bits)
    w = cast_weights(init_params(CFG, 0), jnp.bfloat16)
    w["layers"] = jax.tree.map(lambda a: a.astype(jnp.bfloat16), w["layers"])  # bf16-resident
    x = jax.random.normal(jax.random.key(0), (B, C, CFG.hidden_size)).astype(jnp.bfloat16)
    return jax.jit(f), w, x


def test_fp32_stacks_are_cast_per_layer_to_the_same_bits():
    """`cast_weights` leaves the stacks fp32 and `stack_pass` casts each layer: the same bits as
    a stack cast to bf16 beforehand, and no bf16 or fp32 copy of a whole stack in the program."""
    f, w16, x = _pass(False)
    w32 = cast_weights(init_params(CFG, 0), jnp.bfloat16)
    assert w32["layers"]["up_proj"].dtype == jnp.float32
    for a, b in zip(jax.tree.leaves(f(w16, x)), jax.tree.leaves(f(w32, x))):
        assert np.array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))
    L, D, F = CFG.num_layers, CFG.hidden_size, CFG.intermediate_size
    text = f.lower(w32, x).compile().as_text()
    assert not re.search(rf"(f32|bf16)\[{L},({D},{F}|{F},{D})\]\S* (convert|fusion)", text)


def test_bit_sliced_weights_give_the_same_bits():
    f0, w, x = _pass(False)
    f1, _, _ = _pass(True)
    for a, b in zip(jax.tree.leaves(f0(w, x)), jax.tree.leaves(f1(w, x))):
        assert np.array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))


def test_bit_sliced_weights_leave_no_fp32_copy_of_a_stack():
    """XLA CPU slices bf16 in fp32: without `bits`, the compiled pass holds the MLP stack widened
    to f32[L, D, F] (hoisted out of the layer loop); with it, no array of that shape exists."""
    L, D, F = CFG.num_layers, CFG.hidden_size, CFG.intermediate_size
    stack = re.compile(rf"f32\[{L},({D},{F}|{F},{D})\]")
    texts = {}
    for bits in (False, True):
        f, w, x = _pass(bits)
        texts[bits] = f.lower(w, x).compile().as_text()
    if jax.default_backend() == "cpu":  # the probe sees the copy where XLA makes it
        assert stack.search(texts[False])
    assert not stack.search(texts[True])


def test_layer_bits_refuses_a_gradient():
    with pytest.raises(TypeError, match="not differentiable"):
        jax.grad(lambda a: layer_bits(a.astype(jnp.bfloat16)).astype(jnp.float32).sum())(
            jnp.ones(3))


def test_bf16_decode_program_holds_no_fp32_copy_of_the_embedding_or_lm_head():
    """XLA CPU widens a bf16 gather's table and a bf16 dot's weight to fp32 as a whole, and
    in the decode loop those copies are loop-invariant, hoisted and held through it (issue 19:
    0.4 GB each at Ouro-1.4B). The embedding gathers uint16 bits and the kernels widen one
    128-row weight block at a time: the optimized decode program has neither fp32 copy (the
    previous code had both), and the values are unchanged (the bf16 tests of the sampler and
    tests/model/test_kernels*.py, bit for bit)."""
    from looprl.io.slabs import LeafSlabs
    from looprl.sampling import sampler
    from looprl.sampling.resident import ComputeWeights
    cfg = preset("tiny", vocab_size=1000, hidden_size=128, intermediate_size=256, num_heads=2,
                 num_kv_heads=1, head_dim=64)
    weights = ComputeWeights("bfloat16")
    held = jax.tree_util.tree_map_with_path(lambda kp, a: weights(
        tuple(k.key for k in kp), LeafSlabs.whole(np.asarray(a))), init_params(cfg, 0))
    seen = {}
    decode = sampler._decode

    def spy(*args):
        seen["args"] = args
        return decode(*args)

    scfg = sampler.SamplingConfig(max_new_tokens=4, compute_dtype="bfloat16", stop_ids=())
    orig, sampler._decode = sampler._decode, spy
    try:
        sampler.generate(cfg, held, [[3, 4, 5]], scfg, master_fingerprint=weights.fingerprint())
    finally:
        sampler._decode = orig
    text = decode.lower(*seen["args"]).compile().as_text()
    assert not re.findall(r"f32\[(?:1000,128|128,1000|\d+,128,1000)\]", text)


def test_embedding_gradient_is_the_plain_gather_gradient():
    rng = np.random.default_rng(1)
    from looprl.model.looped import embed
    table = jnp.asarray(rng.standard_normal((40, 8)), jnp.float32)
    tok = jnp.asarray([[1, 2, 39], [0, 0, 3]], jnp.int32)
    for dt in (jnp.float32, jnp.bfloat16):
        def ours(t):
            return jnp.sum(embed({"embed_tokens": t.astype(dt)}, tok).astype(jnp.float32) ** 2)

        def plain(t):
            return jnp.sum(jnp.take(t.astype(dt), tok, axis=0).astype(jnp.float32) ** 2)
        assert np.array_equal(np.asarray(jax.grad(ours)(table)).view(np.uint32),
                              np.asarray(jax.grad(plain)(table)).view(np.uint32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_sampler_form_reads_each_layers_matmul_weights_in_place(dtype, monkeypatch):
    """The sampler's form (`loop=`, `bits=True`) gives the kernel the stacked weight and the
    layer index (`kernels.layer_matmul`), so the compiled pass slices no matmul weight out of
    its stack (a copy per layer pass: 46 MB a weight at Ouro-1.4B's MLP widths in fp32); the
    same bits as the sliced weights (`reads_layers_in_place` off)."""
    from looprl import kernels as kn
    B, C, S, T = 3, 1, 8, 2
    L, Hkv, K = CFG.num_layers, CFG.num_kv_heads, CFG.head_dim
    D, F = CFG.hidden_size, CFG.intermediate_size
    w = cast_weights(init_params(CFG, 0), dtype)
    w["layers"] = jax.tree.map(lambda a: a.astype(dtype), w["layers"])
    x = jax.random.normal(jax.random.key(1), (B, C, D)).astype(dtype)
    cache = jax.random.normal(jax.random.key(2), (T, L, B, S, Hkv, K)).astype(dtype)

    def program():  # a new function each time: jit's cache would keep the first trace
        def f(w, x, cache):
            pos = jnp.full((B, C), 5)
            return stack_pass(CFG, w, x, pos, jnp.arange(5, 5 + C), jnp.zeros((B,), jnp.int32),
                              cache, cache, jnp.ones((B, C), bool), 5, bits=True,
                              loop=jnp.int32(1))
        f = jax.jit(f)
        return f.lower(w, x, cache).compile().as_text(), f(w, x, cache)
    text, got = program()
    assert "looprl_ordered_matmul_layer" in text
    weight = re.compile(rf"(f32|bf16|u16)\[({D},{F}|{F},{D})\]\S* (dynamic-slice|fusion)")
    assert not weight.search(text)
    if dtype == jnp.bfloat16:  # nor a widened copy of a bf16 stack (issue 19)
        assert not re.search(rf"f32\[{L},\d+,\d+\]", text)
    monkeypatch.setattr(kn, "reads_layers_in_place", lambda: False)
    sliced_text, want = program()
    assert weight.search(sliced_text)  # the probe sees the slices where they are made
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert np.array_equal(np.asarray(a, np.float32).view(np.uint32),
                              np.asarray(b, np.float32).view(np.uint32))
