"""The recorded rollout: tokens, masks, behaviour log-probs and the dynamic **schedule**.

Layout (docs/DESIGN.md §3): rows are left-padded to a common prompt length P; row b's prompt
occupies layout indices [pad_b, P) and its completion [P, P + n_b). Position i emits token i + 1,
so per-position arrays are aligned to the *emitting* position: `exit_loop_BxS[:, i]` is the loop
whose logits emitted `tokens_BxS[:, i + 1]`, `logprob_BxS[:, i]` its log-prob; 0 where nothing is
emitted (earlier prompt positions, padding, after EOS).

The schedule is everything dynamic that determined the numbers: exit loops, the KV policy and
its deferred flushes, how work was grouped (chunk size, batch shape, padding, the compaction's
`row_menu` and `window_widths`, and the rows each pass ran, `RolloutBatch.loop_rows`
`[1, S, T, W]`), the devices, mesh and shardings, the compute dtype, the sampler's kernels
(`invariant`, reproduced by the learner's dense pass; `stock`, only by a forced re-run) and a
fingerprint of the sampler's parameters (`looprl.sampling.fingerprint.params_fingerprint`,
re-exported here). The learner never re-decides any of it. With the row-invariant kernels the
compaction's sizes change no bit; a forced re-run on the recorded rows per device reuses them.

On disk (`save`/`load`): one `.npz` file of the arrays and a JSON `meta` string with
`format_version` (`FORMAT_VERSION`; the older `READABLE_VERSIONS` still load) and the schedule.
"""
from __future__ import annotations

import dataclasses
import json
import zipfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from looprl import legacy
from looprl.errors import ScheduleError

__all__ = ["FORMAT_VERSION", "READABLE_VERSIONS", "RolloutBatch", "Schedule"]

FORMAT_VERSION = 4  # written for a rollout with a thinking budget; others are written as 3
READABLE_VERSIONS = (*legacy.OLD_SCHEDULE_VERSIONS, FORMAT_VERSION)  # older ones: looprl.legacy

