"""Procedural arithmetic from `reasoning-gym` (chain_sum, basic_arithmetic, products): no download.

Problems come from reasoning-gym's seeded generators and are scored with the generator's own
scorer (`score_answer`). The format suits a character-level model:

    prompt text   `12 + 7 - 3`                  (`spaces=False` gives `12+7-3`)
    completion    `= 19 - 3 = 16` then `<|im_end|>` (solution_style `steps`, chain_sum only:
                  reduced left to right)  or  `= 16` then `<|im_end|>` (solution_style `answer`)

The default prompt style is `compact` (`<|im_start|>12 + 7 - 3<|im_end|><|im_start|>`).
Train and held-out problems come from disjoint generator seeds (item `i` uses
`random.Random(seed + i)`; train seeds start at `seed * 2**40`, held-out ones at
`seed * 2**40 + 2**39`); the held-out set is `eval_size` problems deduplicated by expression, and
the train stream skips every expression in it (in a small problem space such as 2-term 1-digit
sums that removes most expressions from training).
"""
from __future__ import annotations

import re
from typing import Any, Sequence

from looprl.errors import ConfigError, TaskError
from looprl.tasks.base import EVAL, TRAIN, Problem, Task, first_problems
from looprl.tokenizer import IM_END, TextTokenizer, build_char_tokenizer

DATASETS = ("chain_sum", "basic_arithmetic", "products")
SOLUTION_STYLES = ("steps", "answer")
_SEED_STRIDE = 2 ** 40      # per task seed
_EVAL_OFFSET = 2 ** 39      # held-out generator seeds start here (train source index must stay below)
_MAX_CONSECUTIVE_SKIPS = 100_000
_INT_RE = re.compile(r"[+-]?\d+")


def extract_final_answer(completion: str) -> str | None:
    """Return the final answer of an arithmetic completion, or None when it is malformed.

    The completion is cut at the first `<|im_end|>` (if present). The answer is the text after the
    last `=` (the whole text when there is no `=`), stripped of spaces and one trailing period; it
    must be an integer (optional sign). So `= 19 - 3 = 16` gives `16`, `= 19 - 3` (an unfinished
    reduction) gives None, and `16` gives `16`.
    """
    text = completion.split(IM_END, 1)[0]
    tail = text.rsplit("=", 1)[-1].strip()
    if tail.endswith("."):
        tail = tail[:-1].rstrip()
    return tail if _INT_RE.fullmatch(tail) else None


def _range(name: str, value: Any) -> tuple[int, int]:
    try:
        lo, hi = (int(v) for v in value)
        ok = all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    except (TypeError, ValueError):
        ok = False
    if not ok or not 1 <= lo <= hi:
        raise ConfigError(f"arithmetic task: {name} must be a pair (lo, hi) of ints with "
                          f"1 <= lo <= hi, found {value!r}")
    return lo, hi


