"""Property test through the real engine: every served policy over a seeded
sample of private prompt lengths, prefix-cache hits, budgets and max_tokens.

A `kvsieve serve` of this module's own (tiny Llama on CPU: 2 layers x 2 kv
heads, pages of 16 slots) with a small fixed compressed region, so that 16
requests sent at once contend for region room and some wait in the queue for
it. Its radix cache holds only this module's prompts, so the prefix-cache
hits are the ones the cases set up.

The cases (CASES_PER_POLICY for each policy `GET /v1/kv_policies` lists,
which must be the registry's `policy_names()`, so a newly registered policy
is covered too; 10 policies today, so 600 cases, about 900 requests with the
prefix requests, 25 s on an idle 2-core machine; SEED fixes them) draw:

- a private prompt of 1..64 tokens (a quarter of them 1..5), as token ids;
- half of them a prefix-cache hit of 1..32 tokens: the prefix P goes first
  as a `full` request (which leaves it in the radix tree), then P + the
  private tail under the policy; kv_usage.prefix_cache_hit_tokens reads the hit;
- a budget from the policy's floor (the smallest its check_budget accepts
  with default params; the catalog's schema says only `minimum: 1`) up to 4x
  the prompt, biased toward the floor; one in 12 below the floor, which must
  be a 400 naming the field check_budget names;
- compress_prompt left to the policy's default, or on, or off;
- max_tokens 1..40 (biased to 1, 2 and 40), ignore_eos on or off.

Per case: HTTP 200 (or the expected 400 in OpenAI's error shape), a sane
finish_reason, completion_tokens <= max_tokens (== with ignore_eos), usage and
kv_usage consistent (policy, prompt and cached tokens, private tokens,
0 <= retained <= private, evicted >= 0, the region's part of retained under
the policy's own compressed ceiling). A watcher polls /health and the server
process through the run. After all cases: every region page (full-precision
and quantized) is free again, nothing is reserved, no compressed request is
live, the token pool holds nothing in use, and a `full` request still runs.
Every failure is collected with its request body, so one run lists them all.
"""

from __future__ import annotations

import concurrent.futures
import random
import threading
from dataclasses import dataclass
from typing import Optional

import httpx
import pytest

from conftest import start_server
from kvsieve.policies import get_policy, policy_names
from test_compressed import metric, region_idle

SEED = 20240611
CASES_PER_POLICY = 60
CONCURRENCY = 16
#: Region pages (16 slots each; 4 (layer, head) pairs per request). The
#: largest case (96-token prompt, 40 new tokens) may hold 136 tokens per pair:
#: 9 pages each, 36 in all, so every case fits alone but 16 at once do not.
REGION_PAGES = 96
QUANT_PAGES = 96  # thinkv's TBQ pages (default 0 once REGION_PAGES is fixed)
PAGE_SIZE = 16
PAIRS = 2 * 2
FIRST_PLAIN = range(3, 260)  # first ids of prompts without a prefix (0-2: special tokens)
FIRST_PREFIX = range(260, 410)  # first ids of the prefixes P
VOCAB = range(3, 410)


@pytest.fixture(scope="module")
def region_server(tiny_llama, tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("property"), "--model", str(tiny_llama),
                          env={"KVSIEVE_REGION_PAGES": str(REGION_PAGES),
                               "KVSIEVE_REGION_QUANT_PAGES": str(QUANT_PAGES)})
    yield server
    assert server.stop() == 0, server.log()


def budget_floor(name: str) -> int:
    """Smallest budget the policy accepts with its default params."""
    cls = get_policy(name)
    params = cls.Params()
    for budget in range(1, 1 << 16):
        if cls.check_budget(params, budget, None) is None:
            return budget
    raise AssertionError(f"{name}: no budget below 65536 passes check_budget")


@dataclass
class Case:
    index: int
    name: str
    prefix: list  # sent first as a `full` request; [] for none
    tail: list  # the private part
    kv_policy: object
    budget: Optional[int]
    max_tokens: int
    ignore_eos: bool
    #: The 400's error.param where the budget is below the floor, else None.
    bad_field: Optional[str] = None
    #: Whether the prompt's first id is used by no other prompt (then no hit).
    fresh: bool = False

    @property
    def prompt(self) -> list:
        return self.prefix + self.tail

    def body(self) -> dict:
        return {"prompt": self.prompt, "max_tokens": self.max_tokens, "temperature": 0,
                "ignore_eos": self.ignore_eos, "kv_policy": self.kv_policy}


