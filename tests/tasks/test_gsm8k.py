"""GSM8K: grading completions written the ways models write them, data loading and its errors.

Gold answers come from the real train file (/work/shared/data/gsm8k/train.jsonl, located by
0-based record index); those tests are skipped when the file is absent.
"""
import json
from pathlib import Path

import pytest

from looprl.errors import ConfigError, TaskError
from looprl.tasks.base import get_task
from looprl.tasks.grading import extract_answer, grade_answer
from looprl.tasks.gsm8k import REPO_ROOT, parse_gsm8k_answer, read_gsm8k_jsonl

DATA_DIR = REPO_ROOT / ".." / "shared" / "data" / "gsm8k"
TRAIN_FILE = DATA_DIR / "train.jsonl"
needs_data = pytest.mark.skipif(not TRAIN_FILE.is_file(),
                                reason=f"GSM8K train file not found at {TRAIN_FILE}: the data is "
                                "not in the repository (docs/GUIDE.md, 'Install')")


@pytest.fixture(scope="module")
def train_lines():
    return TRAIN_FILE.read_text(encoding="utf-8").splitlines()


def gold_at(lines, index):
    return parse_gsm8k_answer(json.loads(lines[index])["answer"])[1]


def thousands(g):
    return f"{int(g):,}"


# (record index, completion built from the gold g, expected reward). Index 0: 72 (clips),
# 1: 10 ($ per hour), 2: 5, 3: 42, 4: 624 (pages), 5: 35, 9: 990 ($18.00 an hour), 14: 5 (hours),
# 15: 448000, 345: "1,080" in the file, 402: 192000000, 5715: -7 (temperatures), 5844: -47,
# 6189: -12.
CASES = [
    # the #### convention
    (0, lambda g: f"Natalia sold 48/2 = 24 clips in May.\nShe sold 48+24 = 72 clips.\n#### {g}", 1.0),
    (15, lambda g: f"#### ${thousands(g)}", 1.0),
    (5844, lambda g: f"The smallest is -49, so the middle one is\n#### {g}", 1.0),
    # \boxed{}, nested braces, LaTeX dressing
    (0, lambda g: f"So the answer is $\\boxed{{{g}}}$.", 1.0),
    (0, lambda g: f"\\boxed{{\\text{{{g}}}}}", 1.0),
    (4, lambda g: f"He writes \\boxed{{{g} \\text{{ pages}}}} a year.", 1.0),
    (15, lambda g: f"\\boxed{{\\${thousands(g)}}}", 1.0),
    (15, lambda g: f"\\boxed{{{thousands(g).replace(',', '{,}')}}}", 1.0),
    (0, lambda g: "\\boxed{\\frac{144}{2}}", 1.0),
    (0, lambda g: f"\\boxed{{48 + 24 = {g}}}", 1.0),
    (0, lambda g: f"\\fbox{{{g}}}", 1.0),
    (0, lambda g: "\\boxed{144/2}", 1.0),
    (0, lambda g: f"The answer is {g} clips (48 + 48/2).", 1.0),
    # currency, units, thousands separators, trailing zeros and periods
    (1, lambda g: f"The answer is $\\${g}.00$.", 1.0),
    (1, lambda g: f"Answer: ${g}.00", 1.0),
    (1, lambda g: f"Weng earns 12/60 = $0.2 per minute, so she earned 0.2 x 50 = ${g}.", 1.0),
    (345, lambda g: f"The answer is: ${thousands(g)}.", 1.0),
    (4, lambda g: f"The answer is {g} pages.", 1.0),
    (5, lambda g: f"#### {g}.00", 1.0),
    (5, lambda g: f"\\boxed{{{g}.0}}", 1.0),
    (3, lambda g: f"**Final Answer:** {g}.", 1.0),
    (3, lambda g: f"The final answer is {g}", 1.0),
    # signs
    (5715, lambda g: f"The answer is {g}.", 1.0),
    (5715, lambda g: f"\\boxed{{{g.replace('-', chr(0x2212))}}}", 1.0),
    (5715, lambda g: f"The answer is {g.lstrip('-')}.", 0.0),
    # several candidates: the last one counts
    (0, lambda g: f"The answer is 70. Wait, 48 + 24 = {g}, so the answer is {g}.", 1.0),
    (0, lambda g: f"\\boxed{{70}}\nActually, recomputing: \\boxed{{{g}}}", 1.0),
    (0, lambda g: f"\\boxed{{{g}}}\nHmm, on second thought \\boxed{{70}}", 0.0),
    # long text after the answer
    (0, lambda g: f"#### {g}\n\nLet me double-check: 48 / 2 = 24 and 48 + 24 = 72. 100 or 3 more.", 1.0),
    (2, lambda g: f"The answer is {g}. She has 100 / 2 = 50 and needs 100 - 50 - 15 - 30 more, "
                  f"out of 100 dollars.", 1.0),
    # Thinking models: the answer after </think> counts
    (0, lambda g: f"<think>\nmaybe the answer is 70\n</think>\nThe answer is \\boxed{{{g}}}.", 1.0),
    (0, lambda g: f"<think>\nso the answer is {g}\n</think>\nI am done.", 1.0),
    # rates and units right after the number are not divisions
    (1, lambda g: f"She earned 0.2 x 50 = 10 dollars. The answer is ${g}/hour.", 1.0),
    (1, lambda g: f"\\boxed{{\\${g}/\\text{{hour}}}}", 1.0),
    (14, lambda g: f"120/8 = 15 units of 20 minutes = 300 minutes. **Answer:** {g} hrs", 1.0),
    # unevaluated arithmetic inside the answer goes to math-verify
    (0, lambda g: "\\boxed{144 \\div 2}", 1.0),
    (0, lambda g: "\\boxed{48 + 24}", 1.0),
    (402, lambda g: "\\boxed{1.92 \\times 10^8}", 1.0),
    (402, lambda g: f"#### {thousands(g)}", 1.0),
    (402, lambda g: f"\\boxed{{{thousands(g).replace(',', chr(92) + ',')}}}", 1.0),
    (15, lambda g: f"The total is {thousands(g).replace(',', chr(0x202f))} dollars.", 1.0),
    (9, lambda g: f"Tina makes \\$18.00 an hour; in total she makes $\\boxed{{\\${g}.00}}$.", 1.0),
    (9, lambda g: f"\\boxed{{{g}.}}", 1.0),
    (6189, lambda g: f"\\boxed{{-\\${g.lstrip('-')}}}", 1.0),
    (6189, lambda g: f"The answer is $({g})$ dollars.", 1.0),
    # a marker that ends its line (a list follows): the last number counts
    (0, lambda g: f"The answer is:\n- April: 48\n- May: 24\n- Total: {g}", 1.0),
    (0, lambda g: f"**Final Answer**\n\\[\n\\boxed{{{g}}}\n\\]", 1.0),
    # an unclosed box (truncated generation) and an empty later box
    (3, lambda g: f"Julie read 12 + 24 = 36 pages, so 84 remain; half is \\boxed{{{g}", 1.0),
    (3, lambda g: f"\\boxed{{{g}}} \\boxed{{}}", 1.0),
    # wrong or missing answers
    (0, lambda g: f"#### {int(g) + 1}", 0.0),
    (0, lambda g: f"The answer is {g}0.", 0.0),
    (1, lambda g: f"Answer: ${g}0.", 0.0),
    (0, lambda g: "\\boxed{7.2}", 0.0),
    (15, lambda g: "\\boxed{448}", 0.0),
    (0, lambda g: "\\boxed{\\frac{1}{2}}", 0.0),
    (0, lambda g: "I don't know.", 0.0),
    (0, lambda g: f"The answer is {g[0]},{g[1:]}", 0.0),  # `7,2` is no thousands separator
    (402, lambda g: "The answer is 192 million.", 1.0),  # digits and a scale word: their value
    (402, lambda g: "The answer is 192.", 0.0),
    (6189, lambda g: f"\\boxed{{{g.lstrip('-')}}}", 0.0),  # the sign matters
    (0, lambda g: "", 0.0),
]


