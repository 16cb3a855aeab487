"""GRPO steps with each loss, and batches with little or no signal (looprl.rl.signal): reward
scaling, truncated completions, the skipped step, and the step metrics beside them."""
import math
import zlib
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from looprl.config import apply_overrides, load_experiment
from looprl.errors import ConfigError
from looprl.model.config import from_model_section
from looprl.model.looped import init_params
from looprl.rl.learner import GRPOLearner
from looprl.rl.signal import has_signal, step_advantages, truncated_rows
from looprl.train.setup import build_tasks

SMOKE = Path(__file__).resolve().parents[2] / "experiments" / "tiny_arith_smoke.py"
SMALL = ["prompts_per_step=2", "group_size=4", "rollout.max_new_tokens=4",
         "learner.minibatches=1", "learner.microbatch_size=0", "learner.measure_stock=false"]


def _crc_reward(problem, text):  # varies within groups: nonzero advantages
    return float(zlib.crc32(text.encode()) % 2)


def _learner(*overrides, reward=_crc_reward):
    cfg = apply_overrides(load_experiment(SMOKE), SMALL + list(overrides))
    mcfg = from_model_section(cfg.model)
    _, task = build_tasks(cfg)
    task.reward = reward
    return GRPOLearner(cfg, mcfg, init_params(mcfg, 0), task, task.tokenizer())


