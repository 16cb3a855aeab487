"""Competition math from JSONL files a user brings (MATH-500, DeepMath, AIME, ...): task `math`.

Data: one JSON object per line with a problem, a gold answer and an optional difficulty level;
each field's name is configurable (`problem_key`, `answer_key`, `level_key`; MATH-500 uses
`problem`/`answer`/`level`, DeepMath `question`/`final_answer`/`difficulty`). The held-out set is
`eval_file` in file order; the train stream cycles `train_file` in seeded epochs
(`looprl.tasks.base.ShuffledStream`), skipping any train problem also held out. Both are
read from `data_dir` (a relative path: the working directory, then the repository root), each
on first use. A level is a number or a string holding one (`"Level 3"`); `min_level` /
`max_level` keep the records inside the bounds (inclusive) and drop those without a level. A
malformed line raises `TaskError` naming `file:line`.
Grading: `looprl.tasks.grading.grade_symbolic` (a plain-number gold by its value, anything else
through math-verify: fractions, radicals, intervals, expressions, `\\pi`). Prompts: ChatML with
the GSM8K instruction (`\\boxed{}`), `prompt_style="thinking"` for Ouro Thinking models.
"""
from __future__ import annotations

import json
import os
import re
from typing import Any

from looprl.errors import ConfigError, TaskError
from looprl.tasks.base import (EVAL, TRAIN, Problem, ShuffledStream, Task, first_problems,
                               without_held_out)
from looprl.tasks.grading import grade_symbolic
from looprl.tasks.gsm8k import DEFAULT_INSTRUCTION, resolve_data_dir
from looprl.tokenizer import chat_prompt

_LEVEL_RE = re.compile(r"[-+]?\d+(?:\.\d+)?")


def _level(value: Any, where: str, key: str) -> float | None:
    """A record's level: a number, a string holding one (`"Level 3"`), or None (missing, `"?"`)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TaskError(f"{where}: key {key!r} must be a number or a string, found "
                        f"{type(value).__name__}")
    if isinstance(value, str):
        m = _LEVEL_RE.search(value)
        return float(m.group(0)) if m else None
    return float(value)


def read_math_jsonl(path: str | os.PathLike, split: str = TRAIN, *, problem_key: str = "problem",
                    answer_key: str = "answer", level_key: str = "level",
                    solution_key: str = "solution") -> list[Problem]:
    """Read a math JSONL file into problems (ids 0.. in file order; blank lines skipped).

    `Problem.answer` is the gold as a string (a number gold is written as JSON gives it);
    metadata holds `file`, `line`, `level` (float or None) and `solution` (or None).
    Raises:
      TaskError: the file is missing or holds no record, or a line is not UTF-8, not JSON, not an
        object, lacks `problem_key` / `answer_key`, or has a value of the wrong type (message
        `path:line: ...`).
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise TaskError(f"{path}: math JSONL file not found")
    problems = []
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            where = f"{path}:{line_no}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise TaskError(f"{where}: invalid UTF-8 at byte {e.start + 1} of the line") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise TaskError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(record, dict):
                raise TaskError(f"{where}: expected a JSON object, found {type(record).__name__}")
            for key in (problem_key, answer_key):
                if key not in record:
                    raise TaskError(f"{where}: missing key {key!r} (found {sorted(record)})")
            problem, answer = record[problem_key], record[answer_key]
            if not isinstance(problem, str) or not problem.strip():
                raise TaskError(f"{where}: key {problem_key!r} must be a non-empty string")
            if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
                raise TaskError(f"{where}: key {answer_key!r} must be a string or a number, "
                                f"found {type(answer).__name__}")
            answer = str(answer).strip()
            if not answer:
                raise TaskError(f"{where}: key {answer_key!r} is empty")
            solution = record.get(solution_key)
            problems.append(Problem(
                id=len(problems), split=split, prompt=problem.strip(), answer=answer,
                metadata={"file": path, "line": line_no,
                          "level": _level(record.get(level_key), where, level_key),
                          "solution": solution if isinstance(solution, str) else None}))
    if not problems:
        raise TaskError(f"{path}: no records")
    return problems


