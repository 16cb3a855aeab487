"""Final-answer extraction and grading for math word problems (GSM8K), with `math-verify`.

`extract_answer` finds a completion's final answer: the last marked answer that holds a value
(`\\boxed{...}`, a `#### N` line, `The answer is ...`, a correction `actually N`), else the last
number; after `</think>` first. `candidate_value` reads one candidate (numbers, number words,
LaTeX). `grade_answer` compares the value with the gold: a plain number by its `Decimal` value
(`18.00` == `18`, `1,080` == `1080`), anything else with `math_verify.verify`.
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
_THOUSANDS_RE = re.compile(r"(?<=\d)(?:,|\{,\}|\\,|\\ |\\!|\u2009|\u202f|\u00a0)(?=\d{3}(?!\d))")
_SENTENCE_END_RE = re.compile(r"\.(?:\s|$)(?!\d)")
_MAX_CANDIDATE_CHARS = 200

# Number words (see the module docstring for the grammar).
_UNITS = {w: i for i, w in enumerate((
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
    "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen",
    "nineteen"))}
_TENS = {w: 10 * i for i, w in enumerate(
    ("twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"), start=2)}
_SCALES = {"thousand": 10**3, "million": 10**6, "billion": 10**9, "trillion": 10**12}
_DENOMINATORS = {"half": 2, "halves": 2, "third": 3, "thirds": 3, "quarter": 4, "quarters": 4,
                 "fourth": 4, "fourths": 4, "fifth": 5, "fifths": 5, "sixth": 6, "sixths": 6,
                 "seventh": 7, "sevenths": 7, "eighth": 8, "eighths": 8, "ninth": 9, "ninths": 9,
                 "tenth": 10, "tenths": 10}
_NUMBER_WORDS = {*_UNITS, *_TENS, *_SCALES, *_DENOMINATORS, "hundred", "dozen", "point"}
_FILLERS = {"therefore", "thus", "hence", "so", "then", "just", "exactly", "simply", "clearly",
            "indeed", "now", "still", "only"}
_WORD_TOKEN_RE = re.compile(r"[a-z]+|[^\sa-z-]")  # hyphens separate words: `seventy-two`


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


def candidate_value(candidate: str, words: bool = True) -> str | None:
    """Return the value of one answer candidate: a plain number string, LaTeX for math-verify, or
    None; number words are read only when `words`.

    The candidate loses its LaTeX and Markdown dressing (`$`, `\\$`, `\\text{}`, `\\left`,
    `**`), thousands separators dropped (`,`, `{,}`, `\\,`, `\\ `, thin and no-break spaces between
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
        of 18` is 18 by the last rule), and `one` is a number (`one of them` -> 1). Digits before a
        scale word are the digits alone (`192 million` -> 192);
      * a candidate that starts with `\\frac` / `\\sqrt`, or with numbers joined by operators
        (`144/2`, `144 \\div 2`, `48 + 24`, `1.92 \\times 10^8`), is handed to math-verify (only the
        arithmetic prefix: `$10/hour` is the number 10, not a division);
      * otherwise its first number (sign kept; `18.00` stays `18.00`).
    """
    c = _collapse_signed_parens(_clean(candidate))
    value = _number_words_value(c) if words else None
    if value is not None:
        return value
    if _LATEX_EXPRESSION_RE.match(c):  # starts with a fraction or a root
        return c.rstrip(". ")
    m = _ARITHMETIC_RE.match(c)  # numbers joined by operators: `144/2`, `10^8`; not `10/hour`
    if m:
        return m.group(0).strip()
    m = _NUM_RE.search(c)
    if m is None:
        return None
    return m.group(0).replace(",", "").lstrip("+")


def _words_integer(tokens: list[str], i: int) -> tuple[int, int] | None:
    """A whole number in words from `tokens[i]`: (its value, the index after it), or None."""
    def tok(k):
        return tokens[k] if k < len(tokens) else None

    def below_hundred(k):  # `seventy two`, `nineteen`, `five` (not zero)
        if tok(k) in _TENS:
            if tok(k + 1) in _UNITS and 0 < _UNITS[tok(k + 1)] < 10:
                return _TENS[tok(k)] + _UNITS[tok(k + 1)], k + 2
            return _TENS[tok(k)], k + 1
        if tok(k) in _UNITS and _UNITS[tok(k)] > 0:
            return _UNITS[tok(k)], k + 1
        return None

    def group(k):  # below a thousand, or `twelve hundred`: `a hundred`, `three hundred and five`
        if tok(k) == "a" and tok(k + 1) == "hundred":
            part = (1, k + 1)
        else:
            part = below_hundred(k)
        if part is None or tok(part[1]) != "hundred":
            return part
        value, k = part[0] * 100, part[1] + 1
        rest = below_hundred(k + 1) if tok(k) == "and" else below_hundred(k)
        return (value + rest[0], rest[1]) if rest else (value, k)

    if tok(i) == "zero":
        return 0, i + 1
    total, last_scale, found = 0, None, False
    while True:
        k = i
        if found and tok(k) == ",":  # `one thousand, two hundred`
            k += 1
        if found and tok(k) == "and":  # `two thousand and five`
            k += 1
        if tok(k) == "a" and (tok(k + 1) in _SCALES or tok(k + 1) == "dozen"):
            part = (1, k + 1)
        else:
            part = group(k)
        if part is None:
            break
        value, k = part
        if tok(k) == "dozen":  # `a dozen`, `two dozen`: nothing follows
            return (total + 12 * value, k + 1) if not found else (total, i)
        scale = _SCALES.get(tok(k))
        if scale is not None and (last_scale is None or scale < last_scale):
            total, last_scale, found, i = total + value * scale, scale, True, k + 1
            continue
        if last_scale is not None and value >= last_scale:  # `one thousand twelve hundred`
            break
        total, found, i = total + value, True, k
        break
    return (total, i) if found else None


def _fraction_string(frac: Fraction) -> str:
    """`frac` as its exact decimal (`3/4` -> `0.75`), or `p/q` for math-verify when it has none."""
    sign = "-" if frac < 0 else ""
    return _ratio_string(sign, abs(frac.numerator), frac.denominator)


def _number_words_value(c: str) -> str | None:
    """The value of a candidate that starts with number words (`eighteen eggs`, `therefore
    seventy-two`, `minus five`, `two and a half`), or None; see the module docstring."""
    sign = re.match(r"\s*-\s*(?=[A-Za-z])", c)  # `-five`: the hyphen is a minus sign here
    tokens = _WORD_TOKEN_RE.findall(c[sign.end():].lower() if sign else c.lower())
    i = 0
    while not sign and i < len(tokens) and tokens[i] in _FILLERS:
        i += 1
    negative = bool(sign) or (i < len(tokens) and tokens[i] in ("minus", "negative"))
    i += negative and not sign

    def tok(k):
        return tokens[k] if k < len(tokens) else None

    whole = _words_integer(tokens, i)
    value = None
    if whole is None:
        if tok(i) == "a" and tok(i + 1) in _DENOMINATORS:  # `a half`, `a quarter`
            value, i = Fraction(1, _DENOMINATORS[tok(i + 1)]), i + 2
    else:
        n, i = whole
        value = Fraction(n)
        if tok(i) in _DENOMINATORS and n > 0:  # `three quarters`, `one half`
            value, i = Fraction(n, _DENOMINATORS[tok(i)]), i + 1
        elif tok(i) == "and":  # `two and a half`, `one and three quarters`
            numerator = (1, i + 2) if tok(i + 1) == "a" else _words_integer(tokens, i + 1)
            if numerator and numerator[0] > 0 and tok(numerator[1]) in _DENOMINATORS:
                value += Fraction(numerator[0], _DENOMINATORS[tok(numerator[1])])
                i = numerator[1] + 1
        elif tok(i) == "point" and tok(i + 1) in _UNITS and _UNITS[tok(i + 1)] < 10:
            digits = ""
            i += 1
            while tok(i) in _UNITS and _UNITS[tok(i)] < 10:  # `two point five`
                digits += str(_UNITS[tok(i)])
                i += 1
            value += Fraction(int(digits), 10 ** len(digits))
    if value is None or tok(i) in _NUMBER_WORDS:  # `nineteen eighty-four` is no one number
        return None
    return _fraction_string(-value if negative else value)


def _has_content(candidate: str) -> bool:
    """False for an empty candidate (`\\boxed{}`, `The answer is $$`): it is no candidate at all."""
    return re.search(r"[0-9A-Za-z]", _clean(candidate)) is not None


def _extract(text: str) -> tuple[str | None, bool]:
    """(The answer of `text`, whether it holds a marked answer or a negated marker at all)."""
    candidates = sorted([(pos, "marked", c) for pos, c in _boxed_candidates(text) +
                         _phrase_candidates(text) + _correction_candidates(text)] +
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
        value = candidate_value(candidate, words=kind != "hash")
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
    return _ratio_string(sign, int(last.group(1)), int(last.group(2)))


def _ratio_string(sign: str, num: int, den: int) -> str:
    """`sign num/den` as its exact decimal, or as `num/den` (unreduced) when it has none."""
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
