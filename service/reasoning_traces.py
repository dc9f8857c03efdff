"""Labelled reasoning traces for `kvsieve calibrate skipkv`, generated here
from seeded templates (no download): a word problem and a step-by-step
solution, one sentence per line, each sentence labelled

- execution: a step that computes or states something new;
- reflection: re-checking what was done ("Wait, let me check ...");
- transition: switching approach ("Alternatively, ...").

The classes follow SEAL's and SkipKV's thought types. Reflection and
transition sentences are spliced in between execution steps at seeded
places, as a long chain of thought re-validates.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

EXECUTION, REFLECTION, TRANSITION = "execution", "reflection", "transition"

_NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jun"]
_ITEMS = ["apples", "books", "coins", "marbles", "stamps", "pencils", "cards", "shells"]


@dataclass(frozen=True)
class Trace:
    problem: str
    sentences: tuple[tuple[str, str], ...]  # (text, label), in order


def _boxes(rng: random.Random) -> tuple[str, list[str], list[int]]:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    have, boxes, each = rng.randint(12, 90), rng.randint(2, 9), rng.randint(3, 30)
    bought = boxes * each
    total = have + bought
    gone = total // 3
    left = total - gone
    problem = (f"{name} has {have} {item}. {name} buys {boxes} boxes with {each} {item} each, then gives away "
               f"a third of everything, rounded down. How many {item} are left?")
    steps = [f"{name} starts with {have} {item}.",
             f"The boxes hold {boxes} x {each} = {bought} {item}.",
             f"Together that is {have} + {bought} = {total} {item}.",
             f"A third of {total}, rounded down, is {gone}.",
             f"So {name} keeps {total} - {gone} = {left} {item}.",
             f"The answer is {left}."]
    return problem, steps, [bought, total, gone, left]


def _equation(rng: random.Random) -> tuple[str, list[str], list[int]]:
    x, m, k = rng.randint(2, 20), rng.randint(2, 9), rng.randint(1, 40)
    rhs = m * x + k
    problem = f"Solve for x: {m}x + {k} = {rhs}."
    steps = [f"Subtract {k} from both sides: {m}x = {rhs} - {k} = {rhs - k}.",
             f"Divide both sides by {m}: x = {rhs - k} / {m}.",
             f"That gives x = {x}.",
             f"Substituting back, {m} x {x} + {k} = {m * x} + {k} = {rhs}.",
             f"The answer is {x}."]
    return problem, steps, [rhs - k, x, m * x]


def _speed(rng: random.Random) -> tuple[str, list[str], list[int]]:
    name = rng.choice(_NAMES)
    speed, hours, extra = rng.randint(20, 90), rng.randint(2, 6), rng.randint(5, 60)
    first = speed * hours
    total = first + extra
    problem = (f"{name} drives at {speed} km per hour for {hours} hours, then walks {extra} km. "
               f"How far does {name} travel in all?")
    steps = [f"Distance is speed times time.",
             f"Driving covers {speed} x {hours} = {first} km.",
             f"Walking adds {extra} km.",
             f"In all that is {first} + {extra} = {total} km.",
             f"The answer is {total}."]
    return problem, steps, [first, total]


def _percent(rng: random.Random) -> tuple[str, list[str], list[int]]:
    price, pct = rng.randint(4, 60) * 10, rng.choice([10, 20, 25, 30, 40, 50])
    off = price * pct // 100
    paid = price - off
    problem = f"A coat costs {price} dollars and is sold at {pct} percent off. What is the sale price?"
    steps = [f"{pct} percent of {price} is {price} x {pct} / 100 = {off}.",
             f"The discount is {off} dollars.",
             f"The sale price is {price} - {off} = {paid} dollars.",
             f"The answer is {paid}."]
    return problem, steps, [off, paid]


GENERATORS = (_boxes, _equation, _speed, _percent)

_REFLECTIONS = [
    "Wait, let me check that again.",
    "Wait, is {n} right? Let me verify it.",
    "Let me double-check {n} before going on.",
    "Hmm, let me recheck the last step.",
    "Let me verify: yes, {n} is correct.",
    "Wait, I should check whether {n} makes sense.",
    "Let me go back and check the arithmetic again.",
    "Hmm, did I get {n}? Let me confirm.",
]
_TRANSITIONS = [
    "Alternatively, I could solve it another way.",
    "Alternatively, let me try a different approach.",
    "Another way to see it is to redo the calculation from the start.",
    "Let me think about this differently.",
    "Alternatively, maybe I should work backwards from {n}.",
    "Let me try approaching the problem again from the beginning.",
]


def trace(rng: random.Random, index: int) -> Trace:
    problem, steps, numbers = GENERATORS[index % len(GENERATORS)](rng)
    sentences: list[tuple[str, str]] = []
    for i, step in enumerate(steps):
        sentences.append((step, EXECUTION))
        if i == len(steps) - 1:
            break
        roll = rng.random()
        n = rng.choice(numbers)
        if roll < 0.35:
            sentences.append((rng.choice(_REFLECTIONS).format(n=n), REFLECTION))
        elif roll < 0.55:
            sentences.append((rng.choice(_TRANSITIONS).format(n=n), TRANSITION))
    if not any(label != EXECUTION for _, label in sentences):  # every trace has both classes
        sentences.insert(len(sentences) - 1, (rng.choice(_REFLECTIONS).format(n=numbers[-1]), REFLECTION))
    return Trace(problem=problem + " Think step by step.", sentences=tuple(sentences))


def traces(count: int, seed: int = 0) -> list[Trace]:
    """`count` labelled traces, the same for the same seed."""
    rng = random.Random(seed)
    return [trace(rng, i) for i in range(count)]