class ArithmeticTask(Task):
    """Procedural arithmetic (see the module docstring for format, seeds and disjointness).

    Args:
      seed: task seed (fixes both the train stream and the held-out set).
      dataset: reasoning-gym generator, one of `DATASETS`.
      train_terms, train_digits: inclusive (lo, hi) ranges of the train stream's number of terms
        and digits per operand.
      eval_terms, eval_digits: the same for the held-out set.
      eval_size: size of the held-out set (the train stream excludes all of it).
      prompt_style: `compact` (default), `chatml` or `thinking`.
      solution_style: `steps` (chain_sum only) or `answer`; None picks `steps` for chain_sum.
      spaces: keep reasoning-gym's spaces between tokens (`12 + 7`) or drop them (`12+7`).
      allow_negation: negative operands (reasoning-gym option).
      operators: basic_arithmetic's operator set (default `("+", "-", "*")`, no floor division).
      allow_parentheses: basic_arithmetic's parentheses.
    Raises:
      ConfigError: any invalid value.
    """
    name = "arithmetic"

    @classmethod
    def for_run(cls, section, *, checkpoint, warm_start):
        """(warm-start task, GRPO task) of an experiment's `task` section: one dataset, the same
        seed and held-out knobs; the warm start trains on `train_terms`/`train_digits`, GRPO on
        `rl_terms`/`rl_digits` (none: the held-out mix, never its problems).

        Raises:
          ConfigError: more than one dataset, or eval_datasets differing from train_datasets.
        """
        t = section
        if len(t.train_datasets) != 1 or t.eval_datasets != t.train_datasets:
            raise ConfigError(f"config key 'task.train_datasets': the arithmetic task takes one "
                              f"dataset (the same for eval_datasets), found {t.train_datasets} / "
                              f"{t.eval_datasets}")
        common = dict(seed=t.data_seed, dataset=t.train_datasets[0], eval_terms=t.eval_terms,
                      eval_digits=t.eval_digits, eval_size=t.eval_size,
                      solution_style=t.solution_style, spaces=t.spaces)
        if t.prompt_style is not None:
            common["prompt_style"] = t.prompt_style
        warm = cls(train_terms=t.train_terms, train_digits=t.train_digits, **common)
        rl = cls(train_terms=t.rl_terms or t.eval_terms,
                 train_digits=t.rl_digits or t.eval_digits, **common)
        return warm, rl

    def __init__(self, seed: int = 0, dataset: str = "chain_sum",
                 train_terms: Sequence[int] = (2, 3), train_digits: Sequence[int] = (1, 2),
                 eval_terms: Sequence[int] = (2, 4), eval_digits: Sequence[int] = (1, 2),
                 eval_size: int = 1000, prompt_style: str = "compact",
                 solution_style: str | None = None, spaces: bool = True,
                 allow_negation: bool = False, operators: Sequence[str] = ("+", "-", "*"),
                 allow_parentheses: bool = False):
        if dataset not in DATASETS:
            raise ConfigError(f"arithmetic task: dataset must be one of {DATASETS}, found {dataset!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ConfigError(f"arithmetic task: seed must be an int >= 0, found {seed!r}")
        if isinstance(eval_size, bool) or not isinstance(eval_size, int) or eval_size < 1:
            raise ConfigError(f"arithmetic task: eval_size must be an int >= 1, found {eval_size!r}")
        if solution_style is None:
            solution_style = "steps" if dataset == "chain_sum" else "answer"
        if solution_style not in SOLUTION_STYLES:
            raise ConfigError(f"arithmetic task: solution_style must be one of {SOLUTION_STYLES}, "
                              f"found {solution_style!r}")
        if solution_style == "steps" and dataset != "chain_sum":
            raise ConfigError(f"arithmetic task: solution_style 'steps' needs dataset 'chain_sum', "
                              f"found {dataset!r}")
        bad_ops = [op for op in operators if op not in ("+", "-", "*", "/")]
        if bad_ops or not operators:
            raise ConfigError(f"arithmetic task: operators must be a non-empty subset of + - * /, "
                              f"found {tuple(operators)!r}")
        self.seed = seed
        self.dataset = dataset
        self.train_terms = _range("train_terms", train_terms)
        self.train_digits = _range("train_digits", train_digits)
        self.eval_terms = _range("eval_terms", eval_terms)
        self.eval_digits = _range("eval_digits", eval_digits)
        self.eval_size = eval_size
        self.prompt_style = self._check_prompt_style(prompt_style)
        self.solution_style = solution_style
        self.spaces = bool(spaces)
        self.allow_negation = bool(allow_negation)
        self.operators = tuple(operators)
        self.allow_parentheses = bool(allow_parentheses)

        self._train_gen = self._generator(seed * _SEED_STRIDE, self.train_terms, self.train_digits)
        self._eval_gen = self._generator(seed * _SEED_STRIDE + _EVAL_OFFSET, self.eval_terms,
                                         self.eval_digits)
        self._eval: list[Problem] | None = None
        self._eval_expressions: frozenset[str] = frozenset()
        self._train_sources: list[int] = []   # generator index of train-stream problem i
        self._next_source = 0

    # ----- generation -----
    def _generator(self, rg_seed: int, terms: tuple[int, int], digits: tuple[int, int]):
        import reasoning_gym

        kwargs: dict[str, Any] = dict(min_terms=terms[0], max_terms=terms[1], min_digits=digits[0],
                                      max_digits=digits[1], allow_negation=self.allow_negation)
        if self.dataset == "basic_arithmetic":
            kwargs.update(operators=self.operators, allow_parentheses=self.allow_parentheses,
                          whitespace="single")
        try:
            return reasoning_gym.create_dataset(self.dataset, seed=rg_seed, size=1, **kwargs)
        except AssertionError as e:  # reasoning-gym validates with asserts
            raise ConfigError(f"arithmetic task: reasoning-gym {self.dataset} rejected {kwargs}: {e}") from e

    def _expression(self, entry: dict[str, Any]) -> str:
        expression = entry["metadata"]["expression"]
        return expression if self.spaces else expression.replace(" ", "")

    def _problem(self, entry: dict[str, Any], index: int, split: str, source: int) -> Problem:
        meta = {k: v for k, v in entry["metadata"].items() if k != "difficulty"}
        meta.update(dataset=self.dataset, source_index=source, rg_question=entry["question"])
        return Problem(id=index, split=split, prompt=self._expression(entry),
                       answer=str(entry["answer"]), metadata=meta)

    def _build_eval(self) -> None:
        problems: list[Problem] = []
        seen: set[str] = set()
        source = 0
        limit = 100 * self.eval_size + 10_000
        while len(problems) < self.eval_size:
            if source >= limit:
                raise ConfigError(
                    f"arithmetic task: only {len(problems)} distinct held-out problems in {limit} "
                    f"draws for eval_terms={self.eval_terms}, eval_digits={self.eval_digits}; "
                    f"lower eval_size ({self.eval_size}) or widen the ranges")
            entry = self._eval_gen[source]
            expression = self._expression(entry)
            if expression not in seen:
                seen.add(expression)
                problems.append(self._problem(entry, len(problems), EVAL, source))
            source += 1
        self._eval = problems
        self._eval_expressions = frozenset(seen)

    def eval_problems(self, n: int | None = None) -> list[Problem]:
        """Return the first `n` held-out problems (all `eval_size` when None).

        Raises:
          ConfigError: `n` > `eval_size`.
        """
        if self._eval is None:
            self._build_eval()
        return first_problems(self._eval, n, "arithmetic task (eval_size)")

    def train_problem(self, index: int) -> Problem:
        """Return train-stream problem `index`: the index-th generated problem not held out.

        Raises:
          ConfigError: the train mix keeps producing held-out expressions (the mix is too small).
        """
        if index < 0:
            raise ConfigError(f"train problem index must be >= 0, found {index}")
        if self._eval is None:
            self._build_eval()
        skips = 0
        while len(self._train_sources) <= index:
            entry = self._train_gen[self._next_source]
            if self._expression(entry) in self._eval_expressions:
                skips += 1
                if skips > _MAX_CONSECUTIVE_SKIPS:
                    raise ConfigError(
                        f"arithmetic task: {skips} consecutive train problems were held out; the "
                        f"train mix (terms {self.train_terms}, digits {self.train_digits}) is "
                        f"inside the held-out set")
            else:
                skips = 0
                self._train_sources.append(self._next_source)
            self._next_source += 1
            if self._next_source >= _EVAL_OFFSET:
                raise ConfigError("arithmetic task: train stream exhausted its seed range")
        source = self._train_sources[index]
        return self._problem(self._train_gen[source], index, TRAIN, source)

    # ----- reward and targets -----
    def reward(self, problem: Problem, completion: str) -> float:
        """Return 1.0 if the completion's final answer is right, else 0.0 (malformed: 0.0).

        The final answer is `extract_final_answer(completion)`; reasoning-gym's `score_answer`
        judges it. That scorer gives partial credit when the gold is a substring of a wrong answer
        (`157` for gold `57` scores 2/3), so only its exact verdict (1.0) counts.
        """
        answer = extract_final_answer(completion)
        if answer is None:
            return 0.0
        score = self._train_gen.score_answer(answer, {"answer": problem.answer,
                                                      "metadata": dict(problem.metadata)})
        return 1.0 if score == 1.0 else 0.0

    def solution_text(self, problem: Problem) -> str:
        """Return the worked answer (`= 19 - 3 = 16` or `= 16`; no end-of-turn token).

        Raises:
          TaskError: the reduction does not reach the gold answer (a generator/format mismatch).
        """
        sep = " " if self.spaces else ""
        if self.solution_style == "answer":
            return f"={sep}{problem.answer}"
        tokens = problem.metadata["expression"].split(" ")
        acc = int(tokens[0])
        steps = []
        for k in range(1, len(tokens), 2):
            op, value = tokens[k], int(tokens[k + 1])
            acc = acc + value if op == "+" else acc - value
            steps.append(sep.join([str(acc)] + tokens[k + 2:]))
        if str(acc) != problem.answer:
            raise TaskError(f"arithmetic task: reducing {problem.metadata['expression']!r} gives "
                            f"{acc}, the gold answer is {problem.answer}")
        return f"={sep}" + f"{sep}={sep}".join(steps)

    def tokenizer(self) -> TextTokenizer:
        """Return the character-level tokenizer (58 ids) that covers every prompt and solution."""
        return build_char_tokenizer()

    def config(self) -> dict[str, Any]:
        return {"seed": self.seed, "dataset": self.dataset, "train_terms": list(self.train_terms),
                "train_digits": list(self.train_digits), "eval_terms": list(self.eval_terms),
                "eval_digits": list(self.eval_digits), "eval_size": self.eval_size,
                "prompt_style": self.prompt_style, "solution_style": self.solution_style,
                "spaces": self.spaces, "allow_negation": self.allow_negation,
                "operators": list(self.operators), "allow_parentheses": self.allow_parentheses}
