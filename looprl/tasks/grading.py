"""Final-answer extraction and grading for math word problems (GSM8K), with `math-verify`.

How an answer is found in a completion (`extract_answer`):
  1. If the completion holds `</think>`, the text after the last one is searched first (a Thinking
     model's answer follows its reasoning); if nothing is found there, the whole text is.
  2. Candidates are the marked answers: every `\\boxed{...}` / `\\fbox{...}` (nested braces
     matched), every `#### ...` line, every `answer is ...` / `Answer: ...` / `final answer = ...`
     phrase (the rest of its line, up to the end of the sentence; a marker that ends its line, as in
     `The answer is:` followed by a list, is no candidate; a negated one, `answer is not 20` /
     `answer isn't 20`, is none either), and every correction `actually N` / `Actually, it's N` /
     `Correction: N` whose sentence is that bare number and at most one unit word
     (`actually, 48/2 = 24 ...` is reasoning and `actually, 13 is wrong` a statement: neither
     counts). The **last** candidate (by position) that holds a value counts, so a
     later answer or correction wins (`The answer is 12. Wait, actually 13.` -> 13) and text after
     the answer is ignored.
  3. Without a marked candidate that holds a value, the last number in the text counts; a fraction
     `1/2` there is its exact decimal `0.5` (`1/3`, without one, goes to math-verify as is). A `-`
     is a minus sign only where no digit or letter precedes it (`-7`, `(-7`, `= -7`; the `1-7` of
     a range is 7).
A candidate's value: LaTeX and Markdown dressing removed (`$`, `\\$`, `\\text{}`, `\\left`, `**`),
thousands separators dropped (`,`, `{,}`, `\\,`, `\\ `, thin and no-break spaces between digit
groups of three, and plain spaces when every group after the first has exactly three digits:
`1 000`, `12 345 678`; the last-number fallback drops these too), the part after its last `=` kept
when the part before the first `=` is equation-like (`x = 7`, `\\boxed{48 + 24 = 72}`, `2x = 14`:
no number, or an operator or coefficient, and no `,;:`; in `17, where x = 3` the 17 counts), a
leading number in signed parentheses collapsed (`-(-18)` -> `18`, `(-12)` -> `-12`); then
  * a candidate that starts with `\\frac` / `\\sqrt`, or with numbers joined by operators
    (`144/2`, `144 \\div 2`, `48 + 24`, `1.92 \\times 10^8`), is handed to math-verify (only the
    arithmetic prefix: `$10/hour` is the number 10, not a division);
  * otherwise its first number (sign kept; `18.00` stays `18.00`).

Grading (`grade_answer`): a plain number equals the gold when their `Decimal` values are equal
(`18.00` == `18`, `1,080` == `1080`); anything else is compared with `math_verify.verify`.
"""
from __future__ import annotations

import re
import threading
from decimal import Decimal, InvalidOperation, localcontext
from fractions import Fraction

from looprl.errors import TaskError

_BOX_RE = re.compile(r"\\(?:boxed|fbox)\s*(\{)?")
_HASH_RE = re.compile(r"####\s*([^\n]*)")
_PHRASE_RE = re.compile(  # `answer is`, not `answer is not` / `answer isn't`
    r"(?i)\banswer\b[ \t]*(?:\*\*)?[ \t]*(?:(?:is|was)\b|=|:)"
    r"(?![ \t]*(?:\*\*)?[ \t]*:?[ \t]*(?:\*\*)?not\b)[ \t]*(?:\*\*)?[ \t]*:?[ \t]*")
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
_THOUSANDS_RE = re.compile(r"(?<=\d)(?:,|\{,\}|\\,|\\ |\\!|\u2009|\u202f|\u00a0)(?=\d{3}(?!\d))")
_SENTENCE_END_RE = re.compile(r"\.(?:\s|$)(?!\d)")
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
        found.append((m.start(), tail[:end.start()] if end else tail))
    return found


