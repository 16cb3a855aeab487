"""The needle test: a row's bits depend on nothing but that row. A prompt sampled
alone, and the same prompt (same dataset index, seed and step) inside a batch (a) whose prompts
fit the same prompt bucket and (b) with a longer batch-mate that moves the batch to a larger
bucket (more left padding, a longer KV cache), draws the same tokens and exit loops and the same
log-prob bits under temperature-1 sampling, for every KV policy, in fp32 and bf16. The default
suite runs `deferred` in fp32 (the policy with the most ways to group work: pending windows and
flushes); the other five cases are under `-m slow` (dense and copy in fp32 took 54 and 29 s,
the bf16 cases 112 s together, on 2-core hosts; bf16 replay is covered by the default suite's
tests/logprobs/test_logprobs.py).

This needs all three of: noise keyed by the completion index (not the padded position), row-
invariant matmuls (the batch size changes every dot's row count) and attention whose key blocks
are cut at key positions (the pad offset moves the live keys)."""
import numpy as np
import pytest

from looprl.model import init_params, preset
from looprl.sampling.sampler import SamplingConfig, generate

CFG = preset("tiny", num_layers=1)
NEEDLE = [1, 14, 7, 9, 22, 3, 2, 1]  # 8 tokens
SHORTER = [[1, 5, 6, 2, 1], [1, 30, 31, 32, 2, 1]]  # batch-mates of the same 16-token bucket
LONGER = [1] + list(range(3, 40)) + [2, 1]  # 40 tokens: the batch moves to the 48 bucket
# 100 tokens: the 112 bucket, where the needle's 8 prompt + 24 new keys sit at cache slots
# 104..135, across the 128 boundary of a 128-key block of the cache (unlike alone: 8..39)
STRADDLE = [1] + [3 + (i % 50) for i in range(97)] + [2, 1]
NEEDLE_ID = 1234


def _needle(prompts, index, policy, dtype):
    ids = [NEEDLE_ID if i == index else 10 + i for i in range(len(prompts))]
    scfg = SamplingConfig(max_new_tokens=24, temperature=1.0, exit_threshold=0.55,
                          kv_policy=policy, compute_dtype=dtype, stop_ids=(),
                          prompt_len_multiple=16)
    b = generate(CFG, init_params(CFG, 0), prompts, scfg, seed=3, step=2, prompt_indices=ids)
    P = b.schedule.prompt_len
    return (P, np.asarray(b.tokens_BxS)[index, P:], np.asarray(b.exit_loop_BxS)[index, P - 1:],
            np.asarray(b.logprob_BxS, np.float32)[index, P - 1:].view(np.uint32))


@pytest.mark.parametrize("policy, dtype", [
    pytest.param(p, d, marks=[] if (p, d) == ("deferred", "float32") else [pytest.mark.slow])
    for d in ("float32", "bfloat16") for p in ("dense", "deferred", "copy")])
def test_a_prompt_alone_and_in_a_batch_draws_the_same_bits(policy, dtype):
    alone = _needle([NEEDLE], 0, policy, dtype)
    same_bucket = _needle([SHORTER[0], NEEDLE, SHORTER[1]], 1, policy, dtype)
    larger_bucket = _needle([LONGER, SHORTER[0], NEEDLE], 2, policy, dtype)
    straddling = _needle([NEEDLE, STRADDLE], 0, policy, dtype)
    assert (alone[0], same_bucket[0], larger_bucket[0], straddling[0]) == (16, 16, 48, 112)
    exits = alone[2][alone[2] > 0]
    assert np.any(exits < CFG.total_ut_steps)  # some tokens exit early
    for other in (same_bucket, larger_bucket, straddling):
        assert np.array_equal(alone[1], other[1]), "tokens differ"
        assert np.array_equal(alone[2], other[2]), "exit loops differ"
        assert np.array_equal(alone[3], other[3]), "log-prob bits differ"
