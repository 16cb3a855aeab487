"""Final-answer extraction and grading for math word problems (GSM8K), with `math-verify`.

`extract_answer` finds a completion's final answer: the last marked answer that holds a value
(`\\boxed{...}`, a `#### N` line, `The answer is ...`, a correction `actually N`), else the last
number; after `</think>` first. `candidate_value` reads one candidate (numbers, number words,
scientific and scale forms by value; LaTeX forms for math-verify). `grade_answer` compares the
value with the gold: a plain number by its `Decimal` value (`18.00` == `18`, `1,080` == `1080`),
anything else with `math_verify.verify`; `grade_symbolic` takes a symbolic gold (`\\frac{1}{2}`).
"""
from __future__ import annotations

import re
import threading
from decimal import Decimal, InvalidOperation

from looprl.errors import TaskError
from looprl.tasks.number_words import number_words_value, ratio_string

_BOX_RE = re.compile(r"\\(?:boxed|fbox)\s*(\{)?")
_HASH_RE = re.compile(r"####\s*([^\n]*)")
_PHRASE_RE = re.compile(  # `answer is`, not `answer is not` / `answer isn't`
    r"(?i)\banswer\b[ \t]*(?:\*\*)?[ \t]*(?:(?:is|was)\b|=|:)"
    r"(?![ \t]*(?:\*\*)?[ \t]*:?[ \t]*(?:\*\*)?not\b)[ \t]*(?:\*\*)?[ \t]*:?[ \t]*")
_NEGATED_RE = re.compile(  # the markers `_PHRASE_RE` refuses: `answer is not`, `answer isn't`
    r"(?i)\banswer\b[ \t]*(?:\*\*)?[ \t]*(?:(?:(?:is|was)\b|=|:)[ \t]*(?:\*\*)?[ \t]*:?[ \t]*"
    r"(?:\*\*)?not\b|(?:is|was)n['\u2019]t\b)")
_CORRECTION_RE = re.compile(
    r"(?i)\b(?:actually|correction)\b[ \t]*[,:]?[ \t]*(?:it'?s\b|it is\b)?[ \t]*")
_BARE_ANSWER_RE = re.compile(  # `13`, `-13.5`, `13 apples`, `13%`; not `13 is wrong`
    r"[-+]?(?:\d+(?:\.\d+)?|\.\d+)\s*%?(?:\s*(?!(?:is|was|not|would|will|can|could|might)\b)"
    r"[A-Za-z]+)?[\s.!]*")
_SIGN = r"(?:(?<![0-9A-Za-z])[-+])?"  # `-7`, `(-7`, `= -7`; not the hyphen of `1-7` or `x-7`
_NUM_RE = re.compile(rf"{_SIGN}(?:\d{{1,3}}(?:,\d{{3}})+|\d+)(?:\.\d+)?|{_SIGN}\.\d+")
_FALLBACK_RE = re.compile(  # a number, or a fraction `1/2` (not a date `1/2/2020`)
    rf"(?<![\d/.]){_SIGN}(\d+)/(\d+)(?![\d/])|(?<![\d.])(?:{_NUM_RE.pattern})")