def _correction_candidates(text: str) -> list[tuple[int, str]]:
    """`actually 13`, `Correction: $13 apples`: the sentence after the marker is a bare number and
    at most one word (a unit), so reasoning such as `actually, 48/2 = 24 ...` or a statement such
    as `actually, 13 is wrong` is no candidate."""
    return [(pos, tail) for pos, tail in _phrase_candidates(text, _CORRECTION_RE)
            if _BARE_ANSWER_RE.fullmatch(_clean(tail))]


def _clean(candidate: str) -> str:
    c = _THOUSANDS_RE.sub("", candidate[:_MAX_CANDIDATE_CHARS])
    for _ in range(3):  # nested \text{\textbf{...}}
        c = _TEXT_CMD_RE.sub(r" \1 ", c)
    for old, new in (("\\$", ""), ("$", ""), ("\\%", "%"), ("{,}", ""), ("\\,", ""), ("\\!", ""),
                     ("\\;", " "), ("\\ ", " "), ("~", " "), ("\\left", ""), ("\\right", ""),
                     ("**", ""), ("\u2212", "-"), ("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"),
                     ("\\cdot", "*"), ("\\times", "*"), ("\\div", "/")):
        c = c.replace(old, new)
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


def candidate_value(candidate: str) -> str | None:
    """Return the value of one answer candidate: a plain number string, LaTeX for math-verify, or None."""
    c = _collapse_signed_parens(_clean(candidate))
    if _LATEX_EXPRESSION_RE.match(c):  # starts with a fraction or a root
        return c.rstrip(". ")
    m = _ARITHMETIC_RE.match(c)  # numbers joined by operators: `144/2`, `10^8`; not `10/hour`
    if m:
        return m.group(0).strip()
    m = _NUM_RE.search(c)
    if m is None:
        return None
    return m.group(0).replace(",", "").lstrip("+")


def _extract(text: str) -> str | None:
    candidates = sorted(_boxed_candidates(text) + _phrase_candidates(text) +
                        _correction_candidates(text) +
                        [(m.start(), m.group(1)) for m in _HASH_RE.finditer(text)])
    for _, candidate in reversed(candidates):
        value = candidate_value(candidate)
        if value is not None:
            return value
    return _last_number(text)


def _last_number(text: str) -> str | None:
    """The last number of `text` (thousands separators dropped); a fraction `a/b` is its exact
    decimal (`1/2` -> `0.5`), or `a/b` for math-verify when it has none (`1/3`)."""
    text = _THOUSANDS_RE.sub("", text.replace("\\$", "").replace("$", "").replace("\u2212", "-"))
    text = _SPACE_THOUSANDS_RE.sub(lambda m: m.group(0).replace(" ", ""), text)
    last = None
    for last in _FALLBACK_RE.finditer(text):
        pass
    if last is None:
        return None
    if last.group(1) is None:
        return last.group(0).replace(",", "").lstrip("+")
    sign = "-" if last.group(0).startswith("-") else ""
    num, den = int(last.group(1)), int(last.group(2))
    if den == 0:
        return f"{sign}{num}/{den}"
    frac = Fraction(num, den)
    d = frac.denominator
    while d % 2 == 0:
        d //= 2
    while d % 5 == 0:
        d //= 5
    if d != 1:  # no terminating decimal
        return f"{sign}{num}/{den}"
    with localcontext() as ctx:
        ctx.prec = 2 * len(str(frac.denominator)) + len(str(frac.numerator)) + 2  # exact
        value = Decimal(frac.numerator) / Decimal(frac.denominator)
    return sign + format(value.normalize(), "f") if value else "0"


def extract_answer(completion: str) -> str | None:
    """Return the final answer of a completion (see the module docstring), or None if it has none."""
    if "</think>" in completion:
        after = _extract(completion.rsplit("</think>", 1)[1])
        if after is not None:
            return after
    return _extract(completion)


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
      TaskError: `gold` is not a number (after dropping thousands separators).
    """
    try:
        gold_value = Decimal(gold.replace(",", ""))
    except InvalidOperation:
        raise TaskError(f"gold answer is not a number: {gold!r}") from None
    value = extract_answer(completion)
    if value is None:
        return 0.0
    try:
        return 1.0 if Decimal(value) == gold_value else 0.0
    except InvalidOperation:
        return 1.0 if _math_verify_equal(gold.replace(",", ""), value) else 0.0
