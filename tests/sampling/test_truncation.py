"""top-k / top-p sampling end to end: the recorded log-probs against a float64 NumPy reference.

Order (looprl/sampling/processing.py, as HF transformers and vLLM do): temperature -> top-k ->
top-p, the nucleus taken over the top-k-renormalised distribution and always keeping the most
likely token. `logprob_BxS` is the untruncated log_softmax(logits / temperature);
`logprob_processed_BxS` is the log-prob renormalised over the kept tokens. The reference
recomputes the logits at each emitting position's recorded exit loop with the independent
PyTorch forward (looprl/reference/torch_ouro.py; dense KV policy, so the math is the sampler's),
one row at a time without its left padding, and applies the processing in float64: a math check
(1e-5), not a bit check.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from looprl.io.hf import hf_state_from_params
from looprl.model.config import preset
from looprl.model.looped import init_params
from looprl.reference.torch_ouro import TorchOuro
from looprl.sampling.processing import process_logits
from looprl.sampling.sampler import SamplingConfig, generate

CFG = preset("tiny")
PROMPTS = [[5, 9, 3, 7, 11], [4, 6], [8, 12, 13, 14, 15, 16, 17]]


@pytest.fixture(scope="module")
def setup():
    p = init_params(CFG, 0)
    p["lm_head"] = p["lm_head"] * 8.0                  # logit std ~2: a peaked distribution
    p["early_exit_gate"]["bias"] = jnp.array([-0.3])   # lambda ~ 0.4: exits spread over loops
    p = jax.tree.map(np.asarray, p)
    return p, TorchOuro(CFG, hf_state_from_params(p, CFG))


def np_processed(logits_V, temperature, top_k, top_p):
    """(full log-probs, kept mask, processed log-probs) in float64, the module's order."""
    x = np.asarray(logits_V, np.float64) / temperature
    full = x - np.logaddexp.reduce(x)
    keep = np.ones_like(x, bool)
    if 0 < top_k < x.size:
        keep &= x >= np.sort(x)[::-1][top_k - 1]
    if top_p < 1.0:
        m = np.where(keep, x, -np.inf)
        probs = np.exp(m - np.logaddexp.reduce(m))
        order = np.argsort(-m, kind="stable")
        cum_before = np.cumsum(probs[order]) - probs[order]
        keep_sorted = cum_before < top_p
        keep_sorted[0] = True
        # the decision must not hinge on float32 round-off (else the check is ill-posed)
        assert np.min(np.abs(cum_before[1:] - top_p)) > 1e-5
        kept = np.zeros_like(keep)
        kept[order[keep_sorted]] = True
        keep &= kept
    m = np.where(keep, x, -np.inf)
    return full, keep, m - np.logaddexp.reduce(m)


@pytest.mark.parametrize("temperature,top_k,top_p", [
    (0.7, 6, 1.0), pytest.param(1.0, 0, 0.6, marks=pytest.mark.slow), (0.7, 10, 0.5)])
def test_recorded_logprobs_equal_a_float64_renormalisation_of_the_kept_tokens(
        setup, temperature, top_k, top_p):
    params, ref = setup
    scfg = SamplingConfig(max_new_tokens=6, temperature=temperature, top_k=top_k, top_p=top_p,
                          exit_threshold=0.6, kv_policy="dense", stop_ids=())
    rb = generate(CFG, params, PROMPTS, scfg, group_size=2, seed=1)
    tokens, pad = np.asarray(rb.tokens_BxS), np.asarray(rb.pad_B)
    exit_loop = np.asarray(rb.exit_loop_BxS)
    logits = {b: ref.forward(np.array(tokens[b:b + 1, pad[b]:]))[0][:, 0].double().numpy()
              for b in range(len(tokens))}                 # [T, S - pad, V] per row
    assert len(np.unique(exit_loop[exit_loop > 0])) >= 2   # several exit loops are exercised
    n_trunc = 0
    for b, i in zip(*np.nonzero(exit_loop)):
        tok = tokens[b, i + 1]
        full, keep, proc = np_processed(logits[b][exit_loop[b, i] - 1, i - pad[b]],
                                        temperature, top_k, top_p)
        assert keep[tok], (b, i, tok)                      # the sample is in the kept set
        if top_k and top_p == 1.0:
            assert keep.sum() == top_k
        n_trunc += keep.sum() < keep.size
        np.testing.assert_allclose(rb.logprob_BxS[b, i], full[tok], atol=1e-5, rtol=0)
        np.testing.assert_allclose(rb.logprob_processed_BxS[b, i], proc[tok], atol=1e-5, rtol=0)
        if keep.sum() < keep.size:                         # renormalised: strictly larger
            assert rb.logprob_processed_BxS[b, i] > rb.logprob_BxS[b, i] + 1e-3
    assert n_trunc == np.count_nonzero(exit_loop)          # every position truncated something


def test_order_is_temperature_then_top_k_then_top_p_keeping_the_most_likely_token():
    # probs 0.4, 0.3, 0.2, 0.1. top-k 2 renormalises to 4/7, 3/7; the nucleus 0.5 over that
    # keeps only token 0 (cum before token 1 is 4/7 >= 0.5). top-p first would keep {0, 1}.
    logits = jnp.log(jnp.array([[0.4, 0.3, 0.2, 0.1]], jnp.float32))
    _, proc = process_logits(logits, 1.0, 2, 0.5)
    np.testing.assert_array_equal(np.isfinite(proc[0]), [True, False, False, False])
    assert float(proc[0, 0]) == 0.0
    _, proc = process_logits(logits, 1.0, 0, 0.5)           # nucleus alone: {0, 1}
    np.testing.assert_allclose(np.exp(proc[0]), [4 / 7, 3 / 7, 0, 0], rtol=1e-6)
    _, proc = process_logits(logits, 1.0, 0, 1e-6)          # a tiny nucleus keeps the top token
    np.testing.assert_array_equal(np.isfinite(proc[0]), [True, False, False, False])
    # temperature first: at 0.5 the probs are 16:9:4:1 / 30, and the 0.5 nucleus keeps {0}
    # only (cum before token 1 is 16/30 >= 0.5), where at temperature 1 it kept {0, 1}
    full, proc = process_logits(logits, 0.5, 0, 0.5)
    np.testing.assert_allclose(np.exp(full[0]), np.array([16, 9, 4, 1]) / 30, rtol=1e-5)
    np.testing.assert_array_equal(np.isfinite(proc[0]), [True, False, False, False])
    # top-k 3 at 0.5 renormalises to 16:9:4 / 29; the 0.6 nucleus keeps {0, 1}: 16/25, 9/25
    _, proc = process_logits(logits, 0.5, 3, 0.6)
    np.testing.assert_allclose(np.exp(proc[0]), [16 / 25, 9 / 25, 0, 0], rtol=1e-5)
