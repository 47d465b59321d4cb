"""Rule-based reward for math answers: the response's final answer equals the reference answer as a number.

The final answer is the last ``\\boxed{...}`` if there is one, else the last number in the response. Numbers
compare exactly as fractions, so "0.5", "1/2", "\\frac{1}{2}" and "$0.50" are all the same answer; answers that
are not numbers compare as normalised text.
"""

from __future__ import annotations

import re
from fractions import Fraction

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:\s*/\s*\d+)?|-?\.\d+")
_FRAC = re.compile(r"\\d?frac\{([^{}]+)\}\{([^{}]+)\}")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None


MAX_NUMBER_CHARS = 100  # longer answers compare as text: no digit string or exponent is ever expanded
_EXPONENT = re.compile(r"[eE][+-]?\d{4,}")  # 1e1000 and beyond: Fraction would compute the power


def parse_number(text: str) -> Fraction | None:
    """The exact value of a numeric answer ("1,234", "-2.5", "3/4", "\\frac{3}{4}", "$5.", "50%"), else None."""
    if len(text) > MAX_NUMBER_CHARS or _EXPONENT.search(text):
        return None
    s = text.strip().strip("$").strip().rstrip(".").replace("\\%", "%").replace("\\!", "")
    s = _FRAC.sub(r"(\1)/(\2)", s).replace("(", "").replace(")", "")
    percent = s.endswith("%")
    s = s.rstrip("%").replace(",", "").replace(" ", "")
    try:
        value = Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None
    return value / 100 if percent else value


def extract_answer(response: str) -> str | None:
    """The response's final answer: the last boxed expression, else the last number."""
    boxed = last_boxed(response)
    if boxed is not None:
        return boxed
    numbers = _NUMBER.findall(response)
    return numbers[-1] if numbers else None


def _normalise(text: str) -> str:
    return re.sub(r"\s+", "", text).strip("$.").lower()


def math_reward(response: str, answer: str) -> float:
    """1.0 if the response's final answer equals ``answer`` (numerically, else as normalised text), else 0.0."""
    found = extract_answer(response)
    if found is None:
        return 0.0
    got, want = parse_number(found), parse_number(str(answer))
    if got is not None and want is not None:
        return float(got == want)
    return float(_normalise(found) == _normalise(str(answer)))