def make_cases(names: list[str], rng: random.Random) -> list[Case]:
    plain_firsts = list(FIRST_PLAIN)
    rng.shuffle(plain_firsts)
    cases = []
    for round_ in range(CASES_PER_POLICY):
        for name in names:
            cls = get_policy(name)
            private = rng.randint(1, 5) if rng.random() < 0.25 else rng.randint(1, 64)
            if rng.random() < 0.5:
                hit = rng.randint(1, 32)
                prefix = [rng.choice(FIRST_PREFIX)] + [rng.choice(VOCAB) for _ in range(hit - 1)]
                tail = [rng.choice(VOCAB) for _ in range(private)]
                fresh = False
            else:
                prefix = []
                # A first id of its own (then no hit); once they run out, a
                # prefix's (a hit is then possible, and read back).
                fresh = bool(plain_firsts)
                first = plain_firsts.pop() if fresh else rng.choice(FIRST_PREFIX)
                tail = [first] + [rng.choice(VOCAB) for _ in range(private - 1)]
            r = rng.random()
            max_tokens = 1 if r < 0.2 else 2 if r < 0.3 else 40 if r < 0.4 else rng.randint(1, 40)
            case = Case(len(cases), name, prefix, tail, name, None, max_tokens, rng.random() < 0.7, fresh=fresh)
            if cls.compresses:
                spec: dict = {"name": name}
                floor = budget_floor(name)
                if rng.random() < 1 / 12:
                    budget = rng.randint(max(0, floor - 20), floor - 1)
                    problem = cls.check_budget(cls.Params(), budget, None) if budget >= 1 else ("budget", "")
                    case.bad_field = f"kv_policy.{problem[0]}"
                else:
                    top = max(floor, 4 * len(case.prompt))
                    budget = rng.randint(floor, min(top, floor + 3)) if rng.random() < 0.3 else rng.randint(floor, top)
                spec["budget"] = case.budget = budget
                r = rng.random()
                if r < 0.2:
                    spec["compress_prompt"] = True
                elif r < 0.4:
                    spec["compress_prompt"] = False
                case.kv_policy = spec
            elif rng.random() < 0.5:
                case.kv_policy = {"name": name}
            cases.append(case)
    return cases


def check_case(url: str, client: httpx.Client, case: Case) -> list[str]:
    """Run one case; the properties it breaks (empty: none)."""
    problems = []
    if case.prefix:
        r = client.post(f"{url}/v1/completions", json={"prompt": case.prefix, "max_tokens": 1, "temperature": 0,
                                                      "kv_policy": "full"})
        if r.status_code != 200:
            return [f"prefix request: HTTP {r.status_code}: {r.text[:500]}"]
    r = client.post(f"{url}/v1/completions", json=case.body())
    if case.bad_field is not None:
        if r.status_code != 400:
            return [f"budget below the floor: expected a 400 naming {case.bad_field}, got "
                    f"HTTP {r.status_code}: {r.text[:500]}"]
        error = r.json().get("error") or {}
        if error.get("param") != case.bad_field or case.bad_field not in error.get("message", "") \
                or error.get("type") != "invalid_request_error":
            problems.append(f"400 not naming {case.bad_field} in OpenAI's shape: {r.text[:500]}")
        return problems
    if r.status_code != 200:
        return [f"HTTP {r.status_code}: {r.text[:1000]}"]
    out = r.json()
    choice, usage, kv = out["choices"][0], out.get("usage") or {}, out.get("kv_usage")
    n_prompt, done = len(case.prompt), usage.get("completion_tokens")
    finish = choice.get("finish_reason")
    if not isinstance(done, int) or not 1 <= done <= case.max_tokens:
        problems.append(f"completion_tokens {done} outside 1..max_tokens {case.max_tokens}")
    elif case.ignore_eos and (done != case.max_tokens or finish != "length"):
        problems.append(f"ignore_eos: {done} tokens, finish_reason {finish!r}; wanted {case.max_tokens}, 'length'")
    elif finish not in ("stop", "length") or (finish == "length" and done != case.max_tokens):
        problems.append(f"finish_reason {finish!r} after {done} of {case.max_tokens} tokens")
    if usage.get("prompt_tokens") != n_prompt:
        problems.append(f"usage.prompt_tokens {usage.get('prompt_tokens')} != {n_prompt}")
    if not isinstance(kv, dict):
        return problems + [f"no kv_usage: {out}"]
    hit = kv.get("prefix_cache_hit_tokens")
    fields = ("prompt_tokens", "prefix_cache_hit_tokens", "private_tokens", "retained_tokens", "evicted_tokens")
    if not all(isinstance(kv.get(f), int) for f in fields):
        return problems + [f"kv_usage lacks an integer field of {fields}: {kv}"]
    if kv.get("policy") != case.name:
        problems.append(f"kv_usage.policy {kv.get('policy')!r}")
    if kv["prompt_tokens"] != n_prompt or hit != (usage.get("prompt_tokens_details") or {}).get("cached_tokens"):
        problems.append(f"kv_usage prompt/hit {kv['prompt_tokens']}/{hit} against usage {usage}")
    lowest = len(case.prefix) if case.prefix else 0
    highest = 0 if case.fresh else n_prompt - 1
    if not lowest <= hit <= max(lowest, highest):
        problems.append(f"prefix_cache_hit_tokens {hit}, expected {lowest}..{max(lowest, highest)}")
    private = n_prompt - hit + (done or 0)
    retained, evicted = kv["retained_tokens"], kv["evicted_tokens"]
    if kv["private_tokens"] != private:
        problems.append(f"private_tokens {kv['private_tokens']} != prompt - hit + generated = {private}")
    if retained < 0 or evicted < 0 or retained > private or retained > n_prompt + (done or 0):
        problems.append(f"retained {retained} / evicted {evicted} out of range (private {private})")
    cls = get_policy(case.name)
    if not cls.compresses:
        if retained != private or evicted != 0:
            problems.append(f"full: retained {retained}, evicted {evicted}, private {private}")
    else:
        # The region's part of retained stays under the compressed ceiling the
        # policy reserves at admission (tokens per layer and kv head).
        in_region = case.kv_policy.get("compress_prompt", cls.compress_prompt)
        private_prompt = n_prompt - hit
        region_prompt = private_prompt if in_region else 0
        region_part = retained - (0 if in_region else private_prompt)
        ceiling = cls().max_private_tokens(cls.Params(), region_prompt, case.max_tokens, case.budget)
        if not 0 <= region_part <= ceiling:
            problems.append(f"region part of retained {region_part} outside 0..ceiling {ceiling}")
    return problems


