"""Task `math`: JSONL loading with configurable fields, level bounds, symbolic grading, errors."""
import json
from pathlib import Path

import pytest

from looprl.errors import ConfigError, TaskError
from looprl.tasks import get_task
from looprl.tasks.grading import grade_symbolic
from looprl.tasks.math_jsonl import read_math_jsonl

DATA = Path(__file__).parent / "data" / "math"


def test_shipped_files_load_with_levels_and_symbolic_golds():
    task = get_task("math", data_dir=str(DATA))
    held = task.eval_problems()
    assert len(held) == 12 and [p.id for p in held] == list(range(12))
    assert [p.answer for p in held[:5]] == ["\\frac{5}{6}", "2\\sqrt{3}", "(-\\infty, 3]", "3\\pi",
                                            "x^2 + 1"]
    assert held[11].answer == "1024"  # a JSON number gold becomes its string
    assert [p.metadata["level"] for p in held[5:8]] == [1.0, 3.0, 2.0]  # 1, "Level 3", "Level 2"
    assert held[0].metadata["line"] == 1
    # train: 10 records, one also held out (same problem text) -> 9, each once per epoch
    train = [task.train_problem(i).prompt for i in range(9)]
    assert len(set(train)) == 9 and held[0].prompt not in train
    assert task.train_problem(9).prompt in train  # epoch 2 starts
    # the recorded config rebuilds the same task (`looprl eval` on a run's checkpoint)
    again = get_task("math", **task.config())
    assert again.fingerprint() == task.fingerprint()
    assert [again.train_problem(i).prompt for i in range(9)] == train
    other = get_task("math", data_dir=str(DATA), seed=1)
    reseeded = [other.train_problem(i).prompt for i in range(9)]
    assert reseeded != train and sorted(reseeded) == sorted(train)  # another order, same set


def test_level_bounds_filter_and_drop_records_without_a_level():
    task = get_task("math", data_dir=str(DATA), min_level=2, max_level=3)
    assert [p.metadata["level"] for p in task.eval_problems()] == [2.0, 2.0, 3.0, 3.0, 2.0]
    # train levels: 1 2 1 3 2 4 1 1 5 none; in [2, 3]: 3 records
    assert len({task.train_problem(i).prompt for i in range(6)}) == 3
    with pytest.raises(ConfigError, match="min_level"):
        get_task("math", data_dir=str(DATA), min_level=4, max_level=2)
    with pytest.raises(ConfigError, match="no record .* has a level in \\[9, None\\]"):
        get_task("math", data_dir=str(DATA), min_level=9).eval_problems()
    assert len(task.eval_problems(5)) == 5
    with pytest.raises(ConfigError, match=r"math task .*test\.jsonl \(inside the level bounds\): "
                       r"asked for 6 held-out problems, there are 5"):
        task.eval_problems(6)


def test_field_names_are_configurable(tmp_path):
    rows = [{"question": "What is 1/2 + 1/2?", "final_answer": "1", "difficulty": 6.5},
            {"question": "Simplify sqrt(8).", "final_answer": "2\\sqrt{2}", "difficulty": 7.0}]
    (tmp_path / "deepmath.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = get_task("math", data_dir=str(tmp_path), eval_file="deepmath.jsonl",
                    problem_key="question", answer_key="final_answer", level_key="difficulty",
                    min_level=7)
    (p,) = task.eval_problems()
    assert p.answer == "2\\sqrt{2}" and p.metadata["level"] == 7.0
    assert task.reward(p, "So \\boxed{\\sqrt{8}}.") == 1.0
    assert task.reward(p, "So \\boxed{2}.") == 0.0
    assert task.solution_text(p) == "The final answer is \\boxed{2\\sqrt{2}}."