_SPACE_THOUSANDS_RE = re.compile(r"(?<![\d.,])\d{1,3}(?: \d{3})+(?!\d)")
_PARENS_NUM_RE = re.compile(r"([-+(\s]*)(\d+(?:\.\d+)?|\.\d+)([\s)]*)")
_OPERATOR_RE = re.compile(r"[-+*/^]|\\frac|\\sqrt|\d[A-Za-z](?![A-Za-z])")  # `+`, `2x`
_TEXT_CMD_RE = re.compile(r"\\(?:text|textbf|textrm|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}")
_LATEX_EXPRESSION_RE = re.compile(r"[-+]?\s*\\(?:frac|sqrt)")
_OPERAND = r"\(?\s*[-+]?(?:\d+(?:\.\d+)?|\.\d+)\s*\)?"
_ARITHMETIC_RE = re.compile(rf"[-+]?\s*{_OPERAND}(?:\s*[-+*/^]\s*{_OPERAND})+")
_THOUSANDS_RE = re.compile(r"(?<=\d)(?:\{,\}|\\,|\\ |\\!|\u2009|\u202f|\u00a0)(?=\d{3}(?!\d))")
_COMMA_RUN_RE = re.compile(r"(?<!\d)\d+(?:,\d+)+")  # digits joined by commas: `1,234`, `2,3,5`
_COMMA_GROUPS_RE = re.compile(r"\d{1,3}(?:,\d{3})+")  # `1,234`, `12,345,678`: one number
_PLAIN_GOLD_RE = re.compile(r"\s*[-+]?(?:\d{1,3}(?:,\d{3})+|\d*)(?:\.\d*)?\s*")
_LATEX_DELIMITERS = ("\\(", "\\)", "\\[", "\\]")  # inline and display math, like `$`
_SENTENCE_END_RE = re.compile(r"\.(?:\s|$)(?!\d)")
_BRACED_EXPONENT_RE = re.compile(r"\^\s*\{\s*([-+]?\d+)\s*\}")  # `10^{3}` -> `10^3`
_TIMES_RE = re.compile(r"(?<=[\d)])\s*[x\u00d7]\s*(?=\(?[-+]?\.?\d)")  # `5 x 3`, `5×3`
_LEAD_NUM = r"[-+]?\s*(?:\d+(?:\.\d+)?|\.\d+)"
_SCI_RE = re.compile(rf"({_LEAD_NUM})\s*\*\s*10\s*\^\s*([-+]?\d+)|10\s*\^\s*([-+]?\d+)")
_SCALE_RE = re.compile(rf"({_LEAD_NUM})\s*(thousand|million|billion|trillion)\b", re.I)
_SCALES = {"thousand": 3, "million": 6, "billion": 9, "trillion": 12}
_LATEX_FORM_RE = re.compile(  # a number whose LaTeX form goes on: `3\frac{1}{2}`, `2\sqrt{3}`, `3\pi`
    rf"{_LEAD_NUM}\s*(?:\\frac\s*\{{[^{{}}]*\}}\s*\{{[^{{}}]*\}}|"
    rf"\\sqrt\s*(?:\[[^\]]*\])?\s*(?:\{{[^{{}}]*\}}|\d+)|\\pi\b)")
_FACTORIAL_RE = re.compile(rf"{_LEAD_NUM}\s*!(?!=)")
_LIST_RE = re.compile(rf"{_LEAD_NUM}(?:\s*,\s*{_LEAD_NUM})+(?!\.?\d)")  # `18, 20`
_MAX_CANDIDATE_CHARS = 200

def _boxed_candidates(text: str) -> list[tuple[int, str]]:
    found = []
    for m in _BOX_RE.finditer(text):
        if m.group(1) is None:  # `\boxed 72`
            rest = re.match(r"\s*([^\s$]+)", text[m.end():])
            if rest:
                found.append((m.start(), rest.group(1)))
            continue
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            found.append((m.start(), text[m.end():i - 1]))
    return found


def _phrase_candidates(text: str, marker: re.Pattern = _PHRASE_RE) -> list[tuple[int, str]]:
    found = []
    for m in marker.finditer(text):  # the marker only, so a later phrase on the line is found
        line_end = text.find("\n", m.end())
        tail = text[m.end():line_end if line_end >= 0 else len(text)]
        end = _SENTENCE_END_RE.search(tail)
        tail = tail[:end.start()] if end else tail
        if not tail.rstrip().endswith(":"):  # `The answer is as follows:` introduces what follows
            found.append((m.start(), tail))
    return found


def _negated_candidates(text: str) -> list[tuple[int, int]]:
    """`answer is not 20`: (the marker's position, where the text after the negation starts): after
    the first number of the negated sentence, or after `not` when that sentence holds none."""
    found = []
    for m in _NEGATED_RE.finditer(text):
        line_end = text.find("\n", m.end())
        tail = text[m.end():line_end if line_end >= 0 else len(text)]
        end = _SENTENCE_END_RE.search(tail)
        number = _FALLBACK_RE.search(tail[:end.start()] if end else tail)  # `20`, `1/2`
        found.append((m.start(), m.end() + (number.end() if number else 0)))
    return found


def _correction_candidates(text: str) -> list[tuple[int, str]]:
    """`actually 13`, `Correction: $13 apples`: the sentence after the marker is a bare number and
    at most one word (a unit), so reasoning such as `actually, 48/2 = 24 ...` or a statement such
    as `actually, 13 is wrong` is no candidate."""
    return [(pos, tail) for pos, tail in _phrase_candidates(text, _CORRECTION_RE)
            if _BARE_ANSWER_RE.fullmatch(_clean(tail))]