class Watcher(threading.Thread):
    """Polls /health and the server process while the cases run."""

    def __init__(self, server):
        super().__init__(daemon=True)
        self.server, self.stop, self.problems, self.polls = server, threading.Event(), [], 0

    def run(self):
        while not self.stop.wait(0.5):
            self.polls += 1
            if self.server.proc.poll() is not None:
                self.problems.append(f"server exited with {self.server.proc.returncode}")
                return
            try:
                r = httpx.get(f"{self.server.url}/health", timeout=10)
                if r.status_code != 200:
                    self.problems.append(f"/health: HTTP {r.status_code} {r.text[:200]}")
            except httpx.HTTPError as exc:
                self.problems.append(f"/health: {exc!r}")


def test_every_policy_over_sampled_lengths_budgets_and_prefix_hits(region_server):
    server = region_server
    catalog = httpx.get(f"{server.url}/v1/kv_policies", timeout=30).json()["data"]
    names = [entry["id"] for entry in catalog]
    assert sorted(names) == policy_names(), (names, policy_names())
    assert len(names) >= 9
    cases = make_cases(names, random.Random(SEED))

    watcher = Watcher(server)
    watcher.start()
    failures = []
    with httpx.Client(timeout=300, limits=httpx.Limits(max_connections=CONCURRENCY)) as client, \
            concurrent.futures.ThreadPoolExecutor(CONCURRENCY) as pool:
        futures = {pool.submit(check_case, server.url, client, case): case for case in cases}
        for future in concurrent.futures.as_completed(futures):
            case = futures[future]
            try:
                problems = future.result()
            except Exception as exc:  # a dropped connection, a body that is no JSON
                problems = [f"{type(exc).__name__}: {exc}"]
            if problems:
                failures.append((case.index, f"case {case.index} ({case.name}, private {len(case.tail)}, prefix "
                                             f"{len(case.prefix)}): {'; '.join(problems)}\n    "
                                             f"prefix={case.prefix} body={case.body()}"))
    watcher.stop.set()
    watcher.join()

    # Every page back; nothing reserved or live; the token pool holds no
    # request's tokens; the engine still serves.
    leaks = []
    if not region_idle(server):
        leaks.append(f"region pages still used: {metric(server, 'kvsieve_region_pages', state='used')}")
    for name, labels, wanted in [("kvsieve_region_pages", {"state": "free"}, REGION_PAGES),
                                 ("kvsieve_region_quantized_pages", {"state": "used"}, 0),
                                 ("kvsieve_region_quantized_pages", {"state": "free"}, QUANT_PAGES),
                                 ("kvsieve_region_reserved_pages", {}, 0),
                                 ("kvsieve_compressed_requests_live", {}, 0),
                                 ("kvsieve_token_pool_tokens", {"state": "in_use"}, 0)]:
        if (value := metric(server, name, **labels)) != wanted:
            leaks.append(f"{name}{labels or ''} = {value}, wanted {wanted}")

    rejected = sum(c.bad_field is not None for c in cases)
    summary = (f"{len(cases)} cases ran ({len(names)} policies x {CASES_PER_POLICY}; "
               f"{sum(bool(c.prefix) for c in cases)} after a prefix, {rejected} below the floor; "
               f"{watcher.polls} health polls)")
    print(summary)
    assert not watcher.problems, f"{summary}: the server was unhealthy: {watcher.problems[:5]}"
    assert not failures and not leaks, (
        f"{summary}: {len(failures)} failed; after them: {leaks or 'every page back'}\n"
        + "\n".join(text for _, text in sorted(failures)[:40]))
    r = httpx.post(f"{server.url}/v1/completions", timeout=60,
                   json={"prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True, "kv_policy": "full"})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