class MathTask(Task):
    """Math problems with symbolic gold answers (see the module docstring).

    Args:
      data_dir: directory of the JSONL files.
      train_file, eval_file: file names inside `data_dir` (the train file is read only when
        train problems are asked for).
      problem_key, answer_key, level_key, solution_key: field names of a record.
      min_level, max_level: inclusive level bounds (None: no bound).
      seed: seeds the per-epoch shuffles of the train stream.
      prompt_style: `chatml` (default), `thinking` or `compact`.
      instruction: appended to the problem after a blank line ("" for none).
    Raises:
      ConfigError: no directory holding `eval_file`, min_level > max_level, a bad seed or style.
    """
    name = "math"
    data_options = {"data_dir": "data/math"}

    @classmethod
    def for_run(cls, section, *, checkpoint, warm_start):
        """One task for both roles, from a converted checkpoint (as GSM8K).

        Raises:
          ConfigError: no `model.checkpoint`, `warm_start.enabled`, or bad task knobs.
        """
        if not checkpoint:
            raise ConfigError("config key 'model.checkpoint': task 'math' needs a converted Ouro "
                              "checkpoint (looprl convert --hf DIR --out CKPT)")
        if warm_start:
            raise ConfigError("config key 'warm_start.enabled': task 'math' starts from "
                              "model.checkpoint, set warm_start.enabled=false")
        t = section
        task = cls(data_dir=t.data_dir, train_file=t.train_file or "train.jsonl",
                   eval_file=t.eval_file or "test.jsonl", problem_key=t.problem_key,
                   answer_key=t.answer_key, level_key=t.level_key, min_level=t.min_level,
                   max_level=t.max_level, seed=t.data_seed, prompt_style=t.prompt_style or "chatml")
        return task, task

    def __init__(self, data_dir: str = "data/math", train_file: str = "train.jsonl",
                 eval_file: str = "test.jsonl", problem_key: str = "problem",
                 answer_key: str = "answer", level_key: str = "level",
                 solution_key: str = "solution", min_level: float | None = None,
                 max_level: float | None = None, seed: int = 0, prompt_style: str = "chatml",
                 instruction: str = DEFAULT_INSTRUCTION):
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ConfigError(f"math task: seed must be an int >= 0, found {seed!r}")
        if min_level is not None and max_level is not None and min_level > max_level:
            raise ConfigError(f"math task: min_level ({min_level}) > max_level ({max_level})")
        self.data_dir = os.fspath(data_dir)
        self.train_file, self.eval_file = train_file, eval_file
        self.keys = {"problem_key": problem_key, "answer_key": answer_key,
                     "level_key": level_key, "solution_key": solution_key}
        self.min_level, self.max_level = min_level, max_level
        self.seed = seed
        self.prompt_style = self._check_prompt_style(prompt_style)
        self.instruction = instruction
        self.resolved_dir = resolve_data_dir(data_dir, (eval_file,), "math")
        self._train: ShuffledStream | None = None
        self._eval: list[Problem] | None = None

    def _read(self, file: str, split: str) -> list[Problem]:
        path = self.resolved_dir / file
        if not path.is_file():
            raise ConfigError(f"math data_dir {self.data_dir!r}: no {file!r} in {self.resolved_dir}")
        kept = [p for p in read_math_jsonl(path, split, **self.keys) if self._in_levels(p)]
        if not kept:
            raise ConfigError(f"math task: no record of {path} has a level in "
                              f"[{self.min_level}, {self.max_level}]")
        return kept

    def _in_levels(self, p: Problem) -> bool:
        level = p.metadata["level"]
        if self.min_level is None and self.max_level is None:
            return True
        return level is not None and ((self.min_level is None or level >= self.min_level) and
                                      (self.max_level is None or level <= self.max_level))

    def eval_problems(self, n: int | None = None) -> list[Problem]:
        """Return the first `n` held-out problems in file order, inside the level bounds (all
        when None). Raises ConfigError: `n` exceeds the held-out set; TaskError: a bad line."""
        if self._eval is None:
            self._eval = self._read(self.eval_file, EVAL)
        return first_problems(self._eval, n, f"math task {self.eval_file} (inside the level "
                                             f"bounds)")

    def train_problem(self, index: int) -> Problem:
        """Return train-stream problem `index` (epoch `index // N`, shuffled per epoch).

        Raises:
          ConfigError: negative index, no train file, or every train problem is held out.
        """
        if self._train is None:
            train = without_held_out(self._read(self.train_file, TRAIN), self.eval_problems())
            if not train:
                raise ConfigError(f"math task: every problem of {self.train_file} is held out")
            self._train = ShuffledStream(train, self.seed)
        return self._train[index]

    def format_prompt(self, problem: Problem) -> str:
        """Return the ChatML prompt: problem, blank line, instruction (see `chat_prompt`)."""
        text = f"{problem.prompt}\n\n{self.instruction}" if self.instruction else problem.prompt
        return chat_prompt(text, self.prompt_style)

    def reward(self, problem: Problem, completion: str) -> float:
        """Return 1.0 if the completion's final answer equals the gold (`grade_symbolic`)."""
        return grade_symbolic(completion, problem.answer)

    def solution_text(self, problem: Problem) -> str:
        """Return the record's solution when it has one, else `The final answer is \\boxed{A}.`"""
        return problem.metadata["solution"] or f"The final answer is \\boxed{{{problem.answer}}}."

    def config(self) -> dict[str, Any]:
        return {"data_dir": self.data_dir, "train_file": self.train_file,
                "eval_file": self.eval_file, **self.keys, "min_level": self.min_level,
                "max_level": self.max_level, "seed": self.seed,
                "prompt_style": self.prompt_style, "instruction": self.instruction}
