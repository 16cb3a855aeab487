"""The thinking budget with a forced answer (looprl.sampling.thinking).

A rollout at tiny widths where most completions run out of their budget: the forced answer's
ids are written right after the budget, recorded in `forced_BxS`, followed by at most
`answer_budget` sampled tokens; rows that closed their thinking or stopped first are the
unbudgeted rollout's, token for token. Replay (the learner's dense pass) and a forced re-run
reproduce the recorded log-probs over the whole completion, forced positions included, bit
for bit: dense fp32 in the default suite, every KV policy in fp32 and bf16 under `slow`.
"""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from looprl import legacy
from looprl.errors import SamplingError
from looprl.logprobs import batch_logprobs
from looprl.model.config import preset
from looprl.model.looped import init_params
from looprl.sampling import thinking
from looprl.sampling.sampler import SamplingConfig, generate
from looprl.sampling.schedule import FORMAT_VERSION, RolloutBatch, Schedule

CFG = preset("tiny", vocab_size=32, hidden_size=64, intermediate_size=128, num_heads=2,
             num_kv_heads=2, head_dim=32)
PROMPTS = [[5, 9, 3, 7, 11], [4, 6], [8, 12, 13, 14, 15, 16, 17], [20]]
FORCED, CLOSE, STOP = (30, 31, 29), (7,), (5,)
ANSWER = 3
THINK = dict(max_new_tokens=14, exit_threshold=0.7, stop_ids=STOP, thinking_budget=(4, 6),
             answer_budget=ANSWER, forced_answer_ids=FORCED, think_close_ids=CLOSE)


@pytest.fixture(scope="module")
def params():
    p = init_params(CFG, 0)
    p["early_exit_gate"]["bias"] = jnp.array([-0.3])  # lambda ~ 0.4: exits spread over loops
    return jax.tree.map(np.asarray, p)


@pytest.fixture(scope="module")
def rollout(params):
    return _rollout(params)


def _bits(x):
    return np.asarray(x, np.float32).view(np.uint32)


def _rollout(params, policy="dense", dtype="float32", **kw):
    scfg = SamplingConfig(kv_policy=policy, compute_dtype=dtype, **{**THINK, **kw})
    return generate(CFG, params, PROMPTS, scfg, group_size=4, seed=3, step=1)


def _check_replays(params, rb):
    """Replay and a forced re-run give the recorded log-prob bits at every emitting position,
    the forced ones included."""
    emit = np.asarray(rb.exit_loop_BxS) > 0
    lp, _ = batch_logprobs(CFG, params, rb, "replay")
    assert np.array_equal(_bits(np.where(emit, lp, 0)), _bits(rb.logprob_BxS))
    again = generate(CFG, params, [[0]], SamplingConfig.from_schedule(rb.schedule), forced=rb)
    assert np.array_equal(_bits(again.logprob_BxS), _bits(rb.logprob_BxS))
    np.testing.assert_array_equal(again.forced_BxS, rb.forced_BxS)
    assert again.schedule == rb.schedule


def test_budget_draw_is_a_function_of_seed_and_step_within_its_range():
    draws = [thinking.draw_budget(3, step, 10, 20) for step in range(40)]
    assert draws == [thinking.draw_budget(3, step, 10, 20) for step in range(40)]
    assert min(draws) >= 10 and max(draws) <= 20 and len(set(draws)) >= 5
    assert draws != [thinking.draw_budget(4, step, 10, 20) for step in range(40)]
    assert thinking.draw_budget(3, 7, 12, 12) == 12


