"""`prompt_len_multiple`: prompts left-padded to a multiple of N tokens (so batches of different
prompts share compiled shapes) give the same greedy completions and exit loops."""
import numpy as np
import pytest

from looprl.errors import SamplingError
from looprl.model import init_params, preset
from looprl.sampling.sampler import SamplingConfig, generate, layout_prompts

CFG = preset("tiny")
PROMPTS = [[1, 5, 6, 7, 2, 1], [1, 9, 10, 2, 1]]


def test_layout_rounds_the_prompt_length_up():
    tokens, pad, P, S = layout_prompts(PROMPTS, 4, None, prompt_len_multiple=16)
    assert (P, S) == (16, 20) and pad.tolist() == [10, 11]
    assert tokens[0, 10:16].tolist() == PROMPTS[0] and not tokens[:, :10].any()
    assert layout_prompts(PROMPTS, 4, None)[2] == 6  # default: the longest prompt
    assert layout_prompts(PROMPTS, 4, None, prompt_len_multiple=6)[2] == 6


@pytest.mark.parametrize("kv_policy, dtype", [
    ("deferred", "float32"), pytest.param("dense", "bfloat16", marks=pytest.mark.slow)])
def test_padding_leaves_greedy_completions_and_exits_unchanged(kv_policy, dtype):
    params = init_params(CFG, 0)
    out = {}
    for m in (1, 16):
        scfg = SamplingConfig(max_new_tokens=8, temperature=0.0, exit_threshold=0.6,
                              kv_policy=kv_policy, compute_dtype=dtype, prompt_len_multiple=m)
        b = generate(CFG, params, PROMPTS, scfg)
        P = b.schedule.prompt_len
        out[m] = (P, np.asarray(b.tokens_BxS)[:, P:], np.asarray(b.exit_loop_BxS)[:, P - 1:],
                  np.asarray(b.logprob_BxS)[:, P - 1:])
    assert (out[1][0], out[16][0]) == (6, 16)
    assert np.array_equal(out[1][1], out[16][1]) and np.array_equal(out[1][2], out[16][2])
    assert np.any((out[1][2] > 0) & (out[1][2] < CFG.total_ut_steps))  # some early exits
    # fp32: attention sums over a longer cache, so log-probs may move in the last bits only
    np.testing.assert_allclose(out[1][3], out[16][3], atol=1e-6)


def test_bad_multiple_is_a_sampling_error():
    with pytest.raises(SamplingError, match="prompt_len_multiple"):
        SamplingConfig(prompt_len_multiple=0).validate(4)
