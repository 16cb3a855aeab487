"""Exception families of looprl (one per family; messages name file, key, tensor, expected, found)."""


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
