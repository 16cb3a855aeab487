"""Grading: marked answers without a number (no false positives), number words,
negated markers, and the unmarked last-number fallback that must stay as it was."""
import pytest

from looprl.errors import TaskError
from looprl.tasks.grading import extract_answer, grade_answer, grade_symbolic, is_plain_number


# Three false positives to guard against: each would be graded by an earlier (or the negated)
# number.
def test_number_word_answer_is_not_graded_by_an_earlier_number():
    completion = "Each of the 6 hens lays 3 eggs each, so the answer is eighteen."
    assert extract_answer(completion) == "18"
    assert grade_answer(completion, "3") == 0.0
    assert grade_answer(completion, "6") == 0.0
    assert grade_answer(completion, "18") == 1.0


def test_boxed_number_words_are_not_graded_by_an_earlier_number():
    completion = "She has 3 boxes of 24 crayons, so $\\boxed{seventy-two}$."
    assert extract_answer(completion) == "72"
    assert grade_answer(completion, "3") == 0.0
    assert grade_answer(completion, "24") == 0.0
    assert grade_answer(completion, "72") == 1.0


def test_a_negated_number_is_no_answer():
    completion = "She had 20 dollars, so the answer is not 20"
    assert extract_answer(completion) is None
    assert grade_answer(completion, "20") == 0.0
    assert extract_answer("the answer is not 20") is None
    assert grade_answer("the answer is not 20", "20") == 0.0


# Marked answers whose words are not a number: no answer, whatever the earlier numbers say.
@pytest.mark.parametrize("completion, gold", [
    ("She had 5 apples and ate 5. \\boxed{none}", "5"),
    ("She had 5 apples and ate 5. $\\boxed{\\text{None}}$", "5"),
    ("There are 3 cats, so the answer is unknown.", "3"),
    ("There are 3 cats. **Final Answer:** undefined", "3"),
    ("Each of the 18 eggs, so the answer is nineteen eighty-four.", "18"),  # not one number
    ("With 18 eggs the answer is eighteenth.", "18"),  # an ordinal is no number
    ("With 100 pens the answer is hundreds.", "100"),
])
def test_marked_words_that_are_no_number_are_no_answer(completion, gold):
    assert extract_answer(completion) is None
    assert grade_answer(completion, gold) == 0.0


def test_words_answer_after_think_does_not_fall_back_to_the_thinking():
    completion = "<think>\nShe has 3 eggs, so the answer is 3.\n</think>\n\\boxed{none}"
    assert extract_answer(completion) is None
    assert grade_answer(completion, "3") == 0.0


def test_negated_answer_after_think_does_not_fall_back_to_the_thinking():
    completion = "<think>\nShe has 3 eggs, so the answer is 3.\n</think>\nThe answer is not 3."
    assert extract_answer(completion) is None
    assert grade_answer(completion, "3") == 0.0


def test_an_earlier_marked_answer_still_beats_a_later_word_phrase():
    completion = "\\boxed{72}\n\nI checked it twice, and the answer is correct."
    assert extract_answer(completion) == "72"
    assert grade_answer(completion, "72") == 1.0


# (number words, value): the grammar in the module docstring
WORDS = [
    ("zero", "0"), ("one", "1"), ("two", "2"), ("three", "3"), ("four", "4"), ("five", "5"),
    ("six", "6"), ("seven", "7"), ("eight", "8"), ("nine", "9"), ("ten", "10"), ("eleven", "11"),
    ("twelve", "12"), ("thirteen", "13"), ("fourteen", "14"), ("fifteen", "15"),
    ("sixteen", "16"), ("seventeen", "17"), ("eighteen", "18"), ("nineteen", "19"),
    ("twenty", "20"), ("thirty", "30"), ("forty", "40"), ("fifty", "50"), ("sixty", "60"),
    ("seventy", "70"), ("eighty", "80"), ("ninety", "90"),
    ("seventy-two", "72"), ("seventy two", "72"), ("Ninety-Nine", "99"),
    ("a hundred", "100"), ("one hundred", "100"), ("one hundred and five", "105"),
    ("one hundred five", "105"), ("three hundred forty-two", "342"), ("twelve hundred", "1200"),
    ("fifteen hundred and twenty", "1520"),
    ("a thousand", "1000"), ("two thousand three hundred", "2300"),
    ("two thousand and five", "2005"),
    ("one thousand, two hundred and one", "1201"), ("forty-five thousand", "45000"),
    ("three million four hundred thousand", "3400000"), ("two billion", "2000000000"),
    ("a dozen", "12"), ("two dozen", "24"),
    ("minus five", "-5"), ("negative twelve", "-12"), ("-five", "-5"), ("-seventy-two", "-72"),
    ("one half", "0.5"), ("a half", "0.5"), ("three quarters", "0.75"), ("a quarter", "0.25"),
    ("two fifths", "0.4"), ("two and a half", "2.5"), ("one and three quarters", "1.75"),
    ("minus one half", "-0.5"), ("one third", "1/3"), ("two and two thirds", "8/3"),
    ("two point five", "2.5"), ("zero point seven five", "0.75"),
]


