"""GSM8K: grade-school math word problems, from JSONL files or the HF hub.

Data: the official JSONL format, one object per line with `question` and `answer`, the answer's
last line `#### N` holding the gold number. `train.jsonl` and `test.jsonl` are read from
`data_dir` (a relative path is tried against the working directory, then the repository root),
each on first use, so the held-out set needs only `test.jsonl`; `source="hub"` reads
`openai/gsm8k` through the optional `datasets` package. A malformed record raises `TaskError`
naming the file and line.

Splits: the held-out set is the test file in file order; the train stream cycles the train file
in seeded epochs (`looprl.tasks.base.ShuffledStream`), skipping any train question that is also
in the test file. `Problem.id` is the record's 0-based index in its file.
Prompts follow Ouro's chat template (ChatML, no system prompt; `prompt_style="thinking"` ends
with `<think>\\n`). Grading: `looprl.tasks.grading.grade_answer`.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Iterable

from looprl.errors import ConfigError, TaskError
from looprl.tasks.base import (EVAL, TRAIN, Problem, ShuffledStream, Task, first_problems,
                               without_held_out)
from looprl.tasks.grading import grade_answer
from looprl.tokenizer import chat_prompt

DEFAULT_DATA_DIR = "../shared/data/gsm8k"
DEFAULT_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
REPO_ROOT = Path(__file__).resolve().parents[2]
_GOLD_RE = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
_CALC_RE = re.compile(r"<<[^>]*>>")


def parse_gsm8k_answer(answer: str, where: str = "answer") -> tuple[str, str]:
    """Split a GSM8K `answer` field into (reasoning, gold); gold loses its thousands separators.

    Raises:
      TaskError: no `####`, or the text after the last `####` is not a number (`where` is put
        in the message, e.g. `path:line`).
    """
    if "####" not in answer:
        raise TaskError(f"{where}: answer has no '#### N' line (found {answer[-60:]!r})")
    reasoning, gold = answer.rsplit("####", 1)
    gold = gold.strip()
    if not _GOLD_RE.fullmatch(gold):
        raise TaskError(f"{where}: the text after '####' is not a number: {gold!r}")
    return reasoning.strip(), gold.replace(",", "").lstrip("+")


def _problem(record: Any, index: int, split: str, file: str, line: int) -> Problem:
    where = f"{file}:{line}"
    if not isinstance(record, dict):
        raise TaskError(f"{where}: expected a JSON object, found {type(record).__name__}")
    for key in ("question", "answer"):
        if key not in record:
            raise TaskError(f"{where}: missing key {key!r} (found {sorted(record)})")
        if not isinstance(record[key], str):
            raise TaskError(f"{where}: key {key!r} must be a string, found "
                            f"{type(record[key]).__name__}")
    reasoning, gold = parse_gsm8k_answer(record["answer"], where)
    return Problem(id=index, split=split, prompt=record["question"].strip(), answer=gold,
                   metadata={"file": file, "line": line, "reasoning": reasoning})


def read_gsm8k_jsonl(path: str | os.PathLike, split: str = TRAIN) -> list[Problem]:
    """Read a GSM8K JSONL file into problems (ids 0.. in file order, blank lines skipped).

    Raises:
      TaskError: the file is missing, or a line is malformed: not UTF-8 (`path:line: invalid
        UTF-8 at byte B of the line`), bad JSON (`path:line: invalid JSON (... at column C)`, C
        counted in the line), or a bad record (message `path:line: ...`).
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise TaskError(f"{path}: GSM8K file not found")
    problems = []
    with open(path, "rb") as f:  # bytes: a decoding error is reported with its line
        for line_no, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError as e:
                raise TaskError(f"{path}:{line_no}: invalid UTF-8 at byte {e.start + 1} of the line "
                                f"({e.reason}: {raw[e.start:e.end]!r})") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise TaskError(f"{path}:{line_no}: invalid JSON ({e.msg} at column {e.colno})") from None
            problems.append(_problem(record, len(problems), split, path, line_no))
    if not problems:
        raise TaskError(f"{path}: no records")
    return problems