def _drop_thousands_commas(text: str) -> str:
    """`1,234` -> `1234`: the commas of a digit run whose groups say thousands (one to three
    digits, then groups of three); a list keeps its commas (`1,2`, `2,3,5`, `1234,567`)."""
    return _COMMA_RUN_RE.sub(lambda m: m.group(0).replace(",", "")
                             if _COMMA_GROUPS_RE.fullmatch(m.group(0)) else m.group(0), text)


def _clean(candidate: str) -> str:
    c = _THOUSANDS_RE.sub("", _drop_thousands_commas(candidate[:_MAX_CANDIDATE_CHARS]))
    for _ in range(3):  # nested \text{\textbf{...}}
        c = _TEXT_CMD_RE.sub(r" \1 ", c)
    for old in _LATEX_DELIMITERS:  # `\\(\\frac{5}{6}\\)` reads as `$\\frac{5}{6}$`
        c = c.replace(old, " ")
    for old, new in (("\\$", ""), ("$", ""), ("\\%", "%"), ("{,}", ""), ("\\,", ""), ("\\!", ""),
                     ("\\;", " "), ("\\ ", " "), ("~", " "), ("\\left", ""), ("\\right", ""),
                     ("**", ""), ("\u2212", "-"), ("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"),
                     ("\\cdot", "*"), ("\\times", "*"), ("\\div", "/"), ("\u03c0", "\\pi ")):
        c = c.replace(old, new)
    c = _TIMES_RE.sub(" * ", _BRACED_EXPONENT_RE.sub(r"^\1", c))
    c = _SPACE_THOUSANDS_RE.sub(lambda m: m.group(0).replace(" ", ""), c)
    if "=" in c and _is_equation_lhs(c.split("=", 1)[0]):
        c = c.rsplit("=", 1)[1]
    return c.strip()


def _is_equation_lhs(lhs: str) -> bool:
    """True for the left side of an equation-like answer (`x`, `48 + 24`, `2x`), False when a
    number precedes a later clause (`17, where x`, `17 where x`)."""
    if re.search(r"[,;:]", lhs):
        return False
    return not re.search(r"\d", lhs) or _OPERATOR_RE.search(lhs) is not None


def _collapse_signed_parens(c: str) -> str:
    """`-(-18) km` -> `18 km`, `(-12)` -> `-12`: a leading number in parentheses, with its signs."""
    m = _PARENS_NUM_RE.match(c)
    if m is None or "(" not in m.group(1) or m.group(1).count("(") != m.group(3).count(")"):
        return c
    sign = "-" if m.group(1).count("-") % 2 else ""
    return f"{sign}{m.group(2)} {c[m.end():]}".strip()