@pytest.mark.parametrize("words, value", WORDS)
def test_number_words_in_a_marked_answer(words, value):
    # the earlier 7 never counts, only the words
    for completion in (f"Some 7 steps later, the answer is {words}.", f"\\boxed{{{words}}}",
                       f"7 steps. **Final Answer:** {words}"):
        assert extract_answer(completion) == value, completion
        assert grade_answer(completion, "7") == (1.0 if value == "7" else 0.0), completion
        if "/" not in value:
            assert grade_answer(completion, value) == 1.0, completion


@pytest.mark.parametrize("words, digits", [("one third", "1/3"), ("two and two thirds", "8/3")])
def test_fractions_without_an_exact_decimal_go_to_math_verify(words, digits):
    # graded exactly as the same fraction in digits is
    for gold in ("0.333", "0.3333333333", "2.667", "2.6666666667", "3"):
        assert grade_answer(f"\\boxed{{{words}}}", gold) == grade_answer(
            f"\\boxed{{{digits}}}", gold), gold
    assert grade_answer("\\boxed{one third}", "0.333") == 0.0
    assert grade_answer("\\boxed{two and two thirds}", "3") == 0.0


@pytest.mark.parametrize("completion, value", [
    ("so the answer is eighteen", "18"),
    ("So the answer is Eighteen eggs.", "18"),
    ("The answer is therefore eighteen.", "18"),
    ("The answer is **eighteen** dollars.", "18"),
    ("\\boxed{\\text{seventy-two clips}}", "72"),
    ("\\boxed{x = seventy-two}", "72"),
    ("The answer is eighteen (6 x 3).", "18"),  # the words lead, so they are the answer
    ("The answer is a total of 18 eggs.", "18"),  # `a` alone is no number word
    ("The answer is 18 (eighteen).", "18"),
    ("The answer is 70. Wait, the answer is seventy-two.", "72"),  # the later answer wins
    ("The answer is seventy. Wait, the answer is 72.", "72"),
])
def test_number_words_with_dressing(completion, value):
    assert extract_answer(completion) == value
    assert grade_answer(completion, value) == 1.0


@pytest.mark.parametrize("completion, value", [
    # only the text after a negated number counts
    ("The answer is not 20.\nRecounting: 48 + 24 = 72 clips.", "72"),
    ("The answer is not obvious, so we add: 48 + 24 = 72", "72"),
    ("The answer is 12 apples. Wait, the answer is not 12.", None),  # earlier answers are out
    ("The answer is not 12; it is 13. The answer is not 13.", None),
    ("The answer is 12. The answer is not 12; it is 13.", "13"),
    ("The answer is not 20. The answer is thirty.", "30"),  # a later marked answer
    ("Answer: not 20", None),
    ("The answer is not 1/2 but 24.", "24"),  # the negated number is the fraction
])
def test_negated_markers(completion, value):
    assert extract_answer(completion) == value
    for gold in ("12", "13", "20", "24", "30", "72"):
        assert grade_answer(completion, gold) == (1.0 if gold == value else 0.0)


@pytest.mark.parametrize("completion, value", [
    # an unmarked completion still falls back to its last number (digits only)
    ("She sold 48 + 24 = 72 clips", "72"),
    ("Three hens lay 3 eggs each, 9 in all; eighteen more tomorrow", "9"),
    ("She has three dogs and 4 cats.", "4"),
    ("I have seventy-two clips.", None),
    # a marker that introduces what follows (its tail ends with `:`) is no candidate
    ("The answer is as follows:\n48 + 24 = 72", "72"),
    # an empty box is no candidate
    ("\\boxed{72} \\boxed{}", "72"),
    # `####` lines read digits only: a Markdown heading in words is no candidate
    ("#### Step two\nShe sold 48 + 24 = 72 clips", "72"),
    ("#### One more check\nShe sold 48 + 24 = 72 clips", "72"),
    ("She sold 72 clips.\n#### Explanation\n", "72"),
    # corrections read digits only
    ("The answer is 12. Actually, thirteen.", "12"),
    # digits followed by a scale word: their value (the digits alone are not it)
    ("The answer is 192 million.", "192000000"),
])
def test_unchanged_behaviour(completion, value):
    assert extract_answer(completion) == value
    if value is not None:
        assert grade_answer(completion, value) == 1.0
    assert grade_answer(completion, "72" if value != "72" else "73") == 0.0


