"""The eval tasks, generated offline from fixed seeds.

- `math`: GSM-style word problems from reasoning-gym's `gsm_symbolic`
  generator, asked for long step-by-step work and a final line
  "The answer is N."; graded with math-verify (grading.py).
- `needle`: needle-in-a-haystack as CrystalCache §4.2 builds it: one of five
  needle templates, each with a random four-digit value, inserted at a depth
  (a fraction of the context) into filler; the question asks for the value;
  exact match of the four digits.
- `da`: delayed association (CrystalCache §4.2): a fact about a topic (one of
  three topic templates) early in the context, then filler interspersed with
  related mentions of the topic that never repeat the fact (high density:
  four mentions, low: two), then the original question; exact match.

The filler is built here from seeded templates (mundane, self-contained
sentences), so no corpus is downloaded. Context lengths are counted with the
served model's own tokenizer and chat template.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

MATH_INSTRUCTIONS = (
    "Solve the problem below. Work through it slowly and in detail: restate what is given, "
    "then write out every intermediate calculation on its own line, explain why you do each "
    "step, and double-check each result before you move on. When you are sure, end with a "
    "last line of the form 'The answer is N.' where N is a number."
)


@dataclass
class Item:
    """One prompt of a task, with what grading needs."""

    task: str
    id: str
    messages: list[dict]
    answer: str
    max_tokens: int
    meta: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)


# ----- math ------------------------------------------------------------------

def math_items(count: int, seed: int = 0, max_tokens: int = 512) -> list[Item]:
    """`count` gsm_symbolic problems from reasoning-gym (the same for the same seed)."""
    import reasoning_gym

    data = reasoning_gym.create_dataset("gsm_symbolic", size=count, seed=seed)
    items = []
    for i, entry in enumerate(data):
        question = entry["question"]
        # reasoning-gym's own ending asks for a bare answer; ours asks for work.
        question = question.replace(" Give the result as your final answer. Do not include units.", "")
        items.append(Item(
            task="math", id=f"math-{seed}-{i}",
            messages=[{"role": "user", "content": f"{MATH_INSTRUCTIONS}\n\nProblem: {question}"}],
            answer=str(entry["answer"]), max_tokens=max_tokens,
            meta={"source": "reasoning_gym.gsm_symbolic", "seed": seed, "index": i},
        ))
    return items


# ----- filler ------------------------------------------------------------------

_PLACES = ["the harbour", "the old mill", "the market square", "the valley road", "the library",
           "the orchard", "the train station", "the river bank", "the hill farm", "the bakery",
           "the school yard", "the north field", "the fishing pier", "the town hall", "the quarry"]
_PEOPLE = ["the baker", "a farmer", "the teacher", "two children", "the mayor", "a fisherman",
           "the postman", "an old woman", "the carpenter", "a student", "the gardener", "a painter"]
_ACTIONS = ["walked slowly past", "stopped for a while near", "swept the path in front of",
            "counted the crates at", "took a photograph of", "sat on a bench by",
            "talked about the weather at", "repaired a fence beside", "waited for the bus near",
            "read a newspaper outside", "planted tulips around", "painted a picture of"]
_TIMES = ["in the morning", "after lunch", "late in the afternoon", "before sunset", "on Sunday",
          "during the rain", "at noon", "early on Tuesday", "in the evening", "on a cold day"]
_REMARKS = ["The sky was grey and the air smelled of wet grass.",
            "Nothing unusual happened that day.",
            "A dog barked somewhere in the distance.",
            "The shops closed at the usual time.",
            "Most people agreed it had been a quiet week.",
            "The wind carried leaves across the road.",
            "Someone had left a blue bicycle against the wall.",
            "The clock on the tower was five minutes slow."]


def filler_sentence(rng: random.Random) -> str:
    if rng.random() < 0.2:
        return rng.choice(_REMARKS)
    person, action, place, time = (rng.choice(_PEOPLE), rng.choice(_ACTIONS), rng.choice(_PLACES),
                                   rng.choice(_TIMES))
    return f"{person[0].upper()}{person[1:]} {action} {place} {time}."


# ----- needle ------------------------------------------------------------------

#: (statement, question) with {v} the four-digit value.
NEEDLES = [
    ("The special magic number is {v}.", "What is the special magic number?"),
    ("The secret code for Project Aurora is {v}.", "What is the secret code for Project Aurora?"),
    ("The access PIN of the north warehouse is {v}.", "What is the access PIN of the north warehouse?"),
    ("The winning ticket in the spring raffle was number {v}.", "What was the number of the winning ticket in the spring raffle?"),
    ("The hidden archive is kept in room {v}.", "In which room is the hidden archive kept?"),
]

#: (fact, question, related mentions that never repeat the fact)
TOPICS = [
    ("The secret code for Project Aurora is {v}.", "What is the secret code for Project Aurora?",
     ["Progress on Project Aurora was reviewed at the weekly meeting.",
      "The Aurora team adjusted its resource allocation for the next quarter.",
      "Two engineers joined Project Aurora from the design group.",
      "The Aurora budget report was sent to the board.",
      "A delay in Project Aurora's testing schedule was discussed.",
      "The Aurora team moved to a larger office on the third floor."]),
    ("Agent Nightingale's badge number is {v}.", "What is Agent Nightingale's badge number?",
     ["Agent Nightingale filed a report on the border crossing.",
      "Nightingale was seen leaving the embassy before dawn.",
      "The handler asked for an update from Agent Nightingale.",
      "Nightingale's cover story held up during the interview.",
      "A message from Agent Nightingale arrived two days late.",
      "Nightingale requested a new safe house in the old town."]),
    ("The reference number of Formula X is {v}.", "What is the reference number of Formula X?",
     ["The lab ran another stability test on Formula X.",
      "Formula X was stored in the cold room overnight.",
      "The chemists compared Formula X with the older mixture.",
      "A sample of Formula X was shipped to the partner lab.",
      "The safety sheet for Formula X was updated.",
      "Formula X showed no change in colour after a week."]),
]

ANSWER_HINT = " Answer with the four-digit number only."


def _four_digits(rng: random.Random) -> str:
    return str(rng.randint(1000, 9999))


def _fill(rng: random.Random, count_tokens: Callable[[str], int], target: int) -> list[str]:
    """Filler sentences whose text is about `target` tokens (never over)."""
    out, used = [], 0
    while True:
        s = filler_sentence(rng)
        n = count_tokens(" " + s)
        if used + n > target:
            return out
        out.append(s)
        used += n


def _chat(context: str, question: str) -> list[dict]:
    return [{"role": "user", "content": f"Read the text below, then answer the question after it.\n\n"
                                        f"{context}\n\nQuestion: {question}{ANSWER_HINT}"}]


def needle_items(count_tokens: Callable[[str], int], lengths=(1024, 2048), depths=(0.0, 0.25, 0.5, 0.75, 1.0),
                 reps: int = 1, seed: int = 0, max_tokens: int = 32) -> list[Item]:
    """One item per (length, depth, repetition); `count_tokens` counts a
    string's tokens with the served model's tokenizer; `length` is the
    filler's token count (the prompt adds the template and question)."""
    rng = random.Random(seed)
    items = []
    for length in lengths:
        for depth in depths:
            for rep in range(reps):
                statement, question = rng.choice(NEEDLES)
                value = _four_digits(rng)
                needle = statement.format(v=value)
                filler = _fill(rng, count_tokens, length - count_tokens(" " + needle))
                at = round(depth * len(filler))
                context = " ".join(filler[:at] + [needle] + filler[at:])
                items.append(Item(
                    task="needle", id=f"needle-{length}-{depth}-{rep}", messages=_chat(context, question),
                    answer=value, max_tokens=max_tokens,
                    meta={"length": length, "depth": depth, "rep": rep, "needle": needle, "seed": seed},
                ))
    return items