def _hub_problems(name: str, hub_split: str, split: str) -> list[Problem]:
    try:
        import datasets  # optional dependency
    except ImportError:
        raise ConfigError("gsm8k source 'hub' needs the optional `datasets` package "
                          "(pip install datasets), or use source='jsonl'") from None
    rows: Iterable[Any] = datasets.load_dataset(name, "main", split=hub_split)
    file = f"hub:{name}/{hub_split}"
    return [_problem(dict(row), i, split, file, i + 1) for i, row in enumerate(rows)]


def resolve_data_dir(data_dir: str | os.PathLike, required: Iterable[str] = (),
                     task: str = "gsm8k") -> Path:
    """Return the directory `data_dir` names: absolute as is, else under the cwd, else the repo root.

    Raises:
      ConfigError: no candidate directory holds every file in `required`; names the paths tried.
    """
    given = Path(data_dir).expanduser()
    tried = [given] if given.is_absolute() else [Path.cwd() / given, REPO_ROOT / given]
    tried = list(dict.fromkeys(os.path.normpath(t) for t in tried))  # the cwd may be the root
    for candidate in map(Path, tried):
        if candidate.is_dir() and all((candidate / f).is_file() for f in required):
            return candidate.resolve()
    raise ConfigError(f"{task} data_dir {os.fspath(data_dir)!r}: no directory with "
                      f"{list(required)} among {tried}; link a directory that holds them "
                      f"(ln -s DIR {tried[-1]}) or pass its path as --data-dir / "
                      f"task.data_dir=")


