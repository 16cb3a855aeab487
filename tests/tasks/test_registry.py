"""The task registry: training set-up and `looprl eval` build every task through it."""
import argparse

import pytest

from looprl import config as C
from looprl.cli.eval import check_task_name, resolve_settings
from looprl.errors import ConfigError
from looprl.tasks import Problem, Task, base, get_task, run_tasks, task_class, task_names
from looprl.train.setup import build_tasks


class EchoTask(Task):
    """A task in one class: the answer is the prompt."""
    name = "echo"
    prompt_style = "compact"

    def __init__(self, seed: int = 0):
        self.seed = seed

    @classmethod
    def for_run(cls, section, *, checkpoint, warm_start):
        return cls(seed=section.data_seed), cls(seed=section.data_seed + 1)

    def train_problem(self, index):
        return Problem(index, "train", str(index + self.seed), str(index + self.seed))

    def eval_problems(self, n=None):
        return [Problem(i, "eval", str(-i), str(-i)) for i in range(n or 3)]

    def reward(self, problem, completion):
        return float(completion == problem.answer)

    def solution_text(self, problem):
        return problem.answer

    def config(self):
        return {"seed": self.seed}


@pytest.fixture
def echo(monkeypatch):
    monkeypatch.setitem(base._REGISTRY, "echo", EchoTask)
    return EchoTask


def _eval_args(**kw):
    args = dict(task=None, checkpoint="CKPT", data_dir=None, source=None, prompt_style=None,
                exit_threshold=None, limit=None, max_new_tokens=None, batch_size=None,
                kv_policy=None, compute_dtype=None, prompt_len_multiple=None, seed=None)
    return argparse.Namespace(**{**args, **kw})


def test_a_registered_task_is_built_by_training_set_up(echo):
    cfg = C.apply_overrides(C.ExperimentConfig(), ["task.name=echo", "task.data_seed=5"])
    warm, rl = build_tasks(cfg)
    assert isinstance(warm, EchoTask) and (warm.seed, rl.seed) == (5, 6)
    assert "echo" in task_names() and task_class("echo") is EchoTask


def test_a_registered_task_is_evaluated_by_looprl_eval(echo):
    st = resolve_settings(_eval_args(task="echo"), {})
    assert (st["task"], st["task_kwargs"]) == ("echo", {})
    assert get_task(st["task"], **st["task_kwargs"]).eval_problems(2)[1].answer == "-1"
    assert check_task_name("echo") == "echo"


def test_data_flags_go_only_to_tasks_with_data_options(echo):
    with pytest.raises(ConfigError, match="--data-dir: only the gsm8k and math tasks read data_dir"):
        resolve_settings(_eval_args(task="echo", data_dir="x"), {})
    st = resolve_settings(_eval_args(task="gsm8k", source="hub"), {})
    assert st["task_kwargs"] == {"data_dir": "../shared/data/gsm8k", "source": "hub"}
    with pytest.raises(ConfigError, match="--source: only the gsm8k task reads source"):
        resolve_settings(_eval_args(task="math", source="hub"), {})
    st = resolve_settings(_eval_args(task="math", data_dir="d"), {})
    assert st["task_kwargs"] == {"data_dir": "d"}


def test_unknown_task_names_the_config_key():
    with pytest.raises(ConfigError, match="config key 'task.name': unknown task 'chess'"):
        run_tasks(C.TaskConfig(name="chess"), checkpoint=None, warm_start=True)
    with pytest.raises(ConfigError, match="--task: expected one of"):
        check_task_name("chess")


def test_arithmetic_run_tasks_share_the_held_out_set():
    t = C.TaskConfig(train_datasets=("chain_sum",), eval_datasets=("chain_sum",), eval_size=20)
    warm, rl = run_tasks(t, checkpoint=None, warm_start=True)
    assert warm.eval_problems() == rl.eval_problems()
    assert (warm.train_terms, rl.train_terms) == ((2, 3), (2, 4))
