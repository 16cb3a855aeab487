"""The learner on a rollout's live prefix (`live_seq_len`, `batch_logprobs(seq_len=)`): the same
bits at every emitting position as the whole recorded length, and as the sampler (raw fp32 bits,
as uint32), with the key axis cut from two 128-key blocks to one (looprl.logprobs.methods,
module doc)."""
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from looprl.logprobs import batch_logprobs, live_seq_len
from looprl.model.config import preset
from looprl.model.looped import init_params
from looprl.sampling.sampler import SamplingConfig, generate
from looprl.verify.matrix import compare_logprobs

CFG = preset("tiny", vocab_size=32, hidden_size=64, intermediate_size=128, num_heads=2,
             num_kv_heads=2, head_dim=32)  # tests/logprobs/test_logprobs.py's model
PROMPTS = [[5, 9, 3, 7, 11], [4, 6, 8]]
MAX_NEW = 150  # S = 155: a 256-slot key axis; the live prefix fits one 128-key block
STOP = (2, 17)  # 2 of 32 ids stop a row: completions end long before MAX_NEW
BUCKET = 16


@pytest.fixture(scope="module")
def params():
    p = init_params(CFG, 0)
    p["early_exit_gate"]["bias"] = jnp.array([-0.3])  # lambda ~ 0.4: most tokens exit early
    return jax.tree.map(np.asarray, p)


def test_live_seq_len_rounds_the_longest_completion_up_to_the_bucket():
    def batch(lens, P=5, S=155):
        return types.SimpleNamespace(schedule=types.SimpleNamespace(seq_len=S, prompt_len=P),
                                     completion_len_B=np.asarray(lens))
    assert live_seq_len(batch([3, 17, 9]), 16) == 5 + 32
    assert live_seq_len(batch([16]), 16) == 5 + 16
    assert live_seq_len(batch([0, 0]), 16) == 5 + 16  # nothing emitted: one bucket
    assert live_seq_len(batch([140]), 64) == 155  # never past the layout
    assert live_seq_len(batch([3]), 0) == 155  # 0: off


CELLS = [pytest.param(d, p, marks=[] if (d, p) in {("float32", "copy"), ("bfloat16", "deferred")}
                      else [pytest.mark.slow])  # dense: the kernels' masked-key argument alone
         for d in ("float32", "bfloat16") for p in ("dense", "deferred", "copy")]


@pytest.mark.parametrize("dtype, policy", CELLS)
def test_live_prefix_gives_the_sampler_bits(params, dtype, policy):
    scfg = SamplingConfig(max_new_tokens=MAX_NEW, exit_threshold=0.6, kv_policy=policy,
                          compute_dtype=dtype, deferred_max_pending=3, stop_ids=STOP)
    rb = generate(CFG, params, PROMPTS, scfg, group_size=2, seed=1)
    S, P = rb.schedule.seq_len, rb.schedule.prompt_len
    live = live_seq_len(rb, BUCKET)
    assert S == P + MAX_NEW and live <= 128 < S  # one key block instead of two
    mask = np.asarray(rb.exit_loop_BxS) > 0
    assert mask.sum() >= 20 and not mask[:, live - 1:].any()
    lp, lpp = batch_logprobs(CFG, params, rb, "replay", seq_len=live)
    assert lp.shape == (4, S) and not lp[:, live:].any()  # padded back with zeros
    assert compare_logprobs(lp, rb.logprob_BxS, mask)["exact_fraction"] == 1.0
    assert compare_logprobs(lpp, rb.logprob_processed_BxS, mask)["exact_fraction"] == 1.0
    whole, _ = batch_logprobs(CFG, params, rb, "replay")
    assert np.array_equal(lp.view(np.uint32), np.asarray(whole, np.float32).view(np.uint32))


def test_seq_len_outside_the_layout_is_refused(params):
    scfg = SamplingConfig(max_new_tokens=4, exit_threshold=0.6, stop_ids=())
    rb = generate(CFG, params, PROMPTS[:1], scfg, seed=1)
    for bad in (rb.schedule.prompt_len, rb.schedule.seq_len + 1):
        with pytest.raises(ValueError, match=f"seq_len {bad}"):
            batch_logprobs(CFG, params, rb, "replay", seq_len=bad)