def da_items(count_tokens: Callable[[str], int], distances=(1024, 2048), densities=(("high", 4), ("low", 2)),
             samples: int = 2, seed: int = 0, max_tokens: int = 32) -> list[Item]:
    """One item per (distance, density, sample): the fact first, then
    `distance` tokens of filler with the topic's related mentions spread
    through it, then the question."""
    rng = random.Random(seed + 1)
    items = []
    for distance in distances:
        for density, mentions in densities:
            for sample in range(samples):
                fact, question, related = rng.choice(TOPICS)
                value = _four_digits(rng)
                fact_text = fact.format(v=value)
                chosen = rng.sample(related, mentions)
                budget = distance - sum(count_tokens(" " + m) for m in chosen)
                filler = _fill(rng, count_tokens, budget)
                # Mentions at evenly spread random points after the fact.
                cuts = sorted(rng.sample(range(1, max(len(filler), mentions + 1)), mentions))
                body: list[str] = []
                last = 0
                for cut, mention in zip(cuts, chosen):
                    body += filler[last:cut] + [mention]
                    last = cut
                body += filler[last:]
                context = " ".join([fact_text] + body)
                items.append(Item(
                    task="da", id=f"da-{distance}-{density}-{sample}", messages=_chat(context, question),
                    answer=value, max_tokens=max_tokens,
                    meta={"distance": distance, "density": density, "mentions": mentions, "fact": fact_text,
                          "seed": seed},
                ))
    return items


