"""`looprl.logprobs.mismatch`: the bit-equal fraction and k3 figures shared by the trainer and
`looprl verify`, on hand-computed cases."""
import math

import numpy as np

from looprl.logprobs.mismatch import (bits_equal, bits_equal_fraction, compare_logprobs,
                                     k3_terms, mismatch_stats)
from looprl.verify import matrix


def test_bits_equal_compares_raw_bits_not_values():
    a = np.asarray([[0.0, 1.5, np.nan, 2.0]], np.float32)
    b = np.asarray([[-0.0, 1.5, np.nan, 2.0000002]], np.float32)
    mask = np.asarray([[True, True, True, False]])
    np.testing.assert_array_equal(bits_equal(a, b, mask), [False, True, True])
    assert bits_equal_fraction(a, b, mask) == 2 / 3
    assert bits_equal_fraction(a, b, np.zeros_like(mask)) == 1.0


def test_k3_terms_are_expm1_minus_x():
    np.testing.assert_array_equal(k3_terms([0.0]), [0.0])
    assert k3_terms([math.log(2.0)])[0] == 2.0 - 1.0 - math.log(2.0)


def test_compare_logprobs_on_a_hand_checked_case_and_verify_uses_it():
    lp = np.asarray([[-1.0, -2.0, -3.0]], np.float32)
    ref = np.asarray([[-1.0, -2.5, -9.0]], np.float32)
    mask = np.asarray([[True, True, False]])
    got = compare_logprobs(lp, ref, mask)
    x = -0.5  # ref - lp at the one differing token
    assert got == {"exact_fraction": 0.5, "max_abs_diff": 0.5, "mean_abs_diff": 0.25,
                   "k3_kl": (math.expm1(x) - x) / 2}
    assert compare_logprobs(lp, ref, np.zeros_like(mask))["exact_fraction"] == 0.0
    assert matrix.compare_logprobs is compare_logprobs


def test_mismatch_stats_k3_is_of_learner_minus_sampler():
    learner = np.asarray([[-1.0, -2.0]], np.float32)
    sampler = np.asarray([[-1.5, -2.0]], np.float32)
    s = mismatch_stats(learner, sampler, np.ones((1, 2), bool), eps_low=0.2, eps_high=0.28)
    assert s["mismatch_k3_kl"] == (math.expm1(0.5) - 0.5) / 2
    assert s["ratio_outside_clip_frac"] == 0.5  # exp(0.5) = 1.65 > 1.28