@pytest.mark.parametrize("completion, value, right, wrong", [
    # braced exponents and `\times 10^{n}` grade by value, not by the digits before `^`
    ("\\boxed{10^{3}}", "1000", "1000", "10"),
    ("\\boxed{3.5 \\times 10^{2}}", "350", "350", "35"),
    ("\\boxed{1.2 \\times 10^{-3}}", "0.0012", "0.0012", "1.2"),
    ("The answer is $2 \\times 10^{6}$.", "2000000", "2000000", "2"),
    ("\\boxed{2^{10}}", "2^10", "1024", "2"),  # other powers: math-verify
    # `x` / `×` between numbers in an answer equation: the right side
    ("The answer is 5 x 3 = 15.", "15", "15", "5"),
    ("The answer is 5 \u00d7 3 = 15.", "15", "15", "5"),
    ("The answer is 5\u00d73 = 15.", "15", "15", "5"),
    ("\\boxed{5 x 3 = 15}", "15", "15", "5"),
    ("\\boxed{5 \u00d7 3 = 15}", "15", "15", "5"),
    ("\\boxed{5 \\times 3 = 15}", "15", "15", "5"),
    ("The answer is 3 x 4.", "3 * 4", "12", "3"),  # a product alone: math-verify
    # LaTeX forms whose first number is not their value: math-verify, never the first number
    ("\\boxed{3\\frac{1}{2}}", "3\\frac{1}{2}", "3.5", "3"),
    ("\\boxed{2\\sqrt{3}}", "2\\sqrt{3}", None, "2"),
    ("\\boxed{3\\pi}", "3\\pi", None, "3"),
    ("The answer is 3\u03c0.", "3\\pi", None, "3"),
    ("\\boxed{5!}", "5!", "120", "5"),
    ("The answer is $5!$.", "5!", "120", "5"),
    ("\\boxed{18, 20}", "18, 20", None, "18"),
    ("The answer is 18, 20.", "18, 20", None, "18"),
    ("The answer is 1.5 million.", "1500000", "1500000", "1.5"),
    ("The answer is $2 billion.", "2000000000", "2000000000", "2"),
])
def test_forms_grade_by_value_never_by_first_number(completion, value, right, wrong):
    assert extract_answer(completion) == value
    if right is not None:
        assert grade_answer(completion, right) == 1.0
    assert grade_answer(completion, wrong) == 0.0


@pytest.mark.parametrize("completion, value", [
    ("The answer is 15!", "15"),            # an exclamation in prose, not a factorial
    ("The answer is 17, where x = 3.", "17"),
    ("\\boxed{30^\\circ}", "30"),           # degrees
    ("The answer is 2x = 14, so x = 7.", "7"),
    ("\\boxed{1,080}", "1080"),             # thousands, not a list
    ("She sold 5 x 3 = 15 clips.", "15"),
])
def test_near_misses_keep_their_number(completion, value):
    assert extract_answer(completion) == value
    assert grade_answer(completion, value) == 1.0


def test_a_huge_exponent_is_not_written_out():
    assert extract_answer("\\boxed{10^{100}}") == "1" + "0" * 100
    assert extract_answer("\\boxed{10^{999999999}}") == "10^999999999"  # math-verify's, as is


# A comma separates thousands only where the digit groups say so; other commas keep a list.
@pytest.mark.parametrize("gold, plain", [
    ("1,234", True), ("12,345,678", True), ("-1,080.5", True), ("1080", True),
    ("1,2", False), ("2,3,5", False), ("1, 2", False), ("1234,567", False), ("1,23", False),
])
def test_a_gold_comma_is_a_thousands_separator_only_between_groups_of_three(gold, plain):
    assert is_plain_number(gold) is plain


@pytest.mark.parametrize("completion, gold, score", [
    ("\\boxed{1, 2}", "1,2", 1.0), ("\\boxed{12}", "1,2", 0.0), ("\\boxed{2,1}", "1,2", 1.0),
    ("\\boxed{2,3,5}", "2,3,5", 1.0), ("\\boxed{235}", "2,3,5", 0.0),
    ("The answer is 2, 3 and 5.", "2,3,5", 0.0),  # an unboxed phrase reads its first form
    ("\\boxed{1,234}", "1234", 1.0), ("The answer is 1,080 dollars.", "1,080", 1.0),
    ("\\boxed{1,2}", "12", 0.0),  # a list is never the number its digits spell
])
def test_a_list_keeps_its_items(completion, gold, score):
    assert grade_symbolic(completion, gold) == score


@pytest.mark.parametrize("completion, value", [
    ("she sold 1,2 and 3", "3"), ("she sold 1,234 apples", "1234"),
    ("the items 1234,567", "567"), ("so 1,234.", "1234"), ("is 1,234.5", "1234.5"),
])
def test_the_last_number_fallback_reads_commas_by_their_groups(completion, value):
    assert extract_answer(completion) == value


@pytest.mark.parametrize("completion, gold, score", [
    ("Final Answer: \\(\\frac{5}{6}\\)", "5", 0.0),
    ("Final Answer: $\\frac{5}{6}$", "5", 0.0),
    ("Final Answer: \\(\\frac{5}{6}\\)", "\\frac{5}{6}", 1.0),
    ("The answer is \\[ \\frac{5}{6} \\]", "6", 0.0),
    ("The answer is \\( 2\\sqrt{3} \\).", "2", 0.0),
    ("The answer is \\(42\\).", "42", 1.0), ("The answer is \\[-7\\]", "-7", 1.0),
    ("\\boxed{\\(3\\pi\\)}", "3", 0.0),
])
def test_inline_and_display_math_read_like_dollars(completion, gold, score):
    assert grade_symbolic(completion, gold) == score


def test_a_list_gold_is_no_number_for_grade_answer():
    with pytest.raises(TaskError, match="'1,2'"):
        grade_answer("\\boxed{12}", "1,2")
