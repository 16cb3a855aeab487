"""The mappings into `SamplingConfig`: from an experiment's rollout section and back from a
recorded schedule (a round trip through `generate`)."""
import dataclasses

import numpy as np
import pytest

from looprl.config import RolloutConfig
from looprl.model.config import preset
from looprl.model.looped import init_params
from looprl.sampling.sampler import SamplingConfig, generate

CFG = preset("tiny", vocab_size=32, hidden_size=64, intermediate_size=128, num_heads=2,
             num_kv_heads=2, head_dim=32, num_layers=1)


def test_from_rollout_config_maps_every_field_and_greedy_turns_sampling_off():
    r = RolloutConfig(max_new_tokens=7, temperature=0.7, top_p=0.9, top_k=5, exit_threshold=0.6,
                      fixed_depth=3, kv_policy="deferred", deferred_max_pending=2,
                      prompt_len_multiple=8, kernels="stock", noise_keying="layout")
    s = SamplingConfig.from_rollout_config(r, "bfloat16")
    assert s == SamplingConfig(max_new_tokens=7, temperature=0.7, top_k=5, top_p=0.9,
                               exit_threshold=0.6, fixed_depth=3, kv_policy="deferred",
                               deferred_max_pending=2, stop_ids=(2,), compute_dtype="bfloat16",
                               prompt_len_multiple=8, kernels="stock", noise_keying="layout")
    g = SamplingConfig.from_rollout_config(r, "float32", greedy=True, exit_threshold=0.8)
    assert (g.temperature, g.top_k, g.top_p, g.exit_threshold) == (0.0, 0, 1.0, 0.8)


SCFG = SamplingConfig(max_new_tokens=5, temperature=0.9, top_k=7, top_p=0.95, exit_threshold=0.7,
                      kv_policy="deferred", deferred_max_pending=2, stop_ids=(3,),
                      compute_dtype="float32")


@pytest.fixture(scope="module")
def rb():
    return generate(CFG, init_params(CFG, 0), [[5, 9, 3], [4, 6]], SCFG, group_size=2, seed=1)


def test_from_schedule_round_trips_what_the_schedule_records(rb):
    back = SamplingConfig.from_schedule(rb.schedule)
    S = rb.schedule.seq_len
    assert back == dataclasses.replace(SCFG, max_seq_len=S)
    assert S - rb.schedule.prompt_len == 5
    # a fixed depth is recorded without a q: the re-run's q is 1.0
    fixed = dataclasses.replace(rb.schedule, exit_threshold=None, fixed_depth=2)
    f = SamplingConfig.from_schedule(fixed)
    assert (f.exit_threshold, f.fixed_depth) == (1.0, 2)


@pytest.mark.slow  # 10 s on 2 cores; forced re-runs from the schedule: tests/verify, tests/rl
def test_the_forced_re_run_through_from_schedule_reproduces_the_logprobs(rb):
    back = SamplingConfig.from_schedule(rb.schedule)
    out = generate(CFG, init_params(CFG, 0), [[0]], back, forced=rb.to_numpy())
    np.testing.assert_array_equal(np.asarray(out.logprob_BxS).view(np.uint32),
                                  np.asarray(rb.logprob_BxS).view(np.uint32))
