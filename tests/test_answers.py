"""Answer extraction on the shapes small models really write (vase_sglang/serving/answers.py)."""

from __future__ import annotations

from fractions import Fraction

import pytest

from vase_sglang.serving.answers import answers_equal, extract, extract_answer, format_number, is_correct

CASES = [
    # plain instructed format
    ("So she sold 72 clips.\nFinal answer: 72", "72"),
    ("Final answer: 72.", "72"),
    ("**Final answer:** 1,234", "1234"),
    ("Final Answer: $1,234.50", "1234.5"),
    ("final answer is 18 dollars", "18"),
    ("Final answer:\n\n42\n", "42"),
    ("Final answer: -7", "-7"),
    ("Final answer: \u22127", "-7"),  # unicode minus
    # the result of an equation, not its first operand (a naive regex reads 48)
    ("Final answer: 48 + 24 = 72", "72"),
    ("Final answer: 72. Check: 3 + 4 = 7", "72"),
    # \boxed, with LaTeX inside
    ("Thus the total is \\[ \\boxed{72} \\]", "72"),
    ("The answer is $\\boxed{\\frac{3}{4}}$.", "0.75"),
    ("\\boxed{\\dfrac{10}{4}}", "2.5"),
    ("\\boxed{\\frac{1}{3}}", "1/3"),
    ("\\boxed{3\\frac{1}{2}}", "3.5"),
    ("\\boxed{-\\frac{1}{2}}", "-0.5"),
    ("\\boxed{\\$18}", "18"),
    ("\\boxed{18 \\text{ dollars}}", "18"),
    ("\\boxed{50\\%}", "50"),
    ("\\boxed{1,000}", "1000"),
    ("\\boxed{x = 5}", "5"),
    ("\\boxed{\\frac{48}{2} + 48 = 72}", "72"),
    ("\\boxed{0.50}", "0.5"),
    ("\\boxed{7/2}", "3.5"),
    ("Final answer: \\boxed{\\frac{6}{3}}", "2"),
    # several answers: the last explicit one wins
    ("First guess \\boxed{10}. Wait, recheck.\nFinal answer: 12", "12"),
    ("Final answer: 12\nActually I made an error: \\boxed{14}", "14"),
    # an echoed template without a number is skipped
    ("I will end with 'Final answer: <number>'. 5 + 6 = 11. \\boxed{11}", "11"),
    ("So the result is 11.\nFinal answer: <number>", "11"),
    # no marker: "the answer is", then the last number
    ("Adding up, the answer is 256 apples.", "256"),
    ("She has 3 cats and 4 dogs, 7 pets", "7"),
    ("no digits at all", None),
    ("", None),
]


@pytest.mark.parametrize("text,expected", CASES)
def test_extract(text, expected):
    assert extract_answer(text) == expected


def test_source_and_strict_mode():
    assert extract("x \\boxed{4}").source == "boxed"
    assert extract("Final answer: 4").source == "final"
    assert extract("It is 4 and 5").source == "last-number"
    assert extract_answer("It is 4 and 5", fallback_last_number=False) is None


def test_answers_equal():
    assert answers_equal("72", 72)
    assert answers_equal("2.5", "5/2")
    assert answers_equal("1000", "1,000")
    assert not answers_equal("72", "73")
    assert not answers_equal(None, "1")


def test_reasoning_gym_scorer_agrees_after_normalisation():
    """reasoning-gym's own gsm_symbolic scorer reads the first number of the answer string:
    fed the raw text it gets "1,500" and "48 + 24 = 72" wrong; fed extract_answer() it scores
    every formatting of the right answer 1.0 and a wrong answer < 1."""
    import reasoning_gym as rg

    ds = rg.create_dataset("gsm_symbolic", size=12, seed=7)
    for entry in ds:
        gold = Fraction(entry["answer"])  # mostly integers, some like "1687.5"
        s = format_number(gold)
        texts = [f"Step 1 ... Final answer: {int(gold):,}" if gold.denominator == 1 else
                 f"Step 1 ... Final answer: ${s}",
                 f"so \\[ \\boxed{{{s}}} \\]",
                 f"Final answer: 3 + 4 = {s}",
                 f"The answer is $\\boxed{{\\frac{{{format_number(2 * gold)}}}{{2}}}}$."]
        for text in texts:
            assert is_correct(text, entry, ds), text
            assert is_correct(text, entry)
        assert not is_correct(f"Final answer: {format_number(gold + 1)}", entry, ds)
    # what normalisation fixes: the scorer alone on a thousands separator
    entry = {"answer": "1500"}
    assert ds.score_answer("1,500", entry) < 1.0
    assert ds.score_answer(extract_answer("Final answer: 1,500"), entry) == 1.0
