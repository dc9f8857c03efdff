"""Grading: math-verify for the math task, exact match of the four-digit
value for needle and delayed association; the final answer a generation
commits to (for answer agreement between two runs)."""

from __future__ import annotations

import re
from typing import Optional

_ANSWER_LINE = re.compile(r"answer\s*(?:is|:)", re.IGNORECASE)
_FOUR = re.compile(r"(?<!\d)\d{4}(?!\d)")


def _answer_tail(text: str) -> str:
    """The text after the last 'answer is' / 'answer:', else all of it."""
    matches = list(_ANSWER_LINE.finditer(text))
    return text[matches[-1].end():] if matches else text


def math_answer(text: str) -> Optional[str]:
    """math-verify's reading of the final answer ('The answer is N.' or the last expression)."""
    from math_verify import parse

    parsed = parse(_answer_tail(text))
    return str(parsed[-1]) if parsed else None


def grade_math(text: str, gold: str) -> bool:
    from math_verify import parse, verify

    pred = parse(_answer_tail(text))
    return bool(pred) and bool(verify(parse(gold), pred))


def four_digit_answer(text: str) -> Optional[str]:
    m = _FOUR.search(text)
    return m.group(0) if m else None


def grade_exact(text: str, gold: str) -> bool:
    """Exact match of the value: the first four-digit number of the output is it."""
    return four_digit_answer(text) == gold


def final_answer(task: str, text: str) -> Optional[str]:
    return math_answer(text) if task == "math" else four_digit_answer(text)


def grade(task: str, text: str, gold: str) -> bool:
    return grade_math(text, gold) if task == "math" else grade_exact(text, gold)