def test_interrupted_rows_get_the_forced_answer_then_at_most_the_answer_budget(params,
                                                                               rollout):
    rb = rollout
    plain = generate(CFG, params, PROMPTS, SamplingConfig(
        **{k: v for k, v in THINK.items() if k not in
           ("thinking_budget", "answer_budget", "forced_answer_ids", "think_close_ids")}),
        group_size=4, seed=3, step=1)
    sch = rb.schedule
    budget, P, F = sch.thinking_budget, sch.prompt_len, len(FORCED)
    assert budget == thinking.draw_budget(3, 1, 4, 6)
    assert (sch.answer_budget, sch.forced_answer_ids, sch.think_close_ids) == (ANSWER, FORCED,
                                                                               CLOSE)
    toks, n = np.asarray(rb.tokens_BxS), np.asarray(rb.completion_len_B)
    forced = np.asarray(rb.forced_BxS)
    interrupted = forced.any(axis=1)
    assert interrupted.mean() >= 1 / 3 and not interrupted.all()
    for b in range(len(n)):
        comp = toks[b, P:P + n[b]].tolist()
        if interrupted[b]:
            assert CLOSE[0] not in comp[:budget]  # it had not closed its thinking
            assert comp[budget:budget + F] == list(FORCED)
            want = np.zeros(toks.shape[1], bool)
            want[P + budget - 1:P + budget - 1 + F] = True  # the positions that emitted them
            np.testing.assert_array_equal(forced[b], want)
            assert budget + F <= n[b] <= budget + F + ANSWER
            assert n[b] == budget + F + ANSWER or comp[-1] in STOP
            assert comp[:budget] == toks[b, P:P + budget].tolist()
            np.testing.assert_array_equal(toks[b, :P + budget], plain.tokens_BxS[b, :P + budget])
        else:  # closed or stopped within the budget: the unbudgeted rollout's row
            assert CLOSE[0] in comp[:budget] or (n[b] <= budget and comp[-1] in STOP)
            np.testing.assert_array_equal(toks[b], plain.tokens_BxS[b])
            assert np.array_equal(_bits(rb.logprob_BxS[b]), _bits(plain.logprob_BxS[b]))
    emit = np.asarray(rb.exit_loop_BxS) > 0
    assert np.all(emit[forced])  # forced positions ran their loops and exit rule
    np.testing.assert_array_equal(rb.sampled_mask_BxS, emit & ~forced)
    _check_replays(params, rb)


def test_a_thinking_rollout_file_is_version_4_and_one_without_stays_version_3(rollout,
                                                                              tmp_path):
    rb = rollout
    rb.save(tmp_path / "t.npz")
    back = RolloutBatch.load(tmp_path / "t.npz")
    assert back.schedule == rb.schedule and FORMAT_VERSION == 4
    np.testing.assert_array_equal(back.forced_BxS, rb.forced_BxS)
    with np.load(tmp_path / "t.npz") as z:
        assert json.loads(str(z["meta"]))["format_version"] == 4
    off = dataclasses.replace(rb, forced_BxS=None, schedule=dataclasses.replace(
        rb.schedule, thinking_budget=None, answer_budget=0, forced_answer_ids=(),
        think_close_ids=()))
    off.save(tmp_path / "o.npz")
    with np.load(tmp_path / "o.npz") as z:
        meta = json.loads(str(z["meta"]))
        assert "forced_BxS" not in z.files
    assert meta["format_version"] == 3
    assert not set(legacy.THINKING_KEYS) & set(meta["schedule"])
    assert RolloutBatch.load(tmp_path / "o.npz").forced_BxS is None
    assert Schedule.from_dict(meta["schedule"], 3) == off.schedule


@pytest.mark.parametrize("kw, match", [
    (dict(thinking_budget=(5, 4)), "lo <= hi"),
    (dict(forced_answer_ids=()), "forced_answer_ids"),
    (dict(answer_budget=0), "answer_budget"),
    (dict(forced_answer_ids=(30, 5)), "stop id"),
    (dict(thinking_budget=(4, 9)), "exceed max_new_tokens"),
])
def test_bad_thinking_settings_are_sampling_errors(params, kw, match):
    with pytest.raises(SamplingError, match=match):
        _rollout(params, **kw)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("policy", ["dense", "deferred", "copy"])
def test_every_policy_and_dtype_replays_an_interrupted_rollout_exactly(params, policy, dtype):
    rb = _rollout(params, policy, dtype)
    assert np.asarray(rb.forced_BxS).any(axis=1).mean() >= 1 / 3
    if policy == "deferred":
        assert np.asarray(rb.flush_BxS).any()
    _check_replays(params, rb)
