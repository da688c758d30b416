"""Answer extraction for step-by-step math outputs, shared by the frontend programs
(examples/) and the accuracy harness (benchmarks/accuracy.py).

Small instruct models are asked to end with "Final answer: N" but often write ``\\boxed{...}``
instead, sometimes with ``\\frac{a}{b}``, thousands separators, ``$`` or units. Scoring them with
a naive "first number" regex counts wrong answers as right (the 48 of "48 + 24 = 72") and right
ones as wrong ("1,000"). Rules, in order:

1. The last explicit answer wins: "Final answer: ..." / "The final answer is ..." or
   ``\\boxed{...}`` (``\\fbox``), whichever comes last in the text; a marker with no number after
   it (the model echoing "Final answer: <number>") is skipped.
2. Else the last "the answer is ...".
3. Else (``fallback_last_number=True``) the last number in the text.

Inside the chosen fragment: LaTeX wrappers (``$``, ``\\text{}``, ``\\left``, spacing) are dropped,
the right-hand side of the last ``=`` is taken, ``\\frac{a}{b}`` / ``\\dfrac`` / ``a/b`` and mixed
numbers ``3\\frac{1}{2}`` are evaluated exactly, commas between digit groups are removed.
The result is normalised: ``"72"``, ``"-4"``, ``"2.5"``, or ``"1/3"`` for a non-terminating
fraction; ``None`` if nothing numeric is found.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any, NamedTuple, Optional

# What the harness and the examples append to a question.
ANSWER_INSTRUCTION = ("Solve the problem step by step. At the end, write the result on its own "
                      "line as 'Final answer: ' followed by the number only.")


class Extraction(NamedTuple):
    answer: Optional[str]  # normalised number, None if none found
    source: Optional[str]  # "final", "boxed", "answer-is", "last-number" or None
    raw: Optional[str]  # the text fragment the number was read from


_FINAL = re.compile(r"final\s+answer\s*(?:is|:|：|=)?\s*[:：]?", re.IGNORECASE)
_ANSWER_IS = re.compile(r"\bthe\s+answer\s+is\s*[:：]?", re.IGNORECASE)
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
# One number token: 1,234,567.5 | 12.5 | .5 | 12 ; optionally "a/b" right after (plain fraction).
_NUM = r"(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)"
_NUMBER = re.compile(rf"(?<![\w.])(-?)\s*({_NUM})(?:\s*/\s*({_NUM}))?")
_FRAC = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}|\\[dt]?frac\s*(\d)\s*(\d)")


def _balanced(text: str, start: int) -> tuple[str, int]:
    """Contents of the brace group whose "{" is at text[start - 1]; returns (contents, end)."""
    depth, i = 1, start
    while i < len(text) and depth:
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        i += 1
    return text[start:i - 1] if depth == 0 else text[start:], i


def _clean(fragment: str) -> str:
    s = fragment.replace("\u2212", "-").replace("\u2013", "-")  # unicode minus / en dash
    # \text{ dollars}, \mathrm{cm}: keep the words, they carry no digits that matter here
    s = re.sub(r"\\(?:text|textbf|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}", r" \1 ", s)
    s = re.sub(r"\\(?:left|right|displaystyle|!|,|;|:|quad|qquad)|\\ ", " ", s)
    s = s.replace("\\$", " ").replace("$", " ").replace("\\%", " ").replace("%", " ")
    s = s.replace("**", " ").replace("\\cdot", "*").replace("\\times", "*")
    s = re.sub(r"^\s*\\\(|\\\)\s*$|\\\[|\\\]", " ", s)
    return s


def _frac_value(m: re.Match) -> Optional[Fraction]:
    num, den = (m.group(1), m.group(2)) if m.group(1) is not None else (m.group(3), m.group(4))
    a, b = _number_value(num), _number_value(den)
    if a is None or b is None or b == 0:
        return None
    return a / b


def _number_value(fragment: str) -> Optional[Fraction]:
    """Value of the first number in a cleaned fragment (no LaTeX fractions)."""
    m = _NUMBER.search(fragment)
    if not m:
        return None
    value = Fraction(m.group(2).replace(",", ""))
    if m.group(3) is not None:
        den = Fraction(m.group(3).replace(",", ""))
        if den == 0:
            return None
        value /= den
    return -value if m.group(1) else value


def parse_number(fragment: str) -> Optional[Fraction]:
    """Exact value of the answer written in `fragment` (LaTeX allowed), None if none."""
    s = _clean(fragment)
    if "\\boxed" in s or "\\fbox" in s:  # "Final answer: \boxed{72}"
        m = _BOXED.search(s)
        s = _clean(_balanced(s, m.end())[0])
    if "=" in s:  # "48 + 24 = 72", "x = 5": the result is on the right
        s = s.rsplit("=", 1)[1]
    m = _FRAC.search(s)
    if m:
        frac = _frac_value(m)
        if frac is None:
            return None
        head = s[:m.start()].strip()
        whole = re.fullmatch(r"(-?)\s*(\d+)", head)
        if whole:  # mixed number 3\frac{1}{2}
            value = int(whole.group(2)) + frac
            return -value if whole.group(1) else value
        if head.endswith("-"):
            return -frac
        if not head or not _NUMBER.search(head):
            return frac
    return _number_value(s)


def format_number(value: Fraction) -> str:
    """72 -> "72", 5/2 -> "2.5", 1/3 -> "1/3"."""
    if value.denominator == 1:
        return str(value.numerator)
    d = value.denominator
    for p in (2, 5):
        while d % p == 0:
            d //= p
    if d != 1:
        return f"{value.numerator}/{value.denominator}"
    digits = 0
    while (value * 10**digits).denominator != 1:
        digits += 1
    return f"{float(value):.{digits}f}" if digits <= 15 else str(float(value))


def normalize_number(fragment: str) -> Optional[str]:
    value = parse_number(fragment)
    return None if value is None else format_number(value)


def _final_fragment(text: str, end: int) -> str:
    rest = text[end:end + 300]
    lines = rest.split("\n")
    # "Final answer:\n\n72" puts the number on the next non-empty line
    first = lines[0] if lines[0].strip() else next((ln for ln in lines[1:] if ln.strip()), "")
    # the answer sentence ends at ". " (not the point of 2.5): "72. Check: 3 + 4 = 7" -> "72"
    first = re.split(r"(?<=\S)\.(?:\s|$)", first, maxsplit=1)[0]
    if "\\boxed" in first or "\\fbox" in first:
        m = _BOXED.search(first)
        inner, _ = _balanced(rest, rest.index(first) + m.end())
        return first[:m.start()] + "\\boxed{" + inner + "}"
    return first


def extract(text: str, *, fallback_last_number: bool = True) -> Extraction:
    """The answer of a model output, with where it was found."""
    if not text:
        return Extraction(None, None, None)
    candidates = []  # (position, source, fragment)
    for m in _FINAL.finditer(text):
        candidates.append((m.start(), "final", _final_fragment(text, m.end())))
    for m in _BOXED.finditer(text):
        inner, _ = _balanced(text, m.end())
        candidates.append((m.start(), "boxed", inner))
    # The last explicit answer wins; one without a number (an echoed template) is skipped.
    for _, source, fragment in sorted(candidates, key=lambda c: c[0], reverse=True):
        value = parse_number(fragment)
        if value is not None:
            return Extraction(format_number(value), source, fragment.strip())
    for m in reversed(list(_ANSWER_IS.finditer(text))):
        fragment = _final_fragment(text, m.end())
        value = parse_number(fragment)
        if value is not None:
            return Extraction(format_number(value), "answer-is", fragment.strip())
    if fallback_last_number:
        cleaned = _clean(text)
        numbers = list(_NUMBER.finditer(cleaned))
        if numbers:
            value = _number_value(numbers[-1].group(0))
            if value is not None:
                return Extraction(format_number(value), "last-number", numbers[-1].group(0).strip())
    return Extraction(None, None, None)


def extract_answer(text: str, *, fallback_last_number: bool = True) -> Optional[str]:
    """Normalised answer of a model output ("72", "2.5", "1/3"), None if none is found."""
    return extract(text, fallback_last_number=fallback_last_number).answer


def answers_equal(pred: Optional[str], gold: Any) -> bool:
    """Numeric equality of a normalised prediction and a gold answer (int, float or string)."""
    if pred is None or gold is None:
        return False
    a = parse_number(str(pred))
    b = parse_number(str(gold)) if not isinstance(gold, (int, float)) else Fraction(gold)
    if a is None or b is None:
        return str(pred).strip() == str(gold).strip()
    return a == b or abs(float(a) - float(b)) <= 1e-6 * max(1.0, abs(float(b)))


def is_correct(text: str, entry: dict, dataset=None) -> bool:
    """Score one output against a reasoning-gym entry. With the dataset, its own scorer judges
    the extracted (normalised) answer; reasoning-gym gives partial credit for a wrong answer in
    the right format (0.01 on gsm_symbolic), so only a full 1.0 counts as correct."""
    pred = extract_answer(text)
    if dataset is not None:
        return pred is not None and dataset.score_answer(pred, entry) >= 1.0
    return answers_equal(pred, entry["answer"])