def _bits(tree):
    return [(np.asarray(x).dtype.str, np.asarray(x).tobytes()) for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("overrides", [
    ["grpo.loss=cispo", "grpo.cispo_clip_high=5.0"],
    ["grpo.loss=gspo", "grpo.eps_low=0.0003", "grpo.eps_high=0.0004"],
    ["grpo.loss=gspo-token", "grpo.loss_agg=seq-mean-token-mean"],
    ["grpo.loss=cispo", "grpo.kl_beta=0.1", "grpo.tis_cap=2.0", "learner.ppo_epochs=2"],
], ids=["cispo", "gspo", "gspo-token", "cispo-kl-tis"])
def test_one_grpo_step_per_loss(overrides):
    learner = _learner(*overrides)
    before = _bits(learner.params)
    m = learner.step(0)
    assert all(math.isfinite(v) for k, v in m.items()
               if isinstance(v, float) and k != "stock_max_abs_diff"), m
    assert m["grad_norm"] > 0 and m["update_skipped"] is False
    assert m["ratio_min"] <= 1.0 <= m["ratio_max"]  # hybrid: exactly 1 at the first update
    assert before != _bits(learner.params)
    if "grpo.tis_cap=2.0" in overrides:
        assert m["tis_weight_mean"] == 1.0 and m["is_weight_clipped_frac"] == 0.0


def test_on_policy_cispo_and_ppo_clip_take_the_same_steps_to_the_bit():
    """One update per rollout with exact replay: every ratio is exactly 1, so PPO-clip's
    gradient `A grad log pi` and CISPO's `sg(1) A grad log pi` are the same arithmetic, and two
    steps give the same gradient norms and parameters bit for bit. The control: a learner that
    ignores the schedule (`full_depth`, old log-probs from the sampler) sees ratios off 1, where
    CISPO's weight and PPO's clip act differently."""
    out = {}
    for method in ("hybrid", "full_depth"):
        for loss in ("ppo-clip", "cispo"):
            learner = _learner(f"grpo.loss={loss}", "learner.ppo_epochs=1",
                               f"learner.logprob_method={method}")
            ms = [learner.step(i) for i in range(2)]
            out[method, loss] = ([m["grad_norm"] for m in ms], _bits(learner.params))
            exact = all(m["ratio_min"] == m["ratio_max"] == 1.0 for m in ms)
            assert exact == (method == "hybrid"), [(m["ratio_min"], m["ratio_max"]) for m in ms]
    assert out["hybrid", "ppo-clip"] == out["hybrid", "cispo"]
    assert out["full_depth", "ppo-clip"][0] != out["full_depth", "cispo"][0]


def test_a_step_without_signal_leaves_params_and_both_adam_moments_bit_identical():
    """Step 0 trains (moments nonzero); step 1's rewards are all equal. With the skip, params,
    both moments and the step count keep their bits; without it, Adam's momentum moves them."""
    flip = {"on": True}

    def reward(problem, text):
        return _crc_reward(problem, text) if flip["on"] else 1.0

    states = {}
    for skip in (True, False):
        flip["on"] = True
        learner = _learner(f"grpo.skip_zero_advantage_steps={skip}", reward=reward)
        assert learner.step(0)["grad_norm"] > 0
        before = (_bits(learner.params), _bits(learner.opt_state))
        flip["on"] = False
        m = learner.step(1)
        assert m["zero_std_fraction"] == 1.0 and m["degenerate_groups"] == 2
        states[skip] = (before, (_bits(learner.params), _bits(learner.opt_state)), m)
    (p0, o0), (p1, o1), m = states[True]
    assert p0 == p1 and o0 == o1
    assert m["update_skipped"] is True and m["grad_norm"] == 0.0 and m["ratio_mean"] is None
    (p0, o0), (p1, o1), m = states[False]
    assert p0 != p1 and o0 != o1 and m["update_skipped"] is False and m["grad_norm"] == 0.0


def test_step_metrics_entropy_mismatch_and_truncation():
    learner = _learner()
    m = learner.step(0)
    V = learner.model_cfg.vocab_size
    assert 0.0 < m["token_entropy"] <= math.log(V)
    # hybrid, checked step: the learner's own log-probs are the sampler's bits
    assert (m["logp_diff_mean"], m["logp_diff_max"]) == (0.0, 0.0)
    assert (m["is_weight_mean"], m["is_weight_max"]) == (1.0, 1.0)
    assert m["is_weight_clipped_frac"] is None  # no tis_cap
    assert 0.0 <= m["truncated_fraction"] <= 1.0 and 0.0 <= m["zero_std_fraction"] <= 1.0
    # top-k 1 samples from a point mass: entropy exactly 0
    assert _learner("rollout.top_k=1").step(0)["token_entropy"] == 0.0


def test_mask_truncated_takes_truncated_completions_out_of_the_loss():
    """max_new_tokens 1: a completion is cut unless its one token is the stop token. Masked,
    the loss sees only the others; with none left the step has no signal and is skipped."""
    base = ["rollout.max_new_tokens=1", "prompts_per_step=4"]
    m_all = _learner(*base).step(0)
    learner = _learner(*base, "grpo.mask_truncated=true")
    m = learner.step(0)
    assert m["truncated_fraction"] == m_all["truncated_fraction"] > 0.5
    assert m["update_skipped"] is True and m_all["update_skipped"] is False


def _fake_batch(tokens, lens, P=2, stop=(2,)):
    return SimpleNamespace(tokens_BxS=np.asarray(tokens), completion_len_B=np.asarray(lens),
                           schedule=SimpleNamespace(prompt_len=P, stop_ids=stop))


def test_truncated_rows_are_those_not_ending_on_a_stop_token():
    toks = [[5, 6, 7, 2, 0], [5, 6, 7, 8, 9], [5, 6, 2, 0, 0], [5, 6, 7, 8, 2]]
    np.testing.assert_array_equal(truncated_rows(_fake_batch(toks, [2, 3, 1, 3])),
                                  [False, True, False, False])
    np.testing.assert_array_equal(truncated_rows(_fake_batch(toks, [0, 2, 1, 2])),
                                  [True, True, False, True])
    assert has_signal([0.0, 1.0], [True, False]) is False and has_signal([0.0, -1.0]) is True


def test_scale_rewards_group_batch_none_hand_values():
    r = jnp.array([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    group = step_advantages(r, "group").advantages_NxG
    np.testing.assert_array_equal(group, [[1.5, -0.5, -0.5, -0.5], [0, 0, 0, 0]])
    none = step_advantages(r, "none").advantages_NxG
    np.testing.assert_array_equal(none, [[0.75, -0.25, -0.25, -0.25], [0, 0, 0, 0]])
    # batch std (ddof 1) of [1,0,0,0,1,1,1,1]: mean 5/8, var (5 * 9/64 + 3 * 25/64) / 7 = 15/56
    batch = step_advantages(r, "batch").advantages_NxG
    std = math.sqrt(15 / 56)
    np.testing.assert_allclose(batch, [[0.75 / std, -0.25 / std, -0.25 / std, -0.25 / std],
                                       [0, 0, 0, 0]], rtol=1e-6)
    assert np.all(step_advantages(jnp.ones((2, 3)), "batch").advantages_NxG == 0)
    with pytest.raises(ValueError, match="unknown scale_rewards 'std'"):
        step_advantages(r, "std")


def test_grpo_config_rejects_bad_new_fields():
    cfg = load_experiment(SMOKE)
    with pytest.raises(ConfigError, match="grpo.loss"):
        apply_overrides(cfg, ["grpo.loss=ppo"])
    with pytest.raises(ConfigError, match="grpo.cispo_clip_low"):
        apply_overrides(cfg, ["grpo.cispo_clip_low=6.0"])
    with pytest.raises(ConfigError, match="grpo.scale_adv_by_std"):
        apply_overrides(cfg, ["grpo.scale_rewards=batch", "grpo.scale_adv_by_std=false"])


def _half_flat_reward(problem, text):
    """Equal rewards (no signal) for problems with an even id; varying ones for odd ids."""
    return 1.0 if problem.id % 2 == 0 else _crc_reward(problem, text)


def test_dynamic_sampling_refills_dropped_groups_and_resumes_bit_identically():
    ds = ["grpo.dynamic_sampling=true", "grpo.dynamic_sampling_max_batches=4"]
    run = _learner(*ds, reward=_half_flat_reward)
    m0 = run.step(0)
    assert m0["dynamic_sampling_rounds"] >= 2 and m0["dynamic_sampling_kept"] == 2
    assert m0["dynamic_sampling_resampled"] is True  # the kept rows, sampled again: no drop
    assert m0["degenerate_groups"] == 0 and m0["zero_std_fraction"] == 0.0
    assert run.data_position == 2 * m0["dynamic_sampling_rounds"]
    # interrupted after step 0: a fresh learner restores params and train state, then step 1
    state = {k: v for k, v in run.train_state(1).items()}
    params = jax.tree.map(np.array, run.params)
    state = jax.tree.map(lambda x: np.array(x) if not jax.dtypes.issubdtype(
        getattr(x, "dtype", None), jax.dtypes.prng_key) else x, state)
    resumed = _learner(*ds, reward=_half_flat_reward)
    assert resumed.restore_train_state(params, state) == 1
    m1 = run.step(1)
    r1 = resumed.step(1)
    assert m1["rollout_sha256"] == r1["rollout_sha256"] and m1["grad_norm"] > 0
    assert _bits(run.params) == _bits(resumed.params)
    assert _bits(run.opt_state) == _bits(resumed.opt_state)
    # without dynamic sampling the same first step keeps its no-signal group
    assert _learner(reward=_half_flat_reward).step(0)["degenerate_groups"] >= 1
