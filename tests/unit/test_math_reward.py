"""The math reward's answer extraction and numeric equivalence."""

from __future__ import annotations

import time
from fractions import Fraction

import pytest

from mcore_rl.rewards.math import extract_answer, last_boxed, math_reward, parse_number


@pytest.mark.parametrize(
    "text,value",
    [
        ("42", 42),
        ("-2.5", Fraction(-5, 2)),
        ("1,234", 1234),
        ("3/4", Fraction(3, 4)),
        ("\\frac{3}{4}", Fraction(3, 4)),
        ("\\dfrac{-1}{2}", Fraction(-1, 2)),
        ("$5.", 5),
        ("50\\%", Fraction(1, 2)),
        ("x + 1", None),
        ("1/0", None),
    ],
)
def test_parse_number(text, value):
    assert parse_number(text) == value


def test_extraction_prefers_the_last_box_then_the_last_number():
    assert last_boxed("so \\boxed{\\frac{1}{2}} and \\boxed{3}") == "3"
    assert last_boxed("\\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert last_boxed("unclosed \\boxed{2") is None
    assert extract_answer("12 + 7 = 19. The answer is 19.") == "19"
    assert extract_answer("no digits here") is None


@pytest.mark.parametrize(
    "response,answer,reward",
    [
        ("The answer is \\boxed{0.5}", "1/2", 1.0),
        ("I think it is 19.", "19", 1.0),
        ("It is 19, no wait, 20", "19", 0.0),
        ("\\boxed{x+1}", "x + 1", 1.0),
        ("nothing", "3", 0.0),
        ("-3", "-3.0", 1.0),
    ],
)
def test_math_reward(response, answer, reward):
    assert math_reward(response, answer) == reward


@pytest.mark.parametrize(
    "response",
    [r"\boxed{1e999999999}", r"\boxed{-1E+99999999/3}", "9" * 1_000_000, r"\boxed{" + "9" * 5000 + "}",
     r"\boxed{\frac{" + "7" * 10_000 + "}{3}}", "1e99999999", r"\boxed{" * 100_000, "{" * 100_000 + "}" * 100_000],
    ids=["huge_exponent", "huge_negative_exponent", "million_digits", "boxed_digits", "huge_fraction", "bare_exponent",
         "unclosed_boxes", "deep_braces"],
)  # fmt: skip
def test_hostile_answers_score_quickly_and_never_raise(response):
    start = time.monotonic()
    assert math_reward(response, "1") == 0.0
    assert time.monotonic() - start < 10  # milliseconds; the power alone took minutes before the cap