@needs_data
@pytest.mark.parametrize("index, make, expected", CASES,
                         ids=[f"{i}-{n}" for n, (i, _, _) in enumerate(CASES)])
def test_grading_real_gold(train_lines, index, make, expected):
    gold = gold_at(train_lines, index)
    completion = make(gold)
    assert grade_answer(completion, gold) == expected, (completion, gold, extract_answer(completion))


def test_two_answer_phrases_on_one_line_the_later_counts():
    # regression: the phrase regex once swallowed the rest of the line, hiding the second phrase
    assert extract_answer("The answer is 70. Wait, 48 + 24 = 72, so the answer is 72.") == "72"


# (completion, the extracted answer, a gold it equals): later clauses, ranges, fractions, spaced
# thousands, signed parentheses, corrections and negated markers
EXTRACTED = [
    ("The answer is 17, where x = 3.", "17", "17"),  # `=` in a later clause: not an equation
    ("The answer is x = 7.", "7", "7"),  # an equation-like answer: the part after `=`
    ("The answer is 3 apples + 4 apples = 7 apples.", "7", "7"),
    ("The answer is 2x = 14, so x = 7.", "7", "7"),
    ("She earns 56 dollars during days 1-7", "7", "7"),  # a range hyphen is no minus sign
    ("The low was (-7) degrees, then it rose by 3 to -4", "-4", "-4"),
    ("It is 3 degrees warmer than -5", "-5", "-5"),
    ("It takes 1/2 hour.", "0.5", "0.5"),  # a fraction in the last-number fallback
    ("Each gets 3/4 of a pie", "0.75", "0.75"),
    ("The date was 1/2/2020 and she paid 7", "7", "7"),
    ("The answer is 1 000", "1000", "1000"),  # a plain space between groups of exactly 3 digits
    ("The answer is 12 345 678 people.", "12345678", "12345678"),
    ("In total: 2 000", "2000", "2000"),
    ("The answer is 12 34", "12", "12"),  # `34` is no group of three
    ("The answer is -(-18)", "18", "18"),  # signed parentheses are evaluated
    ("The answer is -(18) dollars.", "-18", "-18"),
    ("The answer is -(-(-18)).", "-18", "-18"),
    ("The answer is 12 apples. Wait, actually 13.", "13", "13"),  # a correction wins
    ("The answer is 12. Correction: 13 apples.", "13", "13"),
    ("The answer is 12. Actually, it's $13.", "13", "13"),
    ("Actually 5 hours a day, so 5*7 = 35 hours. The answer is 35.", "35", "35"),
    ("The answer is 15. Actually, 13 is wrong.", "15", "15"),  # a statement, no correction
    ("The answer is 15. Actually, 13 would be too few.", "15", "15"),
    ("Actually, 48/2 = 24 clips in May and 48 + 24 = 72 in all", "72", "72"),  # no bare number
    ("The answer is not 20; it is 30.", "30", "30"),  # a negated marker is no answer
    ("The answer isn't 20. It is 30", "30", "30"),
    ("The answer is **not** 20, but 30", "30", "30"),
]


