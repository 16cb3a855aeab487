"""A dataset's train stream (`looprl.tasks.base.ShuffledStream`): seeded epochs, resumable."""
import random

import pytest

from looprl.errors import ConfigError
from looprl.tasks.base import TRAIN, Problem, ShuffledStream, without_held_out


def _problems(n):
    return [Problem(i, TRAIN, f"q{i}", str(i)) for i in range(n)]


def test_shuffled_stream_cycles_seeded_epochs_from_any_position():
    """Each epoch is the whole list in `random.Random(seed * 1_000_003 + epoch)`'s order; a
    fresh stream read from the middle gives the same problems (a resumed run's data)."""
    stream = ShuffledStream(_problems(5), seed=3)
    ids = [stream[i].id for i in range(12)]
    for epoch in range(2):
        order = list(range(5))
        random.Random(3 * 1_000_003 + epoch).shuffle(order)
        assert ids[5 * epoch:5 * epoch + 5] == order
    assert sorted(ids[:5]) == sorted(ids[5:10]) == list(range(5)) and ids[:5] != ids[5:10]
    assert [ShuffledStream(_problems(5), seed=3)[i].id for i in range(7, 12)] == ids[7:]
    with pytest.raises(ConfigError, match="must be >= 0"):
        stream[-1]


def test_held_out_prompts_leave_the_train_list_whatever_their_spacing():
    train = _problems(4)
    held = [Problem(0, "eval", " q1 ", "1"), Problem(1, "eval", "q3", "3")]
    assert [p.id for p in without_held_out(train, held)] == [0, 2]