def candidate_value(candidate: str, words: bool = True, latex: bool = False) -> str | None:
    """Return the value of one answer candidate: a plain number string, LaTeX for math-verify, or
    None; number words are read only when `words`; `latex` marks the content of a `\\boxed{}`.

    The candidate loses its LaTeX and Markdown dressing (`$`, `\\(..\\)`, `\\[..\\]`, `\\$`,
    `\\text{}`, `\\left`, `**`), thousands separators dropped (`,` where the digit groups say
    thousands: `1,234`, not the lists `1,2`, `2,3,5`, `{,}`, `\\,`, `\\ `, thin and no-break spaces between
    digit groups of three, and plain spaces when every group after the first has exactly three
    digits: `1 000`, `12 345 678`; the last-number fallback drops these too), the part after its
    last `=` kept when the part before the first `=` is equation-like (`x = 7`, `\\boxed{48 + 24 =
    72}`, `2x = 14`: no number, or an operator or coefficient, and no `,;:`; in `17, where x = 3`
    the 17 counts), a leading number in signed parentheses collapsed (`-(-18)` -> `18`, `(-12)` ->
    `-12`); then
      * a candidate that starts with number words, after at most some filler words (`therefore`,
        `thus`, `hence`, `so`, `then`, `just`, `exactly`, `simply`, `clearly`, `indeed`, `now`,
        `still`, `only`), is their value, whatever follows (`eighteen eggs`, `eighteen (6 x 3)` ->
        18); the words (any case; hyphens and spaces alike separate them) must form one number:
          - `zero` (alone) .. `nineteen`, the tens `twenty` .. `ninety`, a ten and a unit
            (`seventy-two`, `seventy two`);
          - hundreds: a number below 100 or `a` before `hundred`, with an optional `and` and a
            number below 100 after it (`a hundred`, `one hundred and five`, `one hundred five`,
            `twelve hundred` = 1200);
          - scales `thousand`, `million`, `billion`, `trillion`, each after a number as above (or
            `a`), in decreasing order, the groups optionally joined by `,` or `and` (`two thousand
            three hundred`, `two thousand and five`, `one thousand, two hundred and one`);
          - `dozen` after a number or `a`, as the last word (`a dozen` = 12, `two dozen` = 24);
          - a sign word first: `minus five`, `negative twelve`, or a leading `-` (`-five`) = -5;
          - fractions: a whole number (not zero) or `a` before `half`/`halves`, `third(s)`,
            `quarter(s)`, `fourth(s)` .. `tenth(s)` (`one half`, `a quarter`, `three quarters`), or
            a whole number, `and`, and such a fraction (`two and a half` = 2.5, `one and three
            quarters`); the value is its exact decimal, or `p/q` for math-verify (`one third` ->
            `1/3`, `two and two thirds` -> `8/3`);
          - decimals: a whole number, `point`, and digit words (`two point five`, `zero point seven
            five`).
        Number words are not read in `####` lines, corrections or the last-number fallback. A
        following number word that does not continue the number makes it no value (`nineteen
        eighty-four`); `eighteenth`, `hundreds`, `half` alone or `a` alone are no number (`a total
        of 18` is 18 by the last rule), and `one` is a number (`one of them` -> 1);
      * digits before a scale word are their value (`1.5 million` -> 1500000);
      * a candidate that starts with `\\frac` / `\\sqrt`, or a number whose LaTeX form goes on
        (a mixed fraction `3\\frac{1}{2}`, a radical `2\\sqrt{3}`, a multiple of pi `3\\pi` or
        `3π`, a list `18, 20`, and a factorial `5!` inside `\\boxed{}` or `$...$`: `15!` in
        prose is an exclamation), is handed to math-verify: a boxed candidate whole, otherwise
        the form's own text;
      * numbers joined by operators (`144/2`, `144 \\div 2`, `48 + 24`, `5 x 3`, `5 × 3`, `2^{10}`)
        go to math-verify (only the arithmetic prefix: `$10/hour` is the number 10, not a
        division), except the scientific forms `a \\times 10^{n}` / `10^{n}` (braces optional),
        which are their exact decimal (`3.5 \\times 10^{2}` -> 350, `10^{3}` -> 1000; |n| <= 100);
      * otherwise its first number (sign kept; `18.00` stays `18.00`).
    """
    c = _collapse_signed_parens(_clean(candidate))
    value = number_words_value(c) if words else None
    if value is not None:
        return value
    if _LATEX_EXPRESSION_RE.match(c):  # starts with a fraction or a root
        return c.rstrip(". ")
    m = _SCALE_RE.match(c)  # `1.5 million`
    if m:
        return _decimal_string(Decimal(m.group(1).replace(" ", "")).scaleb(
            _SCALES[m.group(2).lower()]))
    factorial = latex or re.search(r"\d\s*!\s*(?:\$|\\\))", candidate)  # `$5!$`; `15!` is not
    for form in (_LATEX_FORM_RE, _LIST_RE) + ((_FACTORIAL_RE,) if factorial else ()):
        m = form.match(c)
        if m:  # math-verify reads the whole form (boxed), or the form's own text
            return c.rstrip(". ") if latex else m.group(0).strip()
    m = _ARITHMETIC_RE.match(c)  # numbers joined by operators: `144/2`, `10^8`; not `10/hour`
    if m:
        sci = _SCI_RE.fullmatch(m.group(0).strip())
        exponent = int(sci.group(2) or sci.group(3)) if sci else None
        if sci and abs(exponent) <= 100:  # `3.5 * 10^2`, `10^3`: the exact decimal
            mantissa = (sci.group(1) or "1").replace(" ", "")
            return _decimal_string(Decimal(mantissa).scaleb(exponent))
        return m.group(0).strip()
    m = _NUM_RE.search(c)
    if m is None:
        return None
    return m.group(0).replace(",", "").lstrip("+")


