"""End to end at the real model's widths (slow): one layer of Ouro-1.4B width (hidden
2048, 16 heads x 128, MLP 5632, the full 49152 vocabulary, T = 4) with a random gate that exits
about half the tokens early. Rollouts of 1, 2, 3, 5, 8 and 64 rows replay bit for bit (the
learner's dense pass under stop_gradient against the sampler's recorded log-probs) for every KV
policy in fp32 and bf16, and the stock control still mismatches, within 1e-4 in fp32.

    python -m pytest tests/logprobs/test_real_width_exact.py -m slow
"""
import numpy as np
import pytest

from looprl.logprobs import batch_logprobs
from looprl.model.config import preset
from looprl.model.looped import init_params
from looprl.sampling.sampler import SamplingConfig, generate

pytestmark = pytest.mark.slow

CFG = preset("ouro-1.4b", num_layers=1)
ROWS = (1, 2, 3, 5, 8, 64)
NEW_TOKENS = 4


@pytest.fixture(scope="module")
def params():
    p = init_params(CFG, 0)
    p["early_exit_gate"]["bias"] = np.zeros_like(np.asarray(p["early_exit_gate"]["bias"]))
    return p


def _prompts(n):
    rng = np.random.default_rng(n)
    return [[int(t) for t in rng.integers(3, CFG.vocab_size, int(rng.integers(4, 12)))]
            for _ in range(n)]


def _bits(a):
    return np.asarray(a, np.float32).view(np.uint32)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("policy", ["dense", "deferred", "copy"])
def test_rollouts_of_every_size_replay_bit_for_bit(params, policy, dtype):
    scfg = SamplingConfig(max_new_tokens=NEW_TOKENS, temperature=1.0, exit_threshold=0.5,
                          kv_policy=policy, compute_dtype=dtype, stop_ids=())
    stock_exact, early = [], []
    for rows in ROWS:
        rb = generate(CFG, params, _prompts(rows), scfg, seed=rows)
        emit = np.asarray(rb.exit_loop_BxS) > 0
        assert emit.sum() == rows * NEW_TOKENS
        early.append(np.asarray(rb.exit_loop_BxS)[emit] < CFG.total_ut_steps)
        replay, _ = batch_logprobs(CFG, params, rb, "replay")
        wrong = int((_bits(replay) != _bits(rb.logprob_BxS))[emit].sum())
        assert wrong == 0, f"{rows} rows: replay differs at {wrong} of {int(emit.sum())} tokens"
        stock, _ = batch_logprobs(CFG, params, rb, "stock")
        diff = np.abs(stock - np.asarray(rb.logprob_BxS))[emit]
        if dtype == "float32":
            assert diff.max() <= 1e-4, f"{rows} rows: stock off by {diff.max():.2e}"
        stock_exact.append(_bits(stock)[emit] == _bits(rb.logprob_BxS)[emit])
    assert np.concatenate(stock_exact).mean() < 1.0  # the negative control can fail
    assert 0.2 <= np.concatenate(early).mean() < 1.0  # early exits and loop-T tokens both