@dataclass
class TaskConfig:
    """How many items of each task, and their shapes (all recorded in the results)."""

    math: int = 20
    math_seed: int = 0
    math_max_tokens: int = 512
    needle_lengths: tuple = (1024, 2048)
    needle_depths: tuple = (0.0, 0.25, 0.5, 0.75, 1.0)
    needle_reps: int = 1
    da_distances: tuple = (1024, 2048)
    da_samples: int = 2
    seed: int = 0
    #: "task" (COMPRESS_PROMPT below) or "always" (every task's prompt compressed)
    compress_prompt: str = "task"

    def to_json(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


#: Whether a task's prompt goes to the compressed region for every
#: compressing policy (True), or follows each policy's default (None). The
#: long-context tasks put the whole context under the budget; on math the
#: prompt is short and the generation long, so the policies run as a user
#: gets them by default.
COMPRESS_PROMPT = {"math": None, "needle": True, "da": True}


def build_items(tasks: list[str], cfg: TaskConfig, count_tokens: Optional[Callable[[str], int]]) -> dict[str, list[Item]]:
    out: dict[str, list[Item]] = {}
    for task in tasks:
        if task == "math":
            out[task] = math_items(cfg.math, cfg.math_seed, cfg.math_max_tokens)
        elif task == "needle":
            out[task] = needle_items(count_tokens, cfg.needle_lengths, cfg.needle_depths, cfg.needle_reps, cfg.seed)
        elif task == "da":
            out[task] = da_items(count_tokens, cfg.da_distances, samples=cfg.da_samples, seed=cfg.seed)
        else:
            raise ValueError(f"unknown task {task!r} (tasks: math, needle, da)")
    return out


def load_or_build_items(path: Optional[str], tasks: list[str], cfg: TaskConfig,
                        count_tokens: Optional[Callable[[str], int]]) -> dict[str, list[Item]]:
    """build_items, kept in `path` (JSON) when given: read back when the file
    holds the same tasks and config, else built and written there."""
    import json
    from pathlib import Path

    if path is None:
        return build_items(tasks, cfg, count_tokens)
    file = Path(path)
    if file.exists():
        saved = json.loads(file.read_text())
        if saved.get("config") != cfg.to_json() or sorted(saved.get("items", {})) != sorted(tasks):
            raise ValueError(f"{file}: built for other tasks or another config; delete it or use another "
                             f"--items-file")
        return {t: [Item(**i) for i in saved["items"][t]] for t in tasks}
    items = build_items(tasks, cfg, count_tokens)
    file.write_text(json.dumps({"config": cfg.to_json(), "items": {t: [i.to_json() for i in its]
                                                                  for t, its in items.items()}}))
    return items
