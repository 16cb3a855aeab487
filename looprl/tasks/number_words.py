"""Number words and exact ratios for the math grader (`looprl.tasks.grading`).

`number_words_value` reads a candidate that starts with English number words (`seventy-two`,
`two and a half`, `minus five`) as its value; `ratio_string` writes a ratio as its exact decimal,
or as `p/q` for math-verify when it has none. The grammar is documented in
`looprl.tasks.grading.candidate_value`.
"""
from __future__ import annotations

import re
from decimal import Decimal, localcontext
from fractions import Fraction

# Number words (the grammar: `looprl.tasks.grading.candidate_value`).
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
    return ratio_string(sign, abs(frac.numerator), frac.denominator)


def number_words_value(c: str) -> str | None:
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


def ratio_string(sign: str, num: int, den: int) -> str:
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
