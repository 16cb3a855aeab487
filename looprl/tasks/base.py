"""The task interface: problems, a resumable train stream, a fixed held-out set, rewards.

A `Task` owns two sets of problems that never overlap:
  * the **train stream**, infinite (procedural tasks) or cycled in seeded epochs (datasets:
    `ShuffledStream`). `train_problem(index)` is a pure function of the task's configuration
    and `index`, so the trainer's data position is one integer (`ProblemIterator.position`);
  * the **held-out set**, fixed by the configuration: `eval_problems(n)` is its first `n`.
The seed is part of the task's configuration (`get_task(name, seed=...)`).

Rewards are verifiable and lie in [0, 1]; `solution_text` is the supervised target of a warm start.
Every task is built through the registry: `get_task` (keyword configuration), `run_tasks` (an
experiment's `task` section) and `task_class`. Adding a task is one module with a `Task`
subclass and one entry in `_REGISTRY` (or a `register_task` call).
"""
from __future__ import annotations

import abc
import dataclasses
import hashlib
import importlib
import inspect
import json
import random
from typing import Any, Callable, ClassVar, Iterator, Mapping, Sequence

from looprl.errors import ConfigError
from looprl.tokenizer import PROMPT_STYLES, TextTokenizer, chat_prompt

TRAIN, EVAL = "train", "eval"


def first_problems(held_out: Sequence["Problem"], n: int | None, where: str) -> list["Problem"]:
    """The first `n` of a task's held-out problems (all when `n` is None), for `eval_problems`.

    Raises:
      ConfigError: `n` exceeds `len(held_out)`; the message names `where` (the task and the
        file or setting that fixes the held-out set's size).
    """
    if n is None:
        n = len(held_out)
    if n > len(held_out):
        raise ConfigError(f"{where}: asked for {n} held-out problems, there are {len(held_out)}")
    return list(held_out[:n])


@dataclasses.dataclass(frozen=True)
class Problem:
    """One problem with a verifiable answer.

    Attributes:
      id: global index in its split: the position in the train stream's source (arithmetic: the
        generator index; GSM8K: the 0-based record index in the JSONL file) or in the held-out set.
      split: `train` or `eval`.
      prompt: the question, unformatted (the user message; `Task.format_prompt` frames it).
      answer: the gold answer as a string (for example `"57"`, `"1080"`).
      metadata: task-specific details (source dataset, expression, file and line, ...).
    """
    id: int
    split: str
    prompt: str
    answer: str
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def without_held_out(train: Sequence["Problem"], held_out: Sequence["Problem"]
                     ) -> list["Problem"]:
    """The train problems whose prompt is not a held-out prompt (whitespace normalised)."""
    held = {" ".join(p.prompt.split()) for p in held_out}
    return [p for p in train if " ".join(p.prompt.split()) not in held]


class ShuffledStream:
    """A dataset's train stream: its problems cycled in epochs, each shuffled with
    `random.Random(seed * 1_000_003 + epoch)`. `stream[index]` is a pure function of the
    problems, `seed` and `index`; the orders of the last two epochs are kept, since a stream
    moves forward and a batch may straddle an epoch boundary.
    """

    def __init__(self, problems: Sequence["Problem"], seed: int):
        self.problems, self.seed = list(problems), seed
        self._orders: dict[int, list[int]] = {}

    def __getitem__(self, index: int) -> "Problem":
        """Problem `index` of the stream (epoch `index // len(problems)`).

        Raises:
          ConfigError: a negative index.
        """
        if index < 0:
            raise ConfigError(f"train problem index must be >= 0, found {index}")
        epoch, offset = divmod(index, len(self.problems))
        order = self._orders.get(epoch)
        if order is None:
            order = list(range(len(self.problems)))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            self._orders = {e: o for e, o in self._orders.items() if e == epoch - 1}
            self._orders[epoch] = order
        return self.problems[order[offset]]


