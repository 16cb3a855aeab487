"""Final-answer extraction and grading for math word problems (GSM8K), with `math-verify`.

How an answer is found in a completion (`extract_answer`):
  1. If the completion holds `</think>`, the text after the last one is searched first (a Thinking
     model's answer follows its reasoning); if nothing is found there, the whole text is.
  2. Candidates are the marked answers: every `\\boxed{...}` / `\\fbox{...}` (nested braces
     matched), every `#### ...` line, and every `answer is ...` / `Answer: ...` / `final answer = ...`
     phrase (the rest of its line, up to the end of the sentence; a marker that ends its line, as in
     `The answer is:` followed by a list, is no candidate). The **last** candidate (by position)
     that holds a value counts, so a corrected answer wins and text after the answer is ignored.
  3. Without a marked candidate that holds a value, the last number in the text counts.
A candidate's value: LaTeX and Markdown dressing removed (`$`, `\\$`, `\\text{}`, `\\left`, `**`),
thousands separators dropped (`,`, `{,}`, `\\,`, `\\ `, thin and no-break spaces between digit
groups of three), the part after its last `=` kept (`\\boxed{48 + 24 = 72}`); then
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
from decimal import Decimal, InvalidOperation

from looprl.errors import TaskError

_BOX_RE = re.compile(r"\\(?:boxed|fbox)\s*(\{)?")
_HASH_RE = re.compile(r"####\s*([^\n]*)")
_PHRASE_RE = re.compile(
    r"(?i)\banswer\b[ \t]*(?:\*\*)?[ \t]*(?:is|was|=|:)[ \t]*(?:\*\*)?[ \t]*:?[ \t]*")
_NUM_RE = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[-+]?\.\d+")
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


def _phrase_candidates(text: str) -> list[tuple[int, str]]:
    found = []
    for m in _PHRASE_RE.finditer(text):  # the marker only, so a later phrase on the line is found
        line_end = text.find("\n", m.end())
        tail = text[m.end():line_end if line_end >= 0 else len(text)]
        end = _SENTENCE_END_RE.search(tail)
        found.append((m.start(), tail[:end.start()] if end else tail))
    return found


def _clean(candidate: str) -> str:
    c = _THOUSANDS_RE.sub("", candidate[:_MAX_CANDIDATE_CHARS])
    for _ in range(3):  # nested \text{\textbf{...}}
        c = _TEXT_CMD_RE.sub(r" \1 ", c)
    for old, new in (("\\$", ""), ("$", ""), ("\\%", "%"), ("{,}", ""), ("\\,", ""), ("\\!", ""),
                     ("\\;", " "), ("\\ ", " "), ("~", " "), ("\\left", ""), ("\\right", ""),
                     ("**", ""), ("\u2212", "-"), ("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"),
                     ("\\cdot", "*"), ("\\times", "*"), ("\\div", "/")):
        c = c.replace(old, new)
    if "=" in c:
        c = c.rsplit("=", 1)[1]
    return c.strip()


def candidate_value(candidate: str) -> str | None:
    """Return the value of one answer candidate: a plain number string, LaTeX for math-verify, or None."""
    c = _clean(candidate)
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
                        [(m.start(), m.group(1)) for m in _HASH_RE.finditer(text)])
    for _, candidate in reversed(candidates):
        value = candidate_value(candidate)
        if value is not None:
            return value
    numbers = _NUM_RE.findall(_THOUSANDS_RE.sub("", text.replace("\\$", "").replace("$", "")))
    return numbers[-1].replace(",", "").lstrip("+") if numbers else None


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