@pytest.mark.parametrize("completion, extracted, gold", EXTRACTED)
def test_extracted_answer(completion, extracted, gold):
    assert extract_answer(completion) == extracted
    assert grade_answer(completion, gold) == 1.0


def test_fraction_without_an_exact_decimal_goes_to_math_verify():
    assert extract_answer("He ate 1/3") == "1/3"
    assert extract_answer("Each ate 1/2/3 of it: -7/8") == "-0.875"
    assert extract_answer("So x = total/4") == "4"  # a divisor without a numerator is a number
    assert extract_answer("In all 5/1024 of them") == "0.0048828125"
    assert grade_answer("He ate 1/3", "0.333") == 0.0
    assert grade_answer("He ate 2/6", "0.5") == 0.0
    assert grade_answer("It takes 1/2 hour.", "1") == 0.0
    assert grade_answer("It takes 4/2 hours.", "2") == 1.0


@needs_data
def test_gold_values_from_the_file(train_lines):
    assert [gold_at(train_lines, i) for i in (0, 15, 345, 5715)] == ["72", "448000", "1080", "-7"]
    assert json.loads(train_lines[345])["answer"].endswith("#### 1,080")


@needs_data
def test_task_reads_real_files_with_ids_and_lines(train_lines):
    task = get_task("gsm8k")  # default data_dir ../shared/data/gsm8k, found via the repo root
    held_out = task.eval_problems()
    assert len(held_out) == 1319
    assert [p.id for p in held_out[:3]] == [0, 1, 2] and held_out[2].metadata["line"] == 3
    p = task.train_problem(0)
    assert p.prompt == json.loads(train_lines[p.id])["question"].strip()
    assert task.reward(p, task.solution_text(p)) == 1.0
    prompt = task.format_prompt(p)
    assert prompt.startswith("<|im_start|>user\n") and prompt.endswith("<|im_start|>assistant\n")
    assert get_task("gsm8k", prompt_style="thinking").format_prompt(p).endswith(
        "<|im_start|>assistant\n<think>\n")


def write_data(directory, train_lines, test_lines=None):
    directory.mkdir(parents=True, exist_ok=True)
    ok = json.dumps({"question": "1+1?", "answer": "1+1=2\n#### 2"})
    (directory / "train.jsonl").write_text("\n".join(train_lines) + "\n")
    (directory / "test.jsonl").write_text("\n".join(test_lines or [ok]) + "\n")


@pytest.mark.parametrize("bad_line, match", [
    ('{"question": "q", "answer": "4 #### 4"', "invalid JSON"),
    ('["q", "#### 4"]', "expected a JSON object"),
    ('{"question": "q"}', "missing key 'answer'"),
    ('{"question": 3, "answer": "#### 4"}', "'question' must be a string"),
    ('{"question": "q", "answer": "the answer is 4"}', "no '#### N'"),
    ('{"question": "q", "answer": "so #### four"}', "not a number"),
])
def test_malformed_line_names_file_and_line(tmp_path, bad_line, match):
    ok = json.dumps({"question": "2+2?", "answer": "2+2=4\n#### 4"})
    write_data(tmp_path, [ok, "", bad_line, ok])  # blank line 2 is skipped; the bad one is line 3
    task = get_task("gsm8k", data_dir=str(tmp_path))
    assert [p.answer for p in task.eval_problems()] == ["2"]  # the held-out set needs no train file
    with pytest.raises(TaskError, match=match) as info:
        task.train_problem(0)  # the train stream reads the train file (and the test file)
    assert f"{tmp_path / 'train.jsonl'}:3:" in str(info.value)


