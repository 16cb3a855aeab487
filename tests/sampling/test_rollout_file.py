"""`RolloutBatch.load` on damaged files: a ScheduleError naming the file, never a bare zipfile /
zlib / EOF error."""
import json

import numpy as np
import pytest

from looprl.errors import ScheduleError
from looprl.sampling.schedule import RolloutBatch


def _npz(path, compressed=False):
    save = np.savez_compressed if compressed else np.savez
    save(path, meta=np.asarray(json.dumps({"format_version": 1})), x=np.arange(1000.0))
    return path.read_bytes()


@pytest.mark.parametrize("damage", ["truncated", "empty", "flipped", "flipped_compressed"])
def test_damaged_rollout_file_is_a_schedule_error_naming_it(tmp_path, damage):
    raw = _npz(tmp_path / "src.npz", compressed=damage.endswith("compressed"))
    data = {"truncated": raw[:len(raw) // 2], "empty": b"",
            "flipped": raw[:200] + bytes(b ^ 0xFF for b in raw[200:400]) + raw[400:]}
    data["flipped_compressed"] = data["flipped"]
    bad = tmp_path / f"{damage}.npz"
    bad.write_bytes(data[damage])
    with pytest.raises(ScheduleError, match=f"{damage}.npz: cannot read rollout file"):
        RolloutBatch.load(bad)


def test_npz_without_meta_or_with_bad_meta_is_not_a_rollout(tmp_path):
    np.savez(tmp_path / "a.npz", x=np.arange(3))
    with pytest.raises(ScheduleError, match="a.npz: not a looprl rollout file"):
        RolloutBatch.load(tmp_path / "a.npz")
    np.savez(tmp_path / "b.npz", meta=np.asarray("{not json"))
    with pytest.raises(ScheduleError, match="b.npz: cannot read rollout file"):
        RolloutBatch.load(tmp_path / "b.npz")


def test_missing_rollout_file_names_it(tmp_path):
    with pytest.raises(ScheduleError, match="nope.npz"):
        RolloutBatch.load(tmp_path / "nope.npz")