_ARRAYS = ("tokens_BxS", "pad_B", "exit_loop_BxS", "logprob_BxS", "logprob_processed_BxS",
           "flush_BxS", "prompt_index_B", "sample_index_B", "completion_len_B")


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The non-array part of a rollout's schedule (see module docstring)."""
    kv_policy: str
    exit_threshold: float | None  # q of the Q-exit rule (None with fixed depth)
    fixed_depth: int | None
    deferred_max_pending: int
    chunk_size: int  # positions per decode chunk (the KV policy's `chunk_size`)
    prompt_len: int  # P
    seq_len: int  # S = P + max_new_tokens
    batch_size: int  # B rows
    total_ut_steps: int
    compute_dtype: str
    temperature: float
    top_k: int
    top_p: float
    seed: int
    step: int
    params_fingerprint: str
    devices: int = 1
    backend: str = ""
    row_tile: int = 64
    stop_ids: tuple[int, ...] = (2,)
    kernels: str = "invariant"  # the sampler's kernels: "invariant" or "stock" (replay = forced)
    # where it ran (`looprl.distributed.mesh.mesh_record`): axis sizes, devices, processes, the
    # row split and parameter shardings; None in files written before meshes (one device)
    mesh: dict[str, Any] | None = None
    # what keyed the sampling noise (`looprl.sampling.processing.noise_position`); older files
    # lack it and were keyed by layout position
    noise_keying: str = "layout"
    # the invariant kernels' version (`looprl.kernels.kernel_version()`: the CPU's, with
    # the sgemm ISA when it is not AVX-512, or the accelerator form) the rollout was sampled
    # with; "" in older files (the scanned-rule kernels)
    kernel_version: str = ""
    # the sub-batch sizes of row compaction (`looprl.sampling.compaction.row_menu`); () when
    # every loop ran the whole batch (compaction off, or files of format version 1)
    row_menu: tuple[int, ...] = ()
    # the width of each column of `RolloutBatch.loop_rows`: the positions a decode loop's pass
    # ran per row (the KV policy's `window_widths`); () without compaction
    window_widths: tuple[int, ...] = ()
    # the thinking budget (`looprl.sampling.thinking`): this step's drawn budget (None: off),
    # the answer budget, the forced answer's and the thinking close's token ids
    thinking_budget: int | None = None
    answer_budget: int = 0
    forced_answer_ids: tuple[int, ...] = ()
    think_close_ids: tuple[int, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """The JSON form; without a thinking budget its keys are left out (format 3's form)."""
        d = {k: list(v) if k in _TUPLES else v for k, v in dataclasses.asdict(self).items()}
        off = legacy.THINKING_KEYS if self.thinking_budget is None else ()
        return {k: v for k, v in d.items() if k not in off}

    @classmethod
    def from_dict(cls, d: dict[str, Any], version: int = FORMAT_VERSION) -> "Schedule":
        """The schedule of a file of format `version` (older ones read by `looprl.legacy`).
        Raises ScheduleError naming the keys it lacks."""
        d = legacy.schedule_dict(d, version)
        known = {f.name for f in dataclasses.fields(cls)}
        missing = sorted(known - set(d))
        if missing:
            raise ScheduleError(f"schedule meta is missing keys {missing}")
        d = {k: v for k, v in d.items() if k in known}
        for key in _TUPLES:
            if key in d:
                d[key] = tuple(d[key])
        return cls(**d)


_ALL = (*_ARRAYS, "loop_rows", "forced_BxS")
_TUPLES = ("stop_ids", "row_menu", "window_widths", "forced_answer_ids", "think_close_ids")


@dataclasses.dataclass
class RolloutBatch:
    """A batch of rollouts with its schedule. Arrays are numpy or jax arrays:

    tokens_BxS int32, pad_B int32 (left padding; prompt length = P - pad_b),
    exit_loop_BxS int32 (1..T at emitting positions, else 0), logprob_BxS fp32 (full-vocabulary,
    temperature-scaled, at the exit loop), logprob_processed_BxS fp32 (after top-k/top-p; equal to
    logprob_BxS when truncation is off), flush_BxS bool (deferred: positions whose step was forced
    to run every loop), prompt_index_B / sample_index_B int32, completion_len_B int32 (tokens
    emitted, stop token included), forced_BxS bool or None (emitting positions whose token was
    teacher-forced by the thinking budget, `looprl.sampling.thinking`; None: none was).
    """
    tokens_BxS: Any
    pad_B: Any
    exit_loop_BxS: Any
    logprob_BxS: Any
    logprob_processed_BxS: Any
    flush_BxS: Any
    prompt_index_B: Any
    sample_index_B: Any
    completion_len_B: Any
    schedule: Schedule
    loop_rows: Any = None
    forced_BxS: Any = None

    @property
    def emit_mask_BxS(self):
        """True at positions that emitted a completion token (exit_loop > 0)."""
        return self.exit_loop_BxS > 0

    @property
    def sampled_mask_BxS(self):
        """numpy bool [B, S]: emitting positions whose token was sampled, not forced: what the
        loss and every log-prob claim count."""
        emit = np.asarray(self.exit_loop_BxS) > 0
        return emit if self.forced_BxS is None else emit & ~np.asarray(self.forced_BxS, bool)

    @property
    def completion_mask_BxS(self):
        """True at layout indices holding completion tokens (stop token included)."""
        S, P = self.schedule.seq_len, self.schedule.prompt_len
        idx = np.arange(S)[None, :]
        n = np.asarray(self.completion_len_B)[:, None]
        return (idx >= P) & (idx < P + n)

    def kv_depth_BxS(self):
        """Loops whose KV each position computed itself: T for prompt positions, the exit loop for
        completion positions (used by the `copy` policy's learner)."""
        T, P = self.schedule.total_ut_steps, self.schedule.prompt_len
        idx = np.arange(self.schedule.seq_len)[None, :]
        return np.where(idx < P, T, np.maximum(np.asarray(self.exit_loop_BxS), 1)).astype(np.int32)

    def select(self, rows) -> "RolloutBatch":
        """The rows `rows` (indices, any order) as a new batch with the same layout."""
        rows = np.asarray(rows)
        arrays = {k: np.asarray(getattr(self, k))[rows] for k in _ARRAYS}
        sched = dataclasses.replace(self.schedule, batch_size=int(len(rows)))
        forced = None if self.forced_BxS is None else np.asarray(self.forced_BxS)[rows]
        return RolloutBatch(**arrays, schedule=sched, forced_BxS=forced)

    def without_logprobs(self) -> "RolloutBatch":
        """A copy whose recorded log-probs are NaN (so a replay cannot return stored numbers)."""
        nan = np.full(np.shape(self.logprob_BxS), np.nan, np.float32)
        return dataclasses.replace(self, logprob_BxS=nan, logprob_processed_BxS=nan.copy())

    def to_numpy(self) -> "RolloutBatch":
        return dataclasses.replace(self, **{k: None if getattr(self, k) is None else
                                            np.asarray(getattr(self, k)) for k in _ALL})

    def save(self, path: str | Path) -> None:
        """Write one `.npz` (arrays + JSON meta with `format_version`); atomic via rename."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp.npz")
        arrays = {k: np.asarray(getattr(self, k)) for k in _ARRAYS}
        if self.loop_rows is not None:
            arrays["loop_rows"] = np.asarray(self.loop_rows)
        if self.forced_BxS is not None:
            arrays["forced_BxS"] = np.asarray(self.forced_BxS, bool)
        version = FORMAT_VERSION if self.schedule.thinking_budget is not None else 3  # as before
        meta = {"format_version": version, "schedule": self.schedule.to_dict()}
        np.savez(tmp, meta=np.asarray(json.dumps(meta)), **arrays)
        tmp.replace(path)

    @classmethod
    def load(cls, path: str | Path) -> "RolloutBatch":
        """Read a file written by `save`. Raises ScheduleError naming the file and problem
        (missing, truncated or corrupt file, not a rollout file, other format version)."""
        if not (path := Path(path)).is_file():
            raise ScheduleError(f"{path}: no such rollout file")
        try:
            with np.load(path, allow_pickle=False) as z:
                data = {k: z[k] for k in z.files}
            meta = json.loads(str(data.pop("meta"))) if "meta" in data else None
        except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as e:
            if "pickle" in str(e):  # no numpy advice to unpickle: that runs the file's code
                raise ScheduleError(f"{path}: not a looprl rollout file (no .npz)") from None
            raise ScheduleError(f"{path}: cannot read rollout file (truncated or corrupt?): "
                                f"{type(e).__name__}: {e}") from e
        if not isinstance(meta, dict):
            raise ScheduleError(f"{path}: not a looprl rollout file (no 'meta' object)")
        if meta.get("format_version") not in READABLE_VERSIONS:
            raise ScheduleError(f"{path}: format_version {meta.get('format_version')!r}, "
                                f"this looprl reads {list(READABLE_VERSIONS)}")
        missing = [k for k in _ARRAYS if k not in data]
        if missing:
            raise ScheduleError(f"{path}: missing arrays {missing}")
        sched = Schedule.from_dict(meta["schedule"], meta["format_version"])
        return cls(**{k: data[k] for k in _ARRAYS}, schedule=sched,
                   loop_rows=data.get("loop_rows"), forced_BxS=data.get("forced_BxS"))