@pytest.mark.parametrize("completion, gold, reward", [
    ("so \\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0),
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("\\boxed{1/3}", "\\frac13", 1.0),
    ("\\boxed{\\sqrt{12}}", "2\\sqrt{3}", 1.0),
    ("\\boxed{2}", "2\\sqrt{3}", 0.0),
    ("\\boxed{(-\\infty, 3]}", "(-\\infty, 3]", 1.0),
    ("\\boxed{(-\\infty, 3)}", "(-\\infty, 3]", 0.0),
    ("\\boxed{3}", "(-\\infty, 3]", 0.0),
    ("\\boxed{3\\pi}", "3\\pi", 1.0),
    ("\\boxed{3}", "3\\pi", 0.0),
    ("\\boxed{x^2+1}", "x^2 + 1", 1.0),
    ("\\boxed{x^2-1}", "x^2 + 1", 0.0),
    ("\\boxed{\\text{Monday}}", "\\text{Monday}", 1.0),
    ("\\boxed{\\text{Sunday}}", "\\text{Monday}", 0.0),
    ("The answer is one half.", "\\frac{1}{2}", 1.0),
    ("<think>\\boxed{3}</think> \\boxed{\\frac{7}{2}}", "3\\frac{1}{2}", 1.0),
    ("<think>\\boxed{7/2}</think> \\boxed{3}", "3\\frac{1}{2}", 0.0),
    ("\\boxed{-2, 2}", "-2, 2", 1.0),
    ("\\boxed{2}", "-2, 2", 0.0),
    ("\\boxed{1,024}", "1024", 1.0),  # a number gold: grade_answer
])
def test_grade_symbolic(completion, gold, reward):
    assert grade_symbolic(completion, gold) == reward


@pytest.mark.parametrize("line, message", [
    ("not json", "bad.jsonl:2: invalid JSON"),
    ("[1, 2]", "bad.jsonl:2: expected a JSON object, found list"),
    ('{"answer": "1"}', "bad.jsonl:2: missing key 'problem'"),
    ('{"problem": "Q", "answer": ["1"]}', "bad.jsonl:2: key 'answer' must be a string or a number"),
    ('{"problem": "Q", "answer": " "}', "bad.jsonl:2: key 'answer' is empty"),
    ('{"problem": "Q", "answer": "1", "level": [1]}', "bad.jsonl:2: key 'level' must be a number"),
])
def test_bad_lines_name_file_and_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"problem": "What is 1+1?", "answer": "2"}\n' + line + "\n")
    with pytest.raises(TaskError, match=message.replace("[", "\\[")):
        read_math_jsonl(path)
    path.write_bytes(b'{"problem": "Q", "answer": "1"}\n\n{"problem": "\xff"}\n')
    with pytest.raises(TaskError, match="bad.jsonl:3: invalid UTF-8 at byte 14"):
        read_math_jsonl(path)


def test_missing_files_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="no directory with \\['test.jsonl'\\]"):
        get_task("math", data_dir=str(tmp_path))
    (tmp_path / "test.jsonl").write_text('{"problem": "Q", "answer": "1"}\n')
    task = get_task("math", data_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="no 'train.jsonl'"):
        task.train_problem(0)


def test_an_experiment_task_section_builds_the_math_task():
    import looprl.config as C
    from looprl.tasks import run_tasks

    cfg = C.apply_overrides(C.ExperimentConfig(), [
        "task.name=math", f"task.data_dir={DATA}", "task.min_level=2", "task.max_level=3",
        "task.prompt_style=thinking", "task.data_seed=4"])
    warm, rl = run_tasks(cfg.task, checkpoint="CKPT", warm_start=False)
    assert warm is rl and rl.config()["min_level"] == 2.0 and rl.seed == 4
    assert len(rl.eval_problems()) == 5 and rl.format_prompt(rl.eval_problems(1)[0]).endswith(
        "<think>\n")
    with pytest.raises(ConfigError, match="model.checkpoint"):
        run_tasks(cfg.task, checkpoint=None, warm_start=False)
    with pytest.raises(ConfigError, match="min_level"):
        C.apply_overrides(C.ExperimentConfig(), ["task.min_level=4", "task.max_level=2"])
