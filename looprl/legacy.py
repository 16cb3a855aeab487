"""Readers of older file formats and config keys, in one place (their history: CHANGELOG.md).

Each reader takes what an older file holds (its JSON as a dict) and returns what it means in
today's format, so the rest of the package reads only today's. A leaf that imports nothing of
looprl, so `config`, `io` and `sampling` all call it.

- Schedule files (`looprl.sampling.schedule`): version 1 has no row compaction, version 2 no
  window widths, version 3 no thinking budget (today's writer still writes 3 for a rollout
  without one); a key added since means what `SCHEDULE_KEYS_ABSENT` says (`schedule_dict`).
- Config files and overrides: old key names (`RENAMED`), and keys whose absence means another
  value than their default (`CONFIG_KEYS_ABSENT`).
- The sampling noise of a file that names no keying is keyed by layout position ("layout").
- Checkpoints without the manifest and digests: nothing to compare (`checkpoint_records`).
"""
from __future__ import annotations

from typing import Any

# --- schedule files -----------------------------------------------------------------------------

OLD_SCHEDULE_VERSIONS = (1, 2, 3)  # format versions read and upgraded here (the writer's is 4)

# the thinking budget's keys (version 4); a schedule without a budget leaves them out
THINKING_KEYS = ("thinking_budget", "answer_budget", "forced_answer_ids", "think_close_ids")

# what a schedule file without the key means: {key: value}
SCHEDULE_KEYS_ABSENT: dict[str, Any] = {
    "devices": 1,
    "backend": "",
    "row_tile": 64,
    "stop_ids": [2],
    "kernels": "invariant",
    "mesh": None,  # one device
    "noise_keying": "layout",
    "kernel_version": "",  # the scanned-rule kernels, before versions were recorded
    "row_menu": [],  # every loop ran the whole batch (version 1: no compaction)
    "window_widths": [],
    "thinking_budget": None,  # no thinking budget (versions 1-3, and version 3 as still written)
    "answer_budget": 0,
    "forced_answer_ids": [],
    "think_close_ids": [],
}


def schedule_dict(d: dict[str, Any], version: int) -> dict[str, Any]:
    """The schedule dict `d` of a file of format `version`, with every key today's format has.

    Keys the file lacks take `SCHEDULE_KEYS_ABSENT`. A version-2 file with row compaction
    recorded two pass widths: the current position alone and the window (chunk size, within the
    sequence; for dense and copy (1, 1), and the second column of their `loop_rows` is zero)."""
    out = {**SCHEDULE_KEYS_ABSENT, **d}
    if version == 2 and out["row_menu"] and "chunk_size" in out and "seq_len" in out:
        out["window_widths"] = [1, min(out["chunk_size"], out["seq_len"])]
    return out


# --- config files and overrides -----------------------------------------------------------------

# keys renamed since configs were written with them: {section: {old name: new name}}; an old key
# in an override or a config file is read as the new one, with a ConfigRenameWarning
RENAMED = {"rollout": {"fixed_exit_loop": "fixed_depth"}}  # the documented --fixed-depth's name

# keys that a config file written before they existed means differently from their default:
# {section: {key: the value such a file implies}}
CONFIG_KEYS_ABSENT = {
    "rollout": {"noise_keying": "layout"},
    "learner": {"seq_bucket": 0},  # the learner on the whole layout, before its live prefix
}


# --- checkpoints --------------------------------------------------------------------------------

def checkpoint_records(meta: dict[str, Any]
                       ) -> tuple[dict[str, int], dict[str, str], str | None]:
    """(file sizes, file SHA-256s, params_sha256) that a checkpoint's `looprl_meta.json`
    records, by relative path; a checkpoint written before the manifest and the digests
    records none of them: ({}, {}, None)."""
    return meta.get("files") or {}, meta.get("file_sha256") or {}, meta.get("params_sha256")