@pytest.mark.parametrize("bad_line", ['{"question": "q", "answer": "4 #### 4"',
                                      '{"question": "q", "answer": "#### 4",',
                                      '{"question": "q", "answer": "#### 4"}}'])
def test_invalid_json_reports_the_column_in_the_line(tmp_path, bad_line):
    ok = json.dumps({"question": "2+2?", "answer": "#### 4"})
    write_data(tmp_path, [ok], [ok, bad_line])
    with pytest.raises(TaskError) as info:
        get_task("gsm8k", data_dir=str(tmp_path)).eval_problems()
    column = len(bad_line) if bad_line.endswith("}}") else len(bad_line) + 1
    assert f"{tmp_path / 'test.jsonl'}:2: invalid JSON (" in str(info.value)
    assert str(info.value).endswith(f" at column {column})")


def test_invalid_utf8_names_file_and_line(tmp_path):
    ok = json.dumps({"question": "2+2?", "answer": "#### 4"}).encode()
    write_data(tmp_path, [ok.decode()])
    (tmp_path / "test.jsonl").write_bytes(ok + b"\n\n" + b'{"question": "caf\xe9?", "answer": "#### 4"}\n')
    with pytest.raises(TaskError, match="invalid UTF-8") as info:
        get_task("gsm8k", data_dir=str(tmp_path)).eval_problems()
    assert str(info.value).startswith(f"{tmp_path / 'test.jsonl'}:3: invalid UTF-8 at byte 18 of the line")


def test_eval_needs_only_the_test_file_train_needs_both(tmp_path):
    shared = json.dumps({"question": "What is 1 + 1?", "answer": "#### 2"})
    (tmp_path / "test.jsonl").write_text(shared + "\n")
    task = get_task("gsm8k", data_dir=str(tmp_path))
    assert task.resolved_dir == tmp_path.resolve()
    assert [(p.id, p.answer) for p in task.eval_problems()] == [(0, "2")]
    with pytest.raises(ConfigError, match="train.jsonl"):
        task.train_problem(0)
    (tmp_path / "train.jsonl").write_text(
        shared + "\n" + json.dumps({"question": "What is 2 + 2?", "answer": "#### 4"}) + "\n")
    # read lazily on the first train request; the question shared with the test file is skipped
    assert [(p.id, p.answer) for p in task.train_problems(3)] == [(1, "4")] * 3


def test_small_files_ids_split_and_resume(tmp_path):
    lines = [json.dumps({"question": f"What is {i} + {i}?", "answer": f"#### {2 * i:,}"})
             for i in range(600, 610)]
    shared = json.dumps({"question": "What is 600 + 600?", "answer": "#### 1,200"})
    write_data(tmp_path, lines, [shared])
    task = get_task("gsm8k", data_dir=str(tmp_path), seed=3)
    assert [p.answer for p in read_gsm8k_jsonl(tmp_path / "train.jsonl")][:2] == ["1200", "1202"]
    # the train question that is also in the test file never appears in the train stream
    stream = task.train_problems(27)
    assert "What is 600 + 600?" not in {p.prompt for p in stream}
    assert sorted(p.id for p in stream[:9]) == list(range(1, 10))  # one epoch = 9 records
    assert [p.id for p in stream[:9]] != [p.id for p in stream[9:18]]  # reshuffled per epoch
    it = task.train_iterator()
    it.next_batch(7)
    state = it.state_dict()
    again = get_task("gsm8k", data_dir=str(tmp_path), seed=3).train_iterator()
    again.load_state_dict(state)
    assert again.next_batch(5) == it.next_batch(5) == stream[7:12]


def test_relative_data_dir_resolves_against_repo_root(tmp_path, monkeypatch):
    rel = Path("tests") / "tasks" / "_no_such_dir"
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="_no_such_dir"):
        get_task("gsm8k", data_dir=str(rel))
    write_data(tmp_path / "here", [json.dumps({"question": "q", "answer": "#### 1"})])
    assert get_task("gsm8k", data_dir="here").resolved_dir == (tmp_path / "here").resolve()


def test_hub_source_without_datasets_is_a_clear_error(monkeypatch):
    import builtins
    real_import = builtins.__import__

    def no_datasets(name, *args, **kwargs):
        if name == "datasets":
            raise ImportError("no datasets")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_datasets)
    with pytest.raises(ConfigError, match="datasets"):
        get_task("gsm8k", source="hub").eval_problems(1)
