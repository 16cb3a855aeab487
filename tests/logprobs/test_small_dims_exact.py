"""Replay == sampler, raw bits, for a one-layer model with peaked (trained-like) weights.

Regression test for the smoke run's replay mismatch (hidden 32, 1 layer, 2 heads, head_dim 16,
the `smoke` experiment's warm-started model): with L = 1 XLA inlines the layer scan, and when the
learner unrolled its T loops XLA fused loop t's final norm (`h = (x * rsqrt) * w`) into loop
t+1's residual add `h + attn_out`; LLVM's FMA contraction then rounded that add differently from
the sampler, whose loop-by-loop while loop reads h from memory. Every live prompt position
differed from loop 2 on, the prefill emission included. `exit_hidden` now runs the loops as a
`lax.scan`. Needs RMSNorm weights != 1 (as trained ones are): see `params`.
"""
import numpy as np
import pytest

from looprl.logprobs import batch_logprobs
from looprl.model.config import OuroConfig
from looprl.model.looped import init_params
from looprl.sampling.sampler import SamplingConfig, generate

CFG = OuroConfig(vocab_size=64, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2,
                 head_dim=16, intermediate_size=64, rope_theta=10000.0,
                 max_position_embeddings=512)
PROMPTS = [[1, 5, 9, 3, 7, 11, 2, 1], [1, 4, 6, 8, 2, 1], [1, 7, 2], [1, 9, 9, 3, 4, 5, 6, 2, 1]]


@pytest.fixture(scope="module")
def params():
    """Trained-like weights: Linear kernels and embeddings x5 (peaked logits) and RMSNorm
    weights away from 1 (with unit norm weights `h = x * rsqrt * 1` is exact and any FMA
    contraction of it rounds like the plain add, which hid the bug from random-init tests)."""
    p = init_params(CFG, 3)
    rng = np.random.default_rng(3)
    norm_like = lambda a: (1.0 + 0.3 * rng.standard_normal(a.shape)).astype(np.float32)
    layers = {k: (norm_like(v) if "layernorm" in k else np.asarray(v) * 5.0)
              for k, v in p["layers"].items()}
    return {"embed_tokens": np.asarray(p["embed_tokens"]) * 5.0, "layers": layers,
            "norm": norm_like(p["norm"]), "lm_head": np.asarray(p["lm_head"]) * 5.0,
            "early_exit_gate": {"kernel": np.asarray(p["early_exit_gate"]["kernel"]) * 5.0,
                                "bias": np.asarray(p["early_exit_gate"]["bias"])}}


def _exact(lp, ref, mask):
    return float(np.mean(lp.view(np.uint32)[mask] == ref.view(np.uint32)[mask]))


@pytest.mark.parametrize("policy, q", [("dense", 0.3), ("copy", 0.3),  # early exits, replayed
                                       pytest.param("dense", 1.0, marks=pytest.mark.slow),
                                       pytest.param("copy", 1.0, marks=pytest.mark.slow)])
def test_replay_bits_equal_sampler_one_layer_peaked_weights(params, q, policy):
    scfg = SamplingConfig(max_new_tokens=10, exit_threshold=q, kv_policy=policy, stop_ids=(2,))
    rb = generate(CFG, params, PROMPTS, scfg, group_size=2, seed=1)
    mask = rb.exit_loop_BxS > 0
    assert mask.sum() >= 20
    P = rb.schedule.prompt_len
    assert mask[:, P - 1].all()  # the prefill emission is checked too
    if q < 1.0:
        assert (rb.exit_loop_BxS[mask] < CFG.total_ut_steps).mean() > 0  # some early exits
    for rows in (None, np.array([5, 2, 7, 0])):
        ref = rb.logprob_BxS if rows is None else rb.logprob_BxS[rows]
        m = mask if rows is None else mask[rows]
        lp, _ = batch_logprobs(CFG, params, rb, "replay", rows=rows)
        assert _exact(lp, ref, m) == 1.0


@pytest.mark.slow  # 43 s; N = 8j + 1 columns: tests/model/test_kernels.py (n = 17, 33; vocab 49)
def test_batch_one_rollouts_with_a_vocabulary_of_8j_plus_1_replay_exactly():
    """Regression (found by a scan of the unpadded CPU kernels): a one-row dot computed the
    last of N = 8j + 1 output columns differently from the same row in a larger call, so batch-1
    decoding with vocabulary 17 gave 2 of 480 sampled log-probs 1 ulp off the learner's. The
    CPU matmul now pads N to a multiple of 16."""
    import jax
    import jax.numpy as jnp

    from looprl.model.config import preset
    cfg = preset("tiny", vocab_size=17, hidden_size=48, intermediate_size=200, num_heads=3,
                 num_kv_heads=1, head_dim=16)
    p = init_params(cfg, 0)
    p["early_exit_gate"]["bias"] = jnp.array([-0.3])
    p = jax.tree.map(np.asarray, p)
    scfg = SamplingConfig(max_new_tokens=80, exit_threshold=0.6, temperature=1.3, stop_ids=(),
                          kv_policy="dense")
    checked = 0
    for seed in (1, 3):  # seeds whose rollouts hit the differing column before the fix
        rb = generate(cfg, p, [[5, 9, 3, 7, 11]], scfg, seed=seed)
        lp, _ = batch_logprobs(cfg, p, rb, "replay")
        sampled = np.asarray(rb.exit_loop_BxS) > 0
        got = np.asarray(lp, np.float32).view(np.uint32)[sampled]
        want = np.asarray(rb.logprob_BxS, np.float32).view(np.uint32)[sampled]
        assert np.array_equal(got, want), f"seed {seed}: {np.sum(got != want)} log-probs differ"
        checked += sampled.sum()
    assert checked == 2 * 80
