"""Sampling noise keyed by the token's index in its completion, so a row's samples do
not depend on its batch-mates; the legacy layout-position keying stays for older runs/rollouts."""
import json

import numpy as np
import pytest

from looprl.config import ExperimentConfig, from_json, to_json
from looprl.errors import SamplingError
from looprl.model import init_params, preset
from looprl.sampling.processing import noise_position, row_keys
from looprl.sampling.sampler import SamplingConfig, generate
from looprl.sampling.schedule import Schedule

CFG = preset("tiny")


def test_noise_position_is_the_completion_index():
    # layout position P - 1 emits completion token 0
    assert noise_position("completion", 15, 16) == 0
    assert noise_position("completion", 20, 16) == 5
    assert noise_position("layout", 20, 16) == 20


def test_keys_of_one_completion_token_agree_across_prompt_buckets():
    """The same (seed, step, prompt, sample, completion index) draws the same key whether the
    batch's padded prompt length is 8 or 24."""
    k8 = row_keys(3, 2, np.array([7], np.int32), np.array([1], np.int32),
                  noise_position("completion", 8 - 1 + 4, 8))
    k24 = row_keys(3, 2, np.array([7], np.int32), np.array([1], np.int32),
                   noise_position("completion", 24 - 1 + 4, 24))
    assert np.array_equal(np.asarray(k8), np.asarray(k24))
    k24_layout = row_keys(3, 2, np.array([7], np.int32), np.array([1], np.int32),
                          noise_position("layout", 24 - 1 + 4, 24))
    assert not np.array_equal(np.asarray(k8), np.asarray(k24_layout))


def _tokens(prompt_len_multiple, keying):
    params = init_params(CFG, 0)
    scfg = SamplingConfig(max_new_tokens=12, temperature=1.0, exit_threshold=1.0,
                          prompt_len_multiple=prompt_len_multiple, noise_keying=keying,
                          stop_ids=())
    b = generate(CFG, params, [[1, 5, 6, 7, 2, 1]], scfg, seed=4, prompt_indices=[11])
    P = b.schedule.prompt_len
    assert b.schedule.noise_keying == keying
    return np.asarray(b.tokens_BxS)[0, P:]


@pytest.mark.slow  # 46 s; tests/sampling/test_needle.py samples a prompt in a larger bucket too
def test_a_prompt_draws_the_same_samples_in_a_larger_bucket():
    """Temperature-1 samples of one prompt left-padded to 6 and to 32 tokens: the same tokens
    under completion keying (the tiny model's logits agree to ~1e-6 across the two paddings, far
    below the sampling noise's resolution here), different ones under the legacy keying."""
    assert np.array_equal(_tokens(1, "completion"), _tokens(32, "completion"))
    assert not np.array_equal(_tokens(1, "layout"), _tokens(32, "layout"))


def test_unknown_keying_is_a_sampling_error():
    with pytest.raises(SamplingError, match="noise_keying"):
        SamplingConfig(noise_keying="position").validate(4)


def test_older_files_mean_the_layout_keying():
    """A config.json or a schedule written before the key existed was keyed by layout position;
    a new config defaults to the completion keying."""
    assert ExperimentConfig().rollout.noise_keying == "completion"
    d = json.loads(to_json(ExperimentConfig()))
    del d["rollout"]["noise_keying"]
    assert from_json(json.dumps(d)).rollout.noise_keying == "layout"
    fields = {"kv_policy": "dense", "exit_threshold": 0.9, "fixed_depth": None,
              "deferred_max_pending": 4, "chunk_size": 1, "prompt_len": 4, "seq_len": 8,
              "batch_size": 1, "total_ut_steps": 4, "compute_dtype": "float32",
              "temperature": 1.0, "top_k": 0, "top_p": 1.0, "seed": 0, "step": 0,
              "params_fingerprint": "x"}
    assert Schedule.from_dict(fields).noise_keying == "layout"
    assert Schedule.from_dict({**fields, "noise_keying": "completion"}).noise_keying == \
        "completion"
