"""looprl.legacy: older files read as today's format means them."""
import json
from pathlib import Path

import numpy as np
import pytest

from looprl import legacy
from looprl.sampling.schedule import READABLE_VERSIONS, RolloutBatch, Schedule

ROLLOUTS = Path(__file__).resolve().parents[1] / "reproducibility"
FIELDS = {"kv_policy": "deferred", "exit_threshold": 0.9, "fixed_depth": None,
          "deferred_max_pending": 4, "chunk_size": 5, "prompt_len": 4, "seq_len": 8,
          "batch_size": 1, "total_ut_steps": 4, "compute_dtype": "float32", "temperature": 1.0,
          "top_k": 0, "top_p": 1.0, "seed": 0, "step": 0, "params_fingerprint": "x"}


def test_a_version_1_schedule_means_one_device_no_compaction_and_layout_keying():
    s = Schedule.from_dict(FIELDS, version=1)
    assert (s.devices, s.mesh, s.row_menu, s.window_widths) == (1, None, (), ())
    assert (s.noise_keying, s.kernel_version, s.stop_ids, s.kernels) == (
        "layout", "", (2,), "invariant")


def test_a_version_2_schedule_with_compaction_had_two_pass_widths():
    """The position alone and the window, the window cut at the sequence length."""
    assert Schedule.from_dict({**FIELDS, "row_menu": [1, 2]}, version=2).window_widths == (1, 5)
    short = {**FIELDS, "row_menu": [1], "seq_len": 3}
    assert Schedule.from_dict(short, version=2).window_widths == (1, 3)
    assert Schedule.from_dict(FIELDS, version=2).window_widths == ()  # no compaction


def test_a_current_schedule_keeps_what_it_records():
    d = {**FIELDS, "row_menu": [1, 2], "window_widths": [1, 2, 4], "noise_keying": "completion"}
    s = Schedule.from_dict(d)
    assert (s.window_widths, s.noise_keying) == ((1, 2, 4), "completion")


def test_readable_versions_are_the_old_ones_and_the_writers():
    assert READABLE_VERSIONS == (1, 2, 3, 4)
    assert legacy.OLD_SCHEDULE_VERSIONS == (1, 2, 3)


@pytest.mark.parametrize("path", sorted(ROLLOUTS.glob("*/rollouts/*_dense.npz")),
                         ids=lambda p: f"{p.parent.parent.name}/{p.name}")
def test_committed_rollouts_load_with_window_widths_matching_loop_rows(path):
    with np.load(path) as z:
        version = json.loads(str(z["meta"]))["format_version"]
    batch = RolloutBatch.load(path)
    assert version in READABLE_VERSIONS
    assert len(batch.schedule.window_widths) == np.asarray(batch.loop_rows).shape[-1]


def test_an_old_config_key_and_an_absent_key_mean_what_they_meant():
    assert legacy.RENAMED["rollout"]["fixed_exit_loop"] == "fixed_depth"
    assert legacy.CONFIG_KEYS_ABSENT["rollout"]["noise_keying"] == "layout"


def test_a_checkpoint_without_digests_records_nothing_to_compare():
    assert legacy.checkpoint_records({"format": "looprl-checkpoint", "version": 1}) == (
        {}, {}, None)
    meta = {"files": {"a": 1}, "file_sha256": {"a": "f" * 64}, "params_sha256": "e" * 64}
    assert legacy.checkpoint_records(meta) == ({"a": 1}, {"a": "f" * 64}, "e" * 64)
