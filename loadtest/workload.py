"""What the load test sends: the kv_policy mix, prompts, and request bodies.

Plain functions of a random.Random, so that the locust users and the tests
build the same requests.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

#: kv_policy choices and their weights in the mix. Budgets are small enough
#: that compressed requests evict during the run (every policy is exercised).
POLICIES: dict[str, dict] = {
    "full": {"name": "full"},
    "streaming": {"name": "streaming", "budget": 48},
    "h2o": {"name": "h2o", "budget": 48},
    "snapkv": {"name": "snapkv", "budget": 48},
    "longflow": {"name": "longflow", "budget": 48},
}
DEFAULT_WEIGHTS = {"full": 2, "streaming": 1, "h2o": 1, "snapkv": 1, "longflow": 1}

_TOPICS = [
    "the sum of the first ten odd numbers",
    "why the sky looks blue at noon and red at sunset",
    "how a hash map handles collisions",
    "whether 221 is a prime number",
    "the number of ways to climb eight stairs taking one or two steps",
    "what a KV cache stores during decoding",
]


@dataclass(frozen=True)
class PolicyMix:
    names: tuple[str, ...]
    weights: tuple[float, ...]

    @classmethod
    def parse(cls, spec: str | None) -> "PolicyMix":
        """"full,h2o" (equal weights) or "full=2,h2o=1"; None: the default mix."""
        if not spec:
            return cls(tuple(DEFAULT_WEIGHTS), tuple(DEFAULT_WEIGHTS.values()))
        names, weights = [], []
        for item in spec.split(","):
            name, _, weight = item.strip().partition("=")
            if name not in POLICIES:
                raise ValueError(f"unknown policy {name!r} in the mix (known: {', '.join(POLICIES)})")
            names.append(name)
            weights.append(float(weight) if weight else 1.0)
        return cls(tuple(names), tuple(weights))

    def pick(self, rng: random.Random) -> str:
        return rng.choices(self.names, self.weights)[0]


def chat_body(rng: random.Random, policy: str, max_tokens: int, stream: bool, reasoning: bool = False) -> dict:
    topic = rng.choice(_TOPICS)
    if reasoning:
        content = f"Think step by step, check every step twice, then answer: {topic}."
    else:
        content = f"In one sentence: {topic}."
    body = {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0.7,
        "stream": stream,
        # Fixed output lengths make TPOT and throughput comparable across policies.
        "ignore_eos": True,
        "kv_policy": POLICIES[policy],
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


#: Requests the server must refuse with a 4xx (never a 5xx): (label, raw body
#: or JSON object, expected status).
BAD_REQUESTS: list[tuple[str, object, int]] = [
    ("malformed json", b'{"messages": [', 400),
    ("unknown policy", {"messages": [{"role": "user", "content": "hi"}], "kv_policy": "no-such-policy"}, 400),
    ("negative budget", {"messages": [{"role": "user", "content": "hi"}],
                         "kv_policy": {"name": "h2o", "budget": -5}}, 400),
    ("budget on full", {"messages": [{"role": "user", "content": "hi"}],
                        "kv_policy": {"name": "full", "budget": 64}}, 400),
    ("max_tokens past the context", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10_000_000}, 400),
    ("no messages", {"max_tokens": 4}, 400),
    ("wrong model", {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}, 404),
    # Past the server's body limit (limits.max_body_bytes, 1 MiB by default).
    ("body too large", b'{"messages": [{"role": "user", "content": "' + b"x" * (1 << 20) + b'"}]}', 413),
]
