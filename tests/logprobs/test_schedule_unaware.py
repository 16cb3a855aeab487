"""The schedule-unaware learner baselines: `full_depth` (loop T everywhere) and
`expected` (HF Ouro's exit-distribution mixture of logits), checked against independent
computations: the model's own all-loops inspection pass and the PyTorch reference's mixture."""
import jax
import jax.numpy as jnp
import numpy as np
import torch

from looprl.io import hf
from looprl.logprobs import sequence_logprobs
from looprl.model import looped
from looprl.model.config import preset
from looprl.reference.torch_ouro import TorchOuro

CFG = preset("tiny", total_ut_steps=3, num_layers=1)


def _params(seed=0):
    rng = np.random.default_rng(seed)

    def leaf(path, s):
        name = jax.tree_util.keystr(path)
        if "layernorm" in name or name == "['norm']":
            return (1.0 + 0.2 * rng.standard_normal(s.shape)).astype(np.float32)
        if "bias" in name:
            return np.full(s.shape, -0.5, np.float32)  # lambdas well inside (0, 1)
        fan_in = s.shape[-2] if len(s.shape) >= 2 else 1
        return (rng.standard_normal(s.shape) / np.sqrt(fan_in)).astype(np.float32)
    return jax.tree_util.tree_map_with_path(leaf, looped.expected_param_shapes(CFG))


def _inputs(B=2, S=9):
    tokens = np.random.default_rng(1).integers(0, CFG.vocab_size, (B, S)).astype(np.int32)
    exit_loop = np.zeros((B, S), np.int32)
    exit_loop[:, 3:-1] = np.array([[1, 2, 1, 3, 2], [2, 1, 3, 1, 1]])  # early exits
    return tokens, np.zeros((B,), np.int32), exit_loop, exit_loop.copy()


def _lp(method, params, kv_policy="deferred", temperature=1.0):
    tokens, pad, exit_loop, kv_depth = _inputs()
    lp, _ = sequence_logprobs(CFG, params, jnp.asarray(tokens), jnp.asarray(pad),
                              jnp.asarray(exit_loop), jnp.asarray(kv_depth), kv_policy=kv_policy,
                              compute_dtype="float32", temperature=temperature, method=method)
    return np.asarray(lp), tokens, exit_loop


def _target_logprobs(logits_BxSxV, tokens, exit_loop, temperature):
    x = logits_BxSxV.astype(np.float64) / temperature
    x = x - x.max(-1, keepdims=True)
    logp = x - np.log(np.exp(x).sum(-1, keepdims=True))
    tgt = np.concatenate([tokens[:, 1:], np.zeros((tokens.shape[0], 1), tokens.dtype)], 1)
    out = np.take_along_axis(logp, tgt[..., None], -1)[..., 0]
    return np.where(exit_loop > 0, out, 0.0)


def test_full_depth_is_loop_T_whatever_the_exits_and_kv_policy():
    params = _params()
    out = looped.all_loop_outputs(CFG, looped.cast_weights(params, jnp.float32),
                                  jnp.asarray(_inputs()[0]))
    for kv in ("deferred", "copy"):
        lp, tokens, exit_loop = _lp("full_depth", params, kv, temperature=0.7)
        ref = _target_logprobs(np.asarray(out.logits[-1]), tokens, exit_loop, 0.7)
        np.testing.assert_allclose(lp, ref, atol=2e-5)
    dense, _, _ = _lp("dense", params)  # the schedule's own exits give other values
    assert np.abs(dense - lp).max() > 1e-3


def test_expected_matches_the_torch_reference_mixture(tmp_path):
    params = _params()
    path = hf.save_hf(params, CFG, tmp_path / "hf")
    tokens, _, exit_loop, _ = _inputs()
    mix = TorchOuro.from_hf(path).expected_logits(tokens).numpy()
    for temperature in (1.0, 0.7):
        lp, _, _ = _lp("expected", params, temperature=temperature)
        ref = _target_logprobs(mix, tokens, exit_loop, temperature)
        np.testing.assert_allclose(lp, ref, atol=5e-5)
    full, _, _ = _lp("full_depth", params)
    assert np.abs(full - lp).max() > 1e-3  # the mixture is not loop T


def test_expected_trains_the_gate_through_the_exit_distribution():
    """p_t is differentiable: the gate's gradient is nonzero under `expected`, zero under
    `full_depth` (whose value never reads the gate)."""
    params = _params()
    tokens, pad, exit_loop, kv_depth = map(jnp.asarray, _inputs())

    def grads(method):
        def loss(p):
            lp, _ = sequence_logprobs(CFG, p, tokens, pad, exit_loop, kv_depth,
                                      kv_policy="dense", compute_dtype="float32",
                                      temperature=1.0, method=method)
            return -jnp.sum(lp)
        return jax.grad(loss)(params)["early_exit_gate"]["kernel"]

    assert float(jnp.abs(grads("expected")).max()) > 1e-4
    assert float(jnp.abs(grads("full_depth")).max()) == 0.0


def test_torch_mixture_weights_sum_to_one():
    """The reference's exit distribution is a distribution (guards the mixture oracle)."""
    gate = torch.tensor([[0.3], [0.5], [0.9]])
    remaining, ps = torch.ones(1), []
    for t in range(3):
        ps.append(gate[t] * remaining if t < 2 else remaining)
        remaining = remaining * (1 - gate[t])
    assert torch.allclose(torch.stack(ps).sum(0), torch.ones(1))
    assert [round(float(p), 4) for p in ps] == [0.3, 0.35, 0.35]
