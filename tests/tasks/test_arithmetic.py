"""The reasoning-gym arithmetic task: scoring, held-out disjointness, determinism, resume."""
import json

import pytest

from looprl.errors import ConfigError
from looprl.tasks.arithmetic import ArithmeticTask, extract_final_answer
from looprl.tasks.base import Problem, get_task


@pytest.fixture(scope="module")
def task():
    return get_task("arithmetic", seed=0, eval_size=300)


@pytest.fixture(scope="module")
def problems(task):
    return task.train_problems(40) + task.eval_problems(40)


def test_right_answer_scores_one(task, problems):
    for p in problems:
        solution = task.solution_text(p)
        assert task.reward(p, solution) == 1.0, (p, solution)
        assert task.reward(p, solution + "<|im_end|>") == 1.0
        assert task.reward(p, f"= {p.answer}") == 1.0


def test_wrong_answer_scores_zero(task, problems):
    for p in problems:
        assert task.reward(p, f"= {int(p.answer) + 1}") == 0.0
        assert task.reward(p, f"= {-int(p.answer) if p.answer != '0' else 1}") == 0.0


def test_gold_as_substring_of_wrong_answer_scores_zero(task, problems):
    # reasoning-gym's scorer alone gives partial credit here (len(gold)/len(answer)).
    p = next(p for p in problems if not p.answer.startswith("-"))
    wrong = "1" + p.answer
    assert 0.0 < task._train_gen.score_answer(wrong, {"answer": p.answer}) < 1.0
    assert task.reward(p, f"= {wrong}") == 0.0


@pytest.mark.parametrize("completion", ["", "   ", "=", "= ", "abc", "= 5x", "= 1 + 2",
                                        "= 12.5", "<|im_end|>= 5"])
def test_malformed_completion_scores_zero(task, completion):
    p = Problem(id=0, split="train", prompt="2 + 3", answer="5",
                metadata={"expression": "2 + 3"})
    assert task.reward(p, completion) == 0.0


def test_unfinished_reduction_is_not_an_answer():
    assert extract_final_answer("= 19 - 3") is None
    assert extract_final_answer("= 19 - 3 = 16") == "16"
    assert extract_final_answer("= 16.") == "16"
    assert extract_final_answer("16<|im_end|>junk = 3") == "16"


def test_steps_solution_reduces_left_to_right():
    task = ArithmeticTask(spaces=True)
    p = Problem(id=0, split="train", prompt="12 + 7 - 3", answer="16",
                metadata={"expression": "12 + 7 - 3"})
    assert task.solution_text(p) == "= 19 - 3 = 16"
    assert ArithmeticTask(spaces=False).solution_text(p) == "=19-3=16"
    assert ArithmeticTask(solution_style="answer").solution_text(p) == "= 16"


def test_train_and_held_out_never_overlap(task):
    held_out = {p.prompt for p in task.eval_problems()}
    assert len(held_out) == 300  # deduplicated by expression
    train = task.train_problems(3000)
    assert not held_out & {p.prompt for p in train}
    # and the generator seeds are disjoint too
    assert task._train_gen.seed + train[-1].metadata["source_index"] < task._eval_gen.seed


def test_small_space_is_excluded_from_training():
    # 2-term 1-digit chain sums: 200 distinct; 150 held out, training sees only the other 50.
    task = ArithmeticTask(train_terms=(2, 2), train_digits=(1, 1), eval_terms=(2, 2),
                          eval_digits=(1, 1), eval_size=150)
    held_out = {p.prompt for p in task.eval_problems()}
    train = {p.prompt for p in task.train_problems(2000)}
    assert not held_out & train
    assert len(train) <= 50


def test_held_out_space_too_small_is_a_config_error():
    task = ArithmeticTask(eval_terms=(2, 2), eval_digits=(1, 1), eval_size=201)
    with pytest.raises(ConfigError, match="distinct held-out"):
        task.eval_problems()


def test_held_out_mix_can_be_harder(task):
    assert max(p.metadata["num_terms"] for p in task.train_problems(500)) == 3
    assert max(p.metadata["num_terms"] for p in task.eval_problems()) == 4


def test_same_seed_same_problems_other_seed_other_problems(task):
    again = get_task("arithmetic", seed=0, eval_size=300)
    assert again.train_problems(50, start=100) == task.train_problems(50, start=100)
    assert again.eval_problems(50) == task.eval_problems(50)
    other = get_task("arithmetic", seed=1, eval_size=300)
    assert [p.prompt for p in other.eval_problems(50)] != [p.prompt for p in task.eval_problems(50)]


def test_random_access_equals_sequential():
    a = ArithmeticTask(eval_size=100)
    b = ArithmeticTask(eval_size=100)
    late = a.train_problem(777)  # fresh task, jumps straight there
    assert late == b.train_problems(778)[-1]
    assert late.id == 777


def test_iterator_resume_is_exact(task):
    it = task.train_iterator()
    it.next_batch(8)
    state = json.loads(json.dumps(it.state_dict()))
    expected = it.next_batch(8) + it.next_batch(5)
    fresh = get_task("arithmetic", seed=0, eval_size=300).train_iterator()
    fresh.load_state_dict(state)
    assert fresh.next_batch(8) + fresh.next_batch(5) == expected
    assert fresh.position == 21


def test_iterator_refuses_state_of_another_configuration(task):
    state = task.train_iterator(position=4).state_dict()
    other = get_task("arithmetic", seed=0, eval_size=300, train_terms=(2, 4)).train_iterator()
    with pytest.raises(ConfigError, match="configuration differs"):
        other.load_state_dict(state)
    with pytest.raises(ConfigError, match="missing key"):
        task.train_iterator().load_state_dict({"position": 3})


@pytest.mark.parametrize("style", ["compact", "chatml", "thinking"])
def test_char_tokenizer_covers_every_prompt_and_solution(style):
    task = ArithmeticTask(prompt_style=style, eval_size=100)
    tok = task.tokenizer()
    for p in task.train_problems(100) + task.eval_problems(100):
        text = task.format_prompt(p) + task.solution_text(p) + "<|im_end|>"
        assert tok.decode(tok.encode(text)) == text  # strict encode: no unknown character


def test_compact_prompt_uses_chatml_ids(task):
    p = task.eval_problems(1)[0]
    ids = task.tokenizer().encode(task.format_prompt(p))
    assert ids[0] == 1 and ids[-2:] == [2, 1]


def test_other_generators():
    for dataset in ("basic_arithmetic", "products"):
        task = ArithmeticTask(dataset=dataset, eval_size=50)
        for p in task.train_problems(20) + task.eval_problems(20):
            assert task.reward(p, task.solution_text(p)) == 1.0
            assert task.reward(p, f"= {int(p.answer) + 1}") == 0.0


@pytest.mark.parametrize("kwargs, match", [
    ({"dataset": "calculus"}, "dataset"),
    ({"train_terms": (3, 2)}, "train_terms"),
    ({"eval_digits": (0, 2)}, "eval_digits"),
    ({"dataset": "products", "solution_style": "steps"}, "steps"),
    ({"prompt_style": "alpaca"}, "prompt_style"),
    ({"eval_size": 0}, "eval_size"),
    ({"operators": ("%",)}, "operators"),
    ({"nonsense": 1}, "nonsense"),
])
def test_bad_configuration_is_rejected(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        get_task("arithmetic", **kwargs)


def test_unknown_task_is_rejected():
    with pytest.raises(ConfigError, match="unknown task"):
        get_task("chess")