def _decimal_string(value: Decimal) -> str:
    """`value` in plain notation without trailing zeros (`3.5E+2` -> `350`)."""
    return format(value.normalize(), "f") if value else "0"


def _has_content(candidate: str) -> bool:
    """False for an empty candidate (`\\boxed{}`, `The answer is $$`): it is no candidate at all."""
    return re.search(r"[0-9A-Za-z]", _clean(candidate)) is not None


def _extract(text: str) -> tuple[str | None, bool]:
    """(The answer of `text`, whether it holds a marked answer or a negated marker at all)."""
    candidates = sorted([(pos, "boxed", c) for pos, c in _boxed_candidates(text)] +
                        [(pos, "marked", c) for pos, c in _phrase_candidates(text) +
                         _correction_candidates(text)] +
                        [(m.start(), "hash", m.group(1)) for m in _HASH_RE.finditer(text)] +
                        [(pos, "negated", after) for pos, after in _negated_candidates(text)])
    marked_without_value = False
    for _, kind, candidate in reversed(candidates):
        if kind == "negated":  # a rejection: earlier text is out; only numbers after it count
            if marked_without_value:
                return None, True
            return _last_number(text[candidate:]), True
        if not _has_content(candidate):
            continue
        value = candidate_value(candidate, words=kind != "hash", latex=kind == "boxed")
        if value is not None:
            return value, True
        if kind != "hash":  # `#### Step two` is a Markdown heading, no answer
            marked_without_value = True  # an answer in words that are no number
    if marked_without_value:
        return None, True
    return _last_number(text), False


def _last_number(text: str) -> str | None:
    """The last number of `text` (thousands separators dropped); a fraction `a/b` is its exact
    decimal (`1/2` -> `0.5`), or `a/b` for math-verify when it has none (`1/3`)."""
    text = _THOUSANDS_RE.sub("", _drop_thousands_commas(
        text.replace("\\$", "").replace("$", "").replace("\u2212", "-")))
    text = _SPACE_THOUSANDS_RE.sub(lambda m: m.group(0).replace(" ", ""), text)
    last = None
    for last in _FALLBACK_RE.finditer(text):
        pass
    if last is None:
        return None
    if last.group(1) is None:
        return last.group(0).replace(",", "").lstrip("+")
    sign = "-" if last.group(0).startswith("-") else ""
    return ratio_string(sign, int(last.group(1)), int(last.group(2)))


def extract_answer(completion: str) -> str | None:
    """Return the final answer of a completion, or None if it has none.

    1. If the completion holds `</think>`, the text after the last one is searched first (a Thinking
       model's answer follows its reasoning); if nothing is found there (no value, no marked answer
       without a value and no negated marker: see 2), the whole text is.
    2. Candidates are the marked answers: every `\\boxed{...}` / `\\fbox{...}` (nested braces
       matched), every `#### ...` line (digits only: `#### Step two` / `#### Explanation` may be a
       Markdown heading, so such a line without a number is no candidate), every `answer is ...` /
       `Answer: ...` / `final answer = ...` phrase (the rest of its line, up to the end of the
       sentence; a marker that ends its line, as in `The answer is:` followed by a list, is no
       candidate, nor is one whose sentence ends in `:`, `The answer is as follows:`), and every
       correction `actually N` / `Actually, it's N` / `Correction: N` whose sentence is that bare
       number (digits) and at most one unit word (`actually, 48/2 = 24 ...` is reasoning and
       `actually, 13 is wrong` a statement: neither counts). A candidate with no letter or digit
       (`\\boxed{}`) is none. The candidates are read from the last (by position):
         * one that holds a value (`candidate_value`) is the answer, so a later answer or correction
           wins (`The answer is 12. Wait, actually 13.` -> 13) and text after the answer is ignored;
         * one whose words are no number (`\\boxed{none}`, `the answer is unknown`) is skipped: an
           earlier candidate with a value still counts (`\\boxed{72}. The answer is correct.` ->
           72), but no unmarked number does (step 3 is off): `3 eggs each, so the answer is unknown`
           has no answer;
         * a negated marker (`answer is not 20`, `answer isn't 20`, `Answer: not 20`) rejects what
           came before it: the answer is the last number (as in step 3) in the text after the first
           number of the negated sentence (after `not` when that sentence holds none), or none: `The
           answer is not 20; it is 30` -> 30, `the answer is not 20` -> no answer, `The answer is
           12. Wait, the answer is not 12.` -> no answer; when a later candidate without a value was
           skipped, the text after the negation does not count either.
    3. Without any candidate, the last number in the text counts (digits only: number words are not
       read there); a fraction `1/2` there is its exact decimal `0.5` (`1/3`, without one, goes to
       math-verify as is). A `-` is a minus sign only where no digit or letter precedes it (`-7`,
       `(-7`, `= -7`; the `1-7` of a range is 7).
    """
    if "</think>" in completion:
        after, marked = _extract(completion.rsplit("</think>", 1)[1])
        if after is not None or marked:
            return after
    return _extract(completion)[0]


