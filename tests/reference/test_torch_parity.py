"""The Flax model against the independent PyTorch reference (looprl/reference/torch_ouro.py),
both loading the same tiny random HF checkpoint; and T=1 against a plain layer stack."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from looprl.io import hf
from looprl.model import looped
from looprl.model.config import preset
from looprl.reference.torch_ouro import TorchOuro


def random_params(cfg, seed=0):
    """Random fp32 params with O(1) logits: non-unit norms and a nonzero gate bias, so that a
    transposed or swapped tensor shows in the outputs."""
    rng = np.random.default_rng(seed)
    tmpl = looped.expected_param_shapes(cfg)

    def leaf(path, s):
        name = jax.tree_util.keystr(path)
        if "layernorm" in name or name == "['norm']":
            return (1.0 + 0.2 * rng.standard_normal(s.shape)).astype(np.float32)
        fan_in = s.shape[-2] if len(s.shape) >= 2 else 1
        return (rng.standard_normal(s.shape) / np.sqrt(fan_in)).astype(np.float32)
    return jax.tree_util.tree_map_with_path(leaf, tmpl)


def write_hf(tmp_path, cfg, dtype="float32", seed=0, name="hf"):
    params = random_params(cfg, seed)
    return hf.save_hf(params, cfg, tmp_path / name, dtype), params


def tokens(cfg, B=3, S=11, seed=1):
    return np.random.default_rng(seed).integers(0, cfg.vocab_size, (B, S)).astype(np.int32)


@pytest.mark.parametrize("num_kv_heads", [4, 2], ids=["mha", "gqa"])
def test_flax_matches_torch_every_loop_fp32(tmp_path, num_kv_heads):
    cfg = preset("tiny", num_kv_heads=num_kv_heads, total_ut_steps=3)
    path, _ = write_hf(tmp_path, cfg)
    ids = tokens(cfg)
    out = hf.load_hf(path)(jnp.asarray(ids))
    ref_logits, ref_gate = TorchOuro.from_hf(path).forward(ids)
    assert out.logits.shape == (3, 3, 11, cfg.vocab_size) and out.logits.dtype == jnp.float32
    assert float(jnp.abs(ref_logits.numpy()).max()) > 1.0  # logits are not trivially small
    for t in range(cfg.total_ut_steps):
        diff = np.abs(np.asarray(out.logits[t]) - ref_logits[t].numpy()).max()
        assert diff <= 1e-4, f"loop {t + 1}: max abs logit diff {diff}"
        gdiff = np.abs(np.asarray(out.exit_lambda[t]) - ref_gate[t].numpy()).max()
        assert gdiff <= 1e-5, f"loop {t + 1}: max abs gate diff {gdiff}"
    # the loops really differ (the test would pass vacuously if every loop were equal)
    assert np.abs(ref_logits[0].numpy() - ref_logits[-1].numpy()).max() > 0.1


def test_bf16_compute_close_to_fp32_reference(tmp_path):
    cfg = preset("tiny", total_ut_steps=3)
    path, _ = write_hf(tmp_path, cfg)
    ids = tokens(cfg)
    model = hf.load_hf(path, dtype="bfloat16")
    assert model.compute_dtype == jnp.bfloat16 and model.embed_tokens[...].dtype == jnp.bfloat16
    out = model(jnp.asarray(ids))
    assert out.logits.dtype == jnp.float32
    ref_logits, _ = TorchOuro.from_hf(path).forward(ids)
    ref = ref_logits.numpy()
    scale = np.abs(ref).max()
    for t in range(cfg.total_ut_steps):
        diff = np.abs(np.asarray(out.logits[t]) - ref[t]).max()
        assert diff <= 0.05 * scale, f"loop {t + 1}: {diff} > 5% of {scale}"
        assert diff > 0  # really computed in bf16


def _plain_stack(params, cfg, ids):
    """A plain pre-norm-style transformer written directly in numpy-like jnp (no looprl code):
    L sandwich-norm layers, final norm, lm_head: what Ouro is at T = 1."""
    def rms(x, w):
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + cfg.rms_norm_eps) * w

    B, S = ids.shape
    H, Hkv, K = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    inv = 1.0 / cfg.rope_theta ** (np.arange(0, K, 2) / K)
    ang = np.arange(S)[:, None] * inv[None]
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))

    def rope(x):  # [B, S, h, K]
        rot = np.concatenate([-x[..., K // 2:], x[..., :K // 2]], -1)
        return x * cos[None, :, None] + rot * sin[None, :, None]

    P = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    x = P["embed_tokens"][ids]
    causal = np.tril(np.ones((S, S), bool))
    for i in range(cfg.num_layers):
        lw = {k: v[i] for k, v in P["layers"].items()}
        h = rms(x, lw["input_layernorm"])
        q = rope((h @ lw["q_proj"]).reshape(B, S, H, K))
        k = np.repeat(rope((h @ lw["k_proj"]).reshape(B, S, Hkv, K)), H // Hkv, axis=2)
        v = np.repeat((h @ lw["v_proj"]).reshape(B, S, Hkv, K), H // Hkv, axis=2)
        s = np.einsum("bqhk,bshk->bhqs", q, k) / np.sqrt(K)
        s = np.where(causal, s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        o = np.einsum("bhqs,bshk->bqhk", p, v).reshape(B, S, H * K)
        a = x + rms(o @ lw["o_proj"], lw["input_layernorm_2"])
        z = rms(a, lw["post_attention_layernorm"])
        g = z @ lw["gate_proj"]
        x = a + rms((g / (1 + np.exp(-g)) * (z @ lw["up_proj"])) @ lw["down_proj"],
                    lw["post_attention_layernorm_2"])
    h = rms(x, P["norm"])
    gate = 1 / (1 + np.exp(-(h @ P["early_exit_gate"]["kernel"])[..., 0]
                           - P["early_exit_gate"]["bias"][0]))
    return h @ P["lm_head"], gate


@pytest.mark.parametrize("num_kv_heads", [4, 1], ids=["mha", "gqa"])
def test_one_loop_equals_plain_layer_stack(tmp_path, num_kv_heads):
    cfg = preset("tiny", total_ut_steps=1, num_kv_heads=num_kv_heads)
    params = random_params(cfg, seed=3)
    ids = tokens(cfg, B=2, S=9)
    out = looped.model_from_params(params, cfg)(jnp.asarray(ids))
    want_logits, want_gate = _plain_stack(params, cfg, ids)
    assert out.logits.shape == (1, 2, 9, cfg.vocab_size)
    np.testing.assert_allclose(np.asarray(out.logits[0]), want_logits, atol=1e-4, rtol=0)
    np.testing.assert_allclose(np.asarray(out.exit_lambda[0]), want_gate, atol=1e-6, rtol=0)


def test_torch_kv_cache_decode_matches_full_forward(tmp_path):
    """generate_greedy (prefill + one token per step through all T loops) picks the same tokens
    as the argmax of the full forward's last-loop logits on the generated sequence."""
    cfg = preset("tiny", num_kv_heads=2)
    path, _ = write_hf(tmp_path, cfg)
    ref = TorchOuro.from_hf(path)
    prompt = tokens(cfg, B=2, S=5, seed=4)
    timings = {}
    seq = ref.generate_greedy(prompt, max_new_tokens=6, timings=timings)
    assert seq.shape == (2, 11) and np.array_equal(seq[:, :5], prompt)
    assert set(timings) == {"prefill_s", "decode_s"}  # the split `generate(timings=)` reports
    assert timings["prefill_s"] > 0 and timings["decode_s"] > 0
    assert np.array_equal(ref.generate_greedy(prompt, max_new_tokens=6), seq)
    logits, _ = ref.forward(seq)
    greedy = logits[-1].numpy().argmax(-1)  # [B, S]: token emitted after each position
    assert np.array_equal(greedy[:, 4:10], seq[:, 5:11])
    assert torch.get_num_threads() >= 1