class GSM8KTask(Task):
    """GSM8K with verifiable rewards (see the module docstring for data, splits and prompts).

    Args:
      data_dir: directory of the JSONL files (source `jsonl`).
      source: `jsonl` or `hub`.
      seed: seeds the per-epoch shuffles of the train stream.
      prompt_style: `chatml` (default) or `thinking` (`compact` is accepted for tiny models).
      instruction: appended to the question after a blank line ("" for none).
      train_file, eval_file: file names inside `data_dir`.
      hub_dataset: dataset name for source `hub`.
    Raises:
      ConfigError: unknown source or prompt style, or (source `jsonl`) no such data directory.
    """
    name = "gsm8k"
    data_options = {"data_dir": DEFAULT_DATA_DIR, "source": "jsonl"}

    @classmethod
    def for_run(cls, section, *, checkpoint, warm_start):
        """One task for both roles (no warm start: the model and its tokenizer come from
        `model.checkpoint`).

        Raises:
          ConfigError: no `model.checkpoint`, `warm_start.enabled`, bad task knobs, or (source
            `jsonl`) no train file in `task.data_dir`.
        """
        if not checkpoint:
            raise ConfigError("config key 'model.checkpoint': task 'gsm8k' has no tokenizer of its "
                              "own, so it needs a converted Ouro checkpoint (looprl convert --hf "
                              "DIR --out CKPT), e.g. model.checkpoint=/path/to/ouro-1.4b-looprl")
        if warm_start:
            raise ConfigError("config key 'warm_start.enabled': the supervised warm start is for "
                              "tiny models; task 'gsm8k' starts from model.checkpoint, set "
                              "warm_start.enabled=false")
        t = section
        task = cls(data_dir=t.data_dir, source=t.source, seed=t.data_seed,
                   prompt_style=t.prompt_style or "chatml")
        if task.resolved_dir is not None and not (task.resolved_dir / task.train_file).is_file():
            raise ConfigError(f"config key 'task.data_dir': no {task.train_file!r} in "
                              f"{task.resolved_dir} (GRPO trains on it)")
        return task, task

    def __init__(self, data_dir: str = DEFAULT_DATA_DIR, source: str = "jsonl", seed: int = 0,
                 prompt_style: str = "chatml", instruction: str = DEFAULT_INSTRUCTION,
                 train_file: str = "train.jsonl", eval_file: str = "test.jsonl",
                 hub_dataset: str = "openai/gsm8k"):
        if source not in ("jsonl", "hub"):
            raise ConfigError(f"gsm8k source: expected 'jsonl' or 'hub', found {source!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ConfigError(f"gsm8k seed must be an int >= 0, found {seed!r}")
        self.data_dir = os.fspath(data_dir)
        self.source = source
        self.seed = seed
        self.prompt_style = self._check_prompt_style(prompt_style)
        self.instruction = instruction
        self.train_file = train_file
        self.eval_file = eval_file
        self.hub_dataset = hub_dataset
        # the held-out file must exist now; the train file only once train problems are asked for
        self.resolved_dir = (resolve_data_dir(data_dir, (eval_file,))
                             if source == "jsonl" else None)
        self._train: ShuffledStream | None = None   # train records not held out
        self._eval: list[Problem] | None = None

    def _load_eval(self) -> None:
        if self._eval is not None:
            return
        if self.source == "jsonl":
            self._eval = read_gsm8k_jsonl(self.resolved_dir / self.eval_file, EVAL)
        else:
            self._eval = _hub_problems(self.hub_dataset, "test", EVAL)

    def _load_train(self) -> None:
        """Read the train records (on the first train request), minus test-file questions.

        Raises:
          ConfigError: (source `jsonl`) no train file in the data directory. TaskError: a
            malformed data file.
        """
        if self._train is not None:
            return
        self._load_eval()
        if self.source == "jsonl":
            path = self.resolved_dir / self.train_file
            if not path.is_file():
                raise ConfigError(f"gsm8k data_dir {self.data_dir!r}: no {self.train_file!r} in "
                                  f"{os.fspath(self.resolved_dir)} (training needs it; "
                                  f"evaluation reads only {self.eval_file!r})")
            train = read_gsm8k_jsonl(path, TRAIN)
        else:
            train = _hub_problems(self.hub_dataset, "train", TRAIN)
        self._train = ShuffledStream(without_held_out(train, self._eval), self.seed)

    def eval_problems(self, n: int | None = None) -> list[Problem]:
        """Return the first `n` test problems in file order (all when None).

        Raises:
          ConfigError: `n` exceeds the test set. TaskError: a malformed test file.
        """
        self._load_eval()
        return first_problems(self._eval, n, "gsm8k test set")

    def train_problem(self, index: int) -> Problem:
        """Return train-stream problem `index` (epoch `index // N`, shuffled per epoch).

        Raises:
          ConfigError: negative index, or no train file. TaskError: a malformed data file.
        """
        self._load_train()
        return self._train[index]

    def format_prompt(self, problem: Problem) -> str:
        """Return the ChatML prompt: question, blank line, instruction (see `chat_prompt`)."""
        text = f"{problem.prompt}\n\n{self.instruction}" if self.instruction else problem.prompt
        return chat_prompt(text, self.prompt_style)

    def reward(self, problem: Problem, completion: str) -> float:
        """Return 1.0 if the completion's final answer equals the gold number, else 0.0."""
        return grade_answer(completion, problem.answer)

    def solution_text(self, problem: Problem) -> str:
        """Return the reference solution: its reasoning without `<<...>>` calculator notes, then
        `The final answer is \\boxed{N}.`"""
        reasoning = _CALC_RE.sub("", problem.metadata["reasoning"])
        return f"{reasoning}\nThe final answer is \\boxed{{{problem.answer}}}."

    def config(self) -> dict[str, Any]:
        return {"data_dir": self.data_dir, "source": self.source, "seed": self.seed,
                "prompt_style": self.prompt_style, "instruction": self.instruction,
                "train_file": self.train_file, "eval_file": self.eval_file,
                "hub_dataset": self.hub_dataset}