def _math_verify_equal(gold: str, value: str) -> bool:
    from math_verify import parse, verify

    # math-verify's timeouts use SIGALRM, which only works in the main thread.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold_parsed = parse(f"${gold}$", parsing_timeout=timeout)
    value_parsed = parse(f"${value}$", parsing_timeout=timeout)
    if not gold_parsed or not value_parsed:
        return False
    return bool(verify(gold_parsed, value_parsed, timeout_seconds=timeout))


def grade_answer(completion: str, gold: str) -> float:
    """Return 1.0 if `completion`'s final answer equals `gold` (a number string), else 0.0.

    Raises:
      TaskError: `gold` is not a number (after dropping thousands separators; `1,2` is a list).
    """
    gold_value = _gold_decimal(gold)
    if gold_value is None:
        raise TaskError(f"gold answer is not a number: {gold!r}")
    value = extract_answer(completion)
    if value is None:
        return 0.0
    try:
        return 1.0 if Decimal(value) == gold_value else 0.0
    except InvalidOperation:
        return 1.0 if _math_verify_equal(gold.replace(",", ""), value) else 0.0


def _gold_decimal(gold: str) -> Decimal | None:
    """The value of a plain-number gold (`1,080` -> 1080), or None: a comma is a thousands
    separator only between groups of three digits (`1,2` and `2,3,5` are lists)."""
    if "," in gold and not _PLAIN_GOLD_RE.fullmatch(gold):
        return None
    try:
        return Decimal(gold.replace(",", ""))
    except InvalidOperation:
        return None


def is_plain_number(gold: str) -> bool:
    """True for a gold answer `grade_answer` takes: a number once thousands separators go
    (`1,080`; not the lists `1,2`, `2,3,5`, `1, 2`)."""
    value = _gold_decimal(gold)
    return value is not None and value.is_finite()


def _unwrap_text(s: str) -> str:
    return re.sub(r"\s+", "", _TEXT_CMD_RE.sub(r"\1", s)).strip("$.")


def grade_symbolic(completion: str, gold: str) -> float:
    """Return 1.0 if `completion`'s final answer equals `gold`, any answer math-verify reads
    (`\\frac{1}{2}`, `2\\sqrt{3}`, `(-\\infty, 3]`, `x^2 + 1`, `3\\pi`), else 0.0.

    A plain-number gold is `grade_answer`'s. Otherwise the text after the last `</think>` (the
    whole completion without one) is parsed by math-verify (its last `\\boxed{}` first, else its
    last LaTeX or plain expression) and verified against the gold; failing that, the answer
    `extract_answer` finds is. A gold math-verify cannot read (`\\text{Monday}`) is compared as
    text with the last `\\boxed{}` content (`\\text{}`, spaces, `$` and a final `.` dropped).
    """
    if is_plain_number(gold):
        return grade_answer(completion, gold)
    from math_verify import parse, verify

    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    text = completion.rsplit("</think>", 1)[1] if "</think>" in completion else completion
    gold_parsed = parse(f"${gold}$", parsing_timeout=timeout)
    if not gold_parsed:
        boxed = _boxed_candidates(text) or _boxed_candidates(completion)
        return float(bool(boxed) and _unwrap_text(boxed[-1][1]) == _unwrap_text(gold))
    answer = parse(text, parsing_timeout=timeout)
    if answer and verify(gold_parsed, answer, timeout_seconds=timeout):
        return 1.0
    value = extract_answer(completion)
    return float(value is not None and _math_verify_equal(gold, value))