class Task(abc.ABC):
    """A task with verifiable rewards (see the module docstring for the train/held-out contract).

    Subclasses set `name`, implement `train_problem`, `eval_problems`, `reward`, `solution_text`
    and `config`, and set `self.prompt_style` (one of `looprl.tokenizer.PROMPT_STYLES`).
    """
    name: ClassVar[str] = "task"
    prompt_style: str = "chatml"
    # keyword options naming the task's data files, with their defaults: `looprl eval`'s
    # --data-dir / --source set them (a task without data files takes neither)
    data_options: ClassVar[Mapping[str, str]] = {}

    @classmethod
    def for_run(cls, section: Any, *, checkpoint: str | None,
                warm_start: bool) -> tuple["Task", "Task"]:
        """Return (warm-start task, GRPO task) of an experiment's `task` section.

        Args:
          section: the `looprl.config.TaskConfig` (its `name` is this task's).
          checkpoint: `model.checkpoint`, or None (a model trained from scratch).
          warm_start: `warm_start.enabled`.
        Raises:
          ConfigError: the section does not describe a run of this task (names the key).
        """
        raise ConfigError(f"config key 'task.name': task {cls.name!r} does not map an "
                          f"experiment's task section")

    @abc.abstractmethod
    def train_problem(self, index: int) -> Problem:
        """Return the `index`-th problem (index >= 0) of the train stream (deterministic)."""

    @abc.abstractmethod
    def eval_problems(self, n: int | None = None) -> list[Problem]:
        """Return the first `n` held-out problems (all of them when `n` is None).

        Raises:
          ConfigError: `n` exceeds the held-out set's size.
        """

    @abc.abstractmethod
    def reward(self, problem: Problem, completion: str) -> float:
        """Return the reward in [0, 1] of `completion` (decoded text, end of turn optional)."""

    @abc.abstractmethod
    def solution_text(self, problem: Problem) -> str:
        """Return the supervised completion for `problem` (without the end-of-turn token)."""

    @abc.abstractmethod
    def config(self) -> dict[str, Any]:
        """Return the task's configuration as JSON-serialisable values (it fixes every problem)."""

    # ----- shared behaviour -----
    def train_problems(self, n: int, start: int = 0) -> list[Problem]:
        """Return train-stream problems `start .. start + n - 1`."""
        return [self.train_problem(i) for i in range(start, start + n)]

    def train_iterator(self, position: int = 0) -> "ProblemIterator":
        """Return an iterator over the train stream starting at `position`."""
        return ProblemIterator(self, position)

    def format_prompt(self, problem: Problem) -> str:
        """Return the prompt text fed to the model (ChatML framing, style `self.prompt_style`)."""
        return chat_prompt(problem.prompt, self.prompt_style)

    def tokenizer(self) -> TextTokenizer | None:
        """Return the task's own tokenizer for tiny models, or None (use the model's tokenizer)."""
        return None

    def fingerprint(self) -> str:
        """Return a SHA-256 (hex, 16 chars) of `name` and `config()`; a resume checks it matches."""
        blob = json.dumps({"task": self.name, "config": self.config()}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    @staticmethod
    def _check_prompt_style(style: str) -> str:
        if style not in PROMPT_STYLES:
            raise ConfigError(f"prompt_style: expected one of {PROMPT_STYLES}, found {style!r}")
        return style


class ProblemIterator:
    """The trainer's position in a task's train stream: one integer, checkpointable.

    `next_batch(n)` returns problems `position .. position + n - 1` and advances the position, so
    restoring `state_dict()` into an iterator of an identically configured task reproduces the
    following batches exactly.
    """

    def __init__(self, task: Task, position: int = 0):
        if position < 0:
            raise ConfigError(f"data position: expected >= 0, found {position}")
        self.task = task
        self.position = int(position)

    def next_batch(self, n: int) -> list[Problem]:
        """Return the next `n` train problems and advance the position by `n`."""
        batch = self.task.train_problems(n, self.position)
        self.position += n
        return batch

    def __iter__(self) -> Iterator[Problem]:
        return self

    def __next__(self) -> Problem:
        return self.next_batch(1)[0]

    def state_dict(self) -> dict[str, Any]:
        """Return `{"task", "fingerprint", "position"}` (JSON-serialisable)."""
        return {"task": self.task.name, "fingerprint": self.task.fingerprint(),
                "position": self.position}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the position from `state_dict()` output.

        Raises:
          ConfigError: a key is missing, or the state belongs to another task or configuration
            (different name or fingerprint), or the position is not a non-negative integer.
        """
        for key in ("task", "fingerprint", "position"):
            if key not in state:
                raise ConfigError(f"data iterator state: missing key {key!r} (found {sorted(state)})")
        if state["task"] != self.task.name or state["fingerprint"] != self.task.fingerprint():
            raise ConfigError(
                f"data iterator state: saved for task {state['task']!r} fingerprint "
                f"{state['fingerprint']!r}, this task is {self.task.name!r} fingerprint "
                f"{self.task.fingerprint()!r} (configuration differs)")
        position = state["position"]
        if isinstance(position, bool) or not isinstance(position, int) or position < 0:
            raise ConfigError(f"data iterator state: position must be an int >= 0, found {position!r}")
        self.position = position


# ----- registry -----
_REGISTRY: dict[str, str | type[Task]] = {
    "arithmetic": "looprl.tasks.arithmetic:ArithmeticTask",
    "gsm8k": "looprl.tasks.gsm8k:GSM8KTask",
    "math": "looprl.tasks.math_jsonl:MathTask",
}


def register_task(name: str, task_cls: str | type[Task]) -> None:
    """Register a `Task` subclass (or its `"module:Class"` path) as `name` (replacing any)."""
    _REGISTRY[name] = task_cls


def task_names() -> list[str]:
    """Return the registered task names, sorted."""
    return sorted(_REGISTRY)


def task_class(name: str, key: str | None = None) -> type[Task]:
    """Return the `Task` subclass registered as `name` (imported on first use).

    Raises:
      ConfigError: unknown task name (the message starts with `key`, the setting that gave it).
    """
    if name not in _REGISTRY:
        where = f"{key}: " if key else ""
        raise ConfigError(f"{where}unknown task {name!r}; known: {task_names()}")
    cls = _REGISTRY[name]
    if isinstance(cls, str):
        module, attr = cls.split(":")
        cls = _REGISTRY[name] = getattr(importlib.import_module(module), attr)
    return cls


def get_task(name: str, **kwargs: Any) -> Task:
    """Construct the task registered as `name` with keyword configuration `kwargs`.

    Raises:
      ConfigError: unknown task name, unknown keyword, or an invalid value.
    """
    cls = task_class(name)
    try:
        inspect.signature(cls).bind(**kwargs)
    except TypeError as e:  # unknown or missing keyword argument
        raise ConfigError(f"task {name!r}: {e}") from e
    return cls(**kwargs)


def run_tasks(section: Any, *, checkpoint: str | None,
              warm_start: bool) -> tuple[Task, Task]:
    """Return (warm-start task, GRPO task) of an experiment's `task` section (`Task.for_run` of
    the task registered as `section.name`).

    Raises:
      ConfigError: unknown task name, or a section the task rejects (names the config key).
    """
    return task_class(section.name, "config key 'task.name'").for_run(
        section, checkpoint=checkpoint, warm_start=warm_start)
