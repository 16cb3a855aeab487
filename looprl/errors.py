"""Exception families of looprl (one per family; messages name file, key, tensor, expected, found),
and `create_dir`, the one place a command's output directory is created."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path


class LooprlError(Exception):
    """Base class of every error looprl raises on purpose."""


class ConfigError(LooprlError, ValueError):
    """A model or experiment configuration is invalid (unknown key, wrong type, bad value)."""


class CheckpointError(LooprlError):
    """A checkpoint (HF safetensors or looprl/orbax) is missing, malformed or mismatched."""


class ScheduleError(LooprlError):
    """A rollout schedule is malformed or cannot be replayed against the given parameters."""


class SamplingError(LooprlError, ValueError):
    """Bad input to the rollout engine (empty prompt, bad threshold, prompt too long, ...)."""


class TaskError(LooprlError, ValueError):
    """A task data file is malformed (the message names the file and line)."""


class TrainingError(LooprlError):
    """A training step went wrong (non-finite loss or gradient: the message names the tensor and
    the step); the run stops without overwriting a checkpoint."""


def create_dir(path: str | Path, what: str) -> Path:
    """`path` created with its parents (an existing directory is fine), returned as a Path.

    Raises:
      ConfigError: the OS refused to create it or a file in it (a parent that is a file, no
        permission, a read-only file system), naming `what` (the config key or flag that gave
        the path), the path and the OS's reason, instead of a traceback.
    """
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{what}: cannot create directory {str(path)!r}: "
                          f"{e.strerror or e}") from None
    try:  # an existing directory the user cannot write into: found now, not at the first file
        fd, probe = tempfile.mkstemp(dir=path, prefix=".looprl-write-check-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(f"{what}: cannot write into directory {str(path)!r}: "
                          f"{e.strerror or e}") from None
    return path
