"""Traffic benchmark: one seeded arrival trace replayed against vanilla SGLang
and kvsieve on the same GPU at equal KV memory (issue #29, item 4).

    python bench/traffic.py [--engines vanilla,kvsieve] [--rates 1,2,4] [--duration 60]
        [--gen-min 512 --gen-max 16384] [--prompt-min 64 --prompt-max 2048]
        [--prefixes 4 --prefix-tokens 512] [--mix streaming:1,h2o:1,...,full:1] [--budget 1024]
        [--kv-tokens 786432] [--rate-timeout 1800] [--deadline 0] [--out bench/results/traffic.json]
    python bench/plot_traffic.py bench/results/traffic.json docs/plots/traffic.png

The trace (make_trace, a pure function of the options and --seed). Per
arrival rate r (requests/s): arrivals of a Poisson process, exponential gaps
of mean 1/r, over --duration seconds; each rate draws from its own seeded
stream, so adding a rate leaves the others' requests unchanged. Each request:
a generation length log-uniform in [--gen-min, --gen-max] (ignore_eos, so it
generates exactly that); a prompt length uniform in [--prompt-min,
--prompt-max] whose first min(--prefix-tokens, length - --private-min) ids
are one of --prefixes shared "system prompts" (random ids, seeded) and the
rest private random ids; a policy drawn from --mix (default: every policy
below with weight 1: streaming, h2o, rkv, skipkv, thinkv, crystal_kv,
longflow, crystalcache, snapkv and full) at --budget (a policy that refuses
it runs at the smallest budget it accepts, recorded in `policies`). The same
requests (arrival times, lengths, prompt ids) go to both engines; vanilla
gets no kv_policy (SGLang has none), kvsieve gets each request's policy in
`custom_params.kv_policy`.

The engines, one after the other in this process (the previous one shut
down), with gpu_headline.py's options (dummy weights of --model,
skip_tokenizer_init, mem_fraction_static 0.85, stream_interval 8, decode CUDA
graphs up to batch 128; --engine-args adds options to both) and the same KV
memory: vanilla SGLang (triton; torch_native on CPU) gets --kv-tokens tokens
of K and V as its token pool; kvsieve gets the headline's split, POOL_SHARE
(15%) of them as the token pool (max_total_tokens: prompts' shared prefixes,
`full` requests) and the rest as its compressed region
(KVSIEVE_REGION_PAGES pages of 16 slots per layer and KV head). kvsieve's
SGLang plugin is installed in both, as in the headline (it serves nothing
for requests without kv_policy). Both run with --max-running rows at most and
enable_metrics (per-request queue time and the retraction counter).

Replay. Before the first rate, a warm-up (one request per policy of the mix,
--warmup-tokens each, not measured) and, before every rate, an emptied radix
cache. An asyncio driver in the engine's own loop sends each request at its
arrival time (engine.async_generate, stream=True) and records the time of
each streamed chunk (every 8 tokens) and its completion_tokens. At
--rate-timeout seconds after the rate's start (shortened to meet
--deadline, seconds since this script started), requests not yet sent are
dropped (`unsent`) and those in flight are aborted (`unfinished`); past the
deadline the remaining rates are recorded as skipped.

Per (engine, rate), times from the first request's send:
* offered, sent, completed (ended normally before the cut-off), errors (an
  exception or an abort finish before the cut-off), unfinished, unsent,
  short (completed with fewer tokens than asked);
* goodput_tok_s: completed requests' generated tokens / window, the window
  running from the first send to the last request's end, or to the cut-off
  when any request was cut; generated_tok_s: every token streamed inside the
  window, cut requests' included, / window; offered_tok_s: the trace's
  generated tokens / --duration (what the clients ask for);
* TTFT p50/p99 (s): first chunk - send, over every sent request; one without
  a first token at the cut-off counts as (cut-off - send), so with
  `ttft_censored` > 0 the percentiles are lower bounds;
* TPOT p50/p99 (ms): per request, (last chunk - first chunk) / (tokens - first
  chunk's tokens), the token-weighted mean of its chunk gaps after the first
  token (as SGLang's bench_serving defines TPOT), over every request with two
  chunks or more before the cut-off (cut ones included: they are the slow
  tail); then the percentiles over requests;
* percentiles are nearest-rank: the ceil(q n)-th smallest value;
* queued: requests whose scheduler queue time (meta_info.queue_time, wait
  queue entry to first forward) exceeded --queued-threshold s, plus requests
  still without a first token at the cut-off; queue_time p50/p99; the
  scheduler's waiting and running requests and token usage, sampled every
  0.5 s from its load snapshot (tokenizer_manager.get_loads(), inside the
  engine's loop): max and mean;
* retracted: requests SGLang retracted (meta_info.num_retractions > 0) and
  their retractions, and the delta of sglang:num_retracted_requests_total
  over the rate (its Prometheus counter) as a cross-check; tokens_went_back:
  requests whose streamed completion_tokens ever decreased;
* per policy of the trace: requests, completed, TPOT p50; for kvsieve also
  the policy kv_usage reports and mean evicted tokens (`usage_mismatch`
  counts requests whose kv_usage names another policy or none);
* for kvsieve, `steps`: the rate's forwards from its step log
  (radix_ext/step_log.summarize) and their `time_budget`
  (bench/capture_churn.py: the decode seconds as steady steps plus the
  slow steps' excess by cause: captures, eager steps, host spikes).

Results (--out): written after every rate; a later run with other --engines
or --rates adds to the same file and records its command in `commands`, and
refuses a file whose trace or settings differ (`comparable`).

Engines: `vanilla`, `kvsieve`, `kvsieve-nofold` (kvsieve with
KVSIEVE_FOLD_POOL_ROWS=0: `full` rows on SGLang's backend, an A/B of
folding them into kvsieve's pass; its step log is `...-nofold-steps.jsonl`)
and `kvsieve-noeagerdefer` (KVSIEVE_EAGER_DEFER=0: steps of new shapes run
their groups inside each layer, an A/B of deferring them).

Device profile (one 10-minute device call per engine, about 4-6 minutes each
with the engine start): the full trace scaled by 1/4, generation lengths 128
to 4096 instead of 512 to 16K, budget 256, --kv-tokens 196608 (the KV
memory scaled with the lengths), prompts unchanged, 30 s of arrivals per
rate, each rate cut at 75 s; each command after gpu_smoke.py's set-up (its
docstring: the device script and the project's wheel on PYTHONPATH):

    P="--rates 1,2,4 --duration 30 --gen-min 128 --gen-max 4096 --budget 256 --kv-tokens 196608 --rate-timeout 75 --deadline 480"
    python3 bench/traffic.py --engines vanilla $P --out $OUT/traffic.json --commit SHA
    # then, the first call's JSON copied to bench/results/traffic.json in the tree:
    cp bench/results/traffic.json $OUT/traffic.json && python3 bench/traffic.py --engines kvsieve $P --out $OUT/traffic.json --commit SHA

The full trace (512-16K tokens: a 16K generation alone takes 2-4 minutes at
8-15 ms per token) at rates 1, 2, 4 and 60 s of arrivals needs about 6 to 10
minutes per rate and engine: run it where calls are not capped, or one rate
per call. On this machine's CPU, the same logic end to end on
tests/tiny_models.py's Llama in about two minutes:

    python bench/traffic.py --quick --out /tmp/traffic-cpu.json
    # = --device cpu --model tiny --rates 2,4 --duration 3 --gen-min 8 --gen-max 32 --prompt-min 16
    #   --prompt-max 48 --prefix-tokens 16 --private-min 4 --budget 12 --kv-tokens 8192 --warmup-tokens 8 --rate-timeout 120
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import os
import random
import shlex
import signal
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
from gpu_headline import POOL_SHARE, STREAM_INTERVAL  # noqa: E402  (the headline's split and stream interval)
from gpu_smoke import (  # noqa: E402
    HEADLINE_KV_TOKENS, commit_of, device_name, flush_cache, memory_split, model_dir, model_shape, policy_specs)

DEFAULT_MIX = "streaming,h2o,rkv,skipkv,thinkv,crystal_kv,longflow,crystalcache,snapkv,full"
ENGINES = ("vanilla", "kvsieve", "kvsieve-nofold", "kvsieve-noeagerdefer")
#: kvsieve variants: the same engine with these settings (an A/B in one call).
#: kvsieve-nofold: `full` rows beside compressed ones run SGLang's backend
#: (radix_ext/forward_graphs.folds_pool_rows).
#: kvsieve-noeagerdefer: steps of new shapes keep their groups inside the
#: layers (region_graphs.eager_defer_enabled).
VARIANT_ENV = {"kvsieve": {"KVSIEVE_FOLD_POOL_ROWS": "1", "KVSIEVE_EAGER_DEFER": "1"},
               "kvsieve-nofold": {"KVSIEVE_FOLD_POOL_ROWS": "0", "KVSIEVE_EAGER_DEFER": "1"},
               "kvsieve-noeagerdefer": {"KVSIEVE_FOLD_POOL_ROWS": "1", "KVSIEVE_EAGER_DEFER": "0"}}


def is_kvsieve(name: str) -> bool:
    return name in VARIANT_ENV
MAX_MESSAGES = 5  # error messages kept per rate
LOAD_SAMPLE_S = 0.5
# Options that may differ between runs merged into one file (the rest must match).
RUN_ONLY = ("engines", "rates", "deadline", "out", "commit", "quick", "baseline")


# ----- options -----

def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="Replay one arrival trace against vanilla SGLang and kvsieve "
                                             "(see the docstring).")
    ap.add_argument("--out", default=str(REPO / "bench/results/traffic.json"))
    ap.add_argument("--engines", default="vanilla,kvsieve", help="which engines run, in this order")
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default cuda (cpu with --quick)")
    ap.add_argument("--model", default=None, help="checkpoint dir (dummy weights); 'tiny': tests/tiny_models.py's "
                                                   "Llama; default bench/models/r1-distill-qwen-7b")
    ap.add_argument("--rates", default=None, help="arrival rates, requests/s (default 1,2,4)")
    ap.add_argument("--duration", type=float, default=None, help="seconds of arrivals per rate (default 60)")
    ap.add_argument("--gen-min", type=int, default=None, help="shortest generation (default 512)")
    ap.add_argument("--gen-max", type=int, default=None, help="longest generation (default 16384)")
    ap.add_argument("--prompt-min", type=int, default=None, help="shortest prompt (default 64)")
    ap.add_argument("--prompt-max", type=int, default=None, help="longest prompt (default 2048)")
    ap.add_argument("--prefixes", type=int, default=4, help="shared prefixes (system prompts)")
    ap.add_argument("--prefix-tokens", type=int, default=None, help="length of each shared prefix (default 512)")
    ap.add_argument("--private-min", type=int, default=None, help="private ids after the prefix, at least (default 16)")
    ap.add_argument("--mix", default=DEFAULT_MIX, help="policy mix, name[:weight],... (weight 1 when left out)")
    ap.add_argument("--budget", type=int, default=None, help="kv_policy.budget (default 1024)")
    ap.add_argument("--kv-tokens", type=int, default=None, help=f"KV memory of each engine in tokens "
                                                                f"(default {HEADLINE_KV_TOKENS})")
    ap.add_argument("--pool-share", type=float, default=POOL_SHARE, help="of --kv-tokens to kvsieve's token pool")
    ap.add_argument("--max-running", type=int, default=1024, help="max_running_requests of both engines")
    ap.add_argument("--mem-fraction-static", type=float, default=0.85)
    ap.add_argument("--cuda-graph-max-bs", type=int, default=128, help="cuda_graph_max_bs_decode of both engines")
    ap.add_argument("--engine-args", default="{}", help="JSON of further sglang.Engine options for both engines")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--warmup-tokens", type=int, default=None, help="tokens of each warm-up request (default "
                                                                    "budget + 32; 0: no warm-up)")
    ap.add_argument("--warmup-timeout", type=float, default=180.0,
                    help="seconds the warm-up may take (its first compiles: ~90 s on a cold GPU), apart from "
                         "--rate-timeout")
    ap.add_argument("--rate-timeout", type=float, default=None,
                    help="seconds after a rate's start when what is left is aborted (default 1800; 120 on cpu)")
    ap.add_argument("--deadline", type=float, default=0.0,
                    help="seconds from start after which no rate starts and running ones are cut (0: none)")
    ap.add_argument("--queued-threshold", type=float, default=1.0,
                    help="a request whose scheduler queue time exceeds this (s) counts as queued")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--commit", default=None, help="the commit the wheel was built from (wins over git)")
    ap.add_argument("--baseline", default=None,
                    help="an earlier result of the same trace and settings: its engines that this call does not "
                         "run are copied in (vanilla's run, kept beside each kvsieve build's)")
    ap.add_argument("--quick", action="store_true", help="small CPU defaults (see the docstring); explicit "
                                                         "options win")
    args = ap.parse_args(argv)
    quick = args.quick
    defaults = {  # (GPU, --quick)
        "device": ("cuda", "cpu"), "model": (str(REPO / "bench/models/r1-distill-qwen-7b"), "tiny"),
        "rates": ("1,2,4", "2,4"), "duration": (60.0, 3.0), "gen_min": (512, 8), "gen_max": (16384, 32),
        "prompt_min": (64, 16), "prompt_max": (2048, 48), "prefix_tokens": (512, 16), "private_min": (16, 4),
        "budget": (1024, 12), "kv_tokens": (HEADLINE_KV_TOKENS, 8192),
    }
    for key, pair in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, pair[1] if quick else pair[0])
    if args.warmup_tokens is None:
        args.warmup_tokens = 8 if quick else args.budget + 32
    if args.rate_timeout is None:
        args.rate_timeout = 120.0 if args.device == "cpu" else 1800.0
    args.rates = [float(r) for r in str(args.rates).split(",")]
    args.engines = args.engines.split(",")
    args.mix = parse_mix(args.mix)
    args.engine_args = json.loads(args.engine_args)
    bad = sorted(set(args.engines) - set(ENGINES))
    if bad or not args.engines:
        ap.error(f"--engines: unknown {bad}; choose from {','.join(ENGINES)}")
    if not 0 < args.gen_min <= args.gen_max or not 0 < args.prompt_min <= args.prompt_max:
        ap.error("lengths: need 0 < min <= max")
    if args.private_min < 1 or args.private_min > args.prompt_min:
        ap.error("--private-min must be between 1 and --prompt-min (every prompt has a private part)")
    if any(r <= 0 for r in args.rates) or args.duration <= 0:
        ap.error("rates and --duration must be positive")
    return args


def parse_mix(text: str) -> dict[str, float]:
    """'a:2,b,c:0.5' -> {'a': 2.0, 'b': 1.0, 'c': 0.5}."""
    mix = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, _, weight = item.partition(":")
        mix[name] = float(weight) if weight else 1.0
        if mix[name] <= 0:
            raise ValueError(f"--mix: weight of {name} must be positive")
    if not mix:
        raise ValueError("--mix is empty")
    return mix


# ----- the trace -----

def make_trace(rates: list[float], duration: float, *, seed: int, gen_min: int, gen_max: int, prompt_min: int,
               prompt_max: int, prefixes: int, prefix_tokens: int, private_min: int, mix: dict[str, float],
               vocab: int) -> dict[float, list[dict]]:
    """Per rate, the requests in arrival order: {id, arrival (s), gen, prefix
    (index), shared (prefix ids used), prompt (ids), policy}. Pure: the same
    arguments give the same trace."""
    lo, hi = min(1000, vocab // 4), min(100000, vocab)  # clear of special ids, inside the vocabulary
    prefix_rng = random.Random(f"{seed}:prefixes")
    shared_ids = [[prefix_rng.randrange(lo, hi) for _ in range(prefix_tokens)] for _ in range(prefixes)]
    names, weights = list(mix), list(mix.values())
    trace = {}
    for rate in rates:
        rng = random.Random(f"{seed}:rate:{rate!r}")  # one stream per rate: adding a rate changes no other
        requests, t = [], rng.expovariate(rate)
        while t < duration:
            gen = round(math.exp(rng.uniform(math.log(gen_min), math.log(gen_max))))
            length = rng.randint(prompt_min, prompt_max)
            prefix = rng.randrange(prefixes) if prefixes else 0
            shared = max(0, min(prefix_tokens, length - private_min)) if prefixes else 0
            prompt = (shared_ids[prefix][:shared] if prefixes else []) + \
                [rng.randrange(lo, hi) for _ in range(length - shared)]
            requests.append({"id": f"{rate:g}-{len(requests)}", "arrival": t, "gen": min(max(gen, gen_min), gen_max),
                             "prefix": prefix, "shared": shared, "prompt": prompt,
                             "policy": rng.choices(names, weights)[0]})
            t += rng.expovariate(rate)
        trace[rate] = requests
    return trace


def trace_hash(requests: list[dict]) -> str:
    digest = hashlib.sha256()
    for r in requests:
        digest.update(json.dumps([round(r["arrival"], 6), r["gen"], r["policy"], r["prompt"]]).encode())
    return digest.hexdigest()[:16]


def trace_summary(requests: list[dict], duration: float) -> dict:
    n = len(requests)
    policies: dict[str, int] = {}
    for r in requests:
        policies[r["policy"]] = policies.get(r["policy"], 0) + 1
    gen = sum(r["gen"] for r in requests)
    return {"requests": n, "last_arrival_s": round(requests[-1]["arrival"], 2) if n else None,
            "mean_gen_tokens": round(gen / n, 1) if n else None, "total_gen_tokens": gen,
            "offered_tok_s": round(gen / duration, 1),
            "mean_prompt_tokens": round(sum(len(r["prompt"]) for r in requests) / n, 1) if n else None,
            "mean_shared_prefix_tokens": round(sum(r["shared"] for r in requests) / n, 1) if n else None,
            "policies": dict(sorted(policies.items())), "hash": trace_hash(requests)}


# ----- statistics -----

def percentile(values: list[float], q: float) -> float | None:
    """Nearest rank: the ceil(q n)-th smallest value."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def rounded(x: float | None, digits: int) -> float | None:
    return None if x is None else round(x, digits)


def request_tpot(chunks: list[tuple[float, int]]) -> float | None:
    """Seconds per token after the first chunk (token-weighted mean gap)."""
    if len(chunks) < 2 or chunks[-1][1] <= chunks[0][1]:
        return None
    return (chunks[-1][0] - chunks[0][0]) / (chunks[-1][1] - chunks[0][1])


def classify(rec: dict, cut: float | None) -> str:
    if rec["sent"] is None:
        return "unsent"
    ended_in_time = rec["end"] is not None and (cut is None or rec["end"] <= cut)
    if not ended_in_time:
        return "unfinished"
    if rec["error"] or rec["aborted"]:
        return "error"
    return "completed"


def summarize(records: list[dict], cut: float | None, duration: float, queued_threshold: float,
              with_usage: bool) -> dict:
    """Per-rate figures from the replay's records (times in s from the rate's start)."""
    status = [classify(r, cut) for r in records]
    sent = [r for r in records if r["sent"] is not None]
    start = min((r["sent"] for r in sent), default=0.0)
    ends = [r["end"] for r, s in zip(records, status) if s in ("completed", "error")]
    end = cut if cut is not None and "unfinished" in status else max(ends, default=start)
    window = max(end - start, 1e-9)
    # Chunks up to the window's end only (an aborted request's last chunk comes after the cut).
    chunks = [[c for c in r["chunks"] if c[0] <= end] for r in records]
    completed = [r for r, s in zip(records, status) if s == "completed"]
    done_tokens = sum(r["tokens"] for r in completed)
    streamed = sum(c[-1][1] for c in chunks if c)
    ttft, censored = [], 0
    for r, c, s in zip(records, chunks, status):
        if c:
            ttft.append(c[0][0] - r["sent"])
        elif s == "unfinished":  # still waiting at the cut-off: at least this long
            censored += 1
            ttft.append(end - r["sent"])
    tpots = [t for t in (request_tpot(c) for c in chunks) if t is not None]
    e2e = [r["end"] - r["sent"] for r in completed]
    queue_times = [r["queue_time"] for r in sent if r["queue_time"] is not None]
    queue_source = "meta_info.queue_time" if queue_times else "ttft (queue_time not reported)"
    waits = queue_times if queue_times else [c[0][0] - r["sent"] for r, c in zip(records, chunks)
                                             if r["sent"] is not None and c]
    queued = sum(1 for w in waits if w > queued_threshold) + censored
    errors = [r["error"] or f"abort: {r['aborted']}" for r, s in zip(records, status) if s == "error"]
    out = {
        "offered": len(records), "sent": len(sent), "completed": len(completed), "errors": len(errors),
        "unfinished": status.count("unfinished"), "unsent": status.count("unsent"),
        "short": sum(1 for r in completed if r["tokens"] < r["gen"]),
        "cut_off": cut is not None, "window_s": round(window, 2), "completed_tokens": done_tokens,
        "goodput_tok_s": round(done_tokens / window, 1), "generated_tokens": streamed,
        "generated_tok_s": round(streamed / window, 1),
        "offered_tok_s": round(sum(r["gen"] for r in records) / duration, 1),
        "ttft_p50_s": rounded(percentile(ttft, 0.5), 3), "ttft_p99_s": rounded(percentile(ttft, 0.99), 3),
        "ttft_censored": censored,
        "tpot_p50_ms": rounded(1000 * percentile(tpots, 0.5), 2) if tpots else None,
        "tpot_p99_ms": rounded(1000 * percentile(tpots, 0.99), 2) if tpots else None,
        "tpot_requests": len(tpots),
        "e2e_p50_s": rounded(percentile(e2e, 0.5), 2), "e2e_p99_s": rounded(percentile(e2e, 0.99), 2),
        "queued": queued, "queued_source": queue_source,
        "queue_time_p50_s": rounded(percentile(queue_times, 0.5), 3),
        "queue_time_p99_s": rounded(percentile(queue_times, 0.99), 3),
        "retracted_requests": sum(1 for r in records if r["retractions"] > 0),
        "retractions": sum(r["retractions"] for r in records),
        "tokens_went_back": sum(1 for r in records if r["went_back"]),
        "error_messages": errors[:MAX_MESSAGES],
        "per_policy": per_policy(records, status, chunks, with_usage),
    }
    return out


def per_policy(records: list[dict], status: list[str], chunks: list, with_usage: bool) -> dict:
    groups: dict[str, dict] = {}
    for r, s, c in zip(records, status, chunks):
        g = groups.setdefault(r["policy"], {"requests": 0, "completed": 0, "tpots": [], "evicted": [],
                                            "usage_policies": {}, "usage_mismatch": 0})
        g["requests"] += 1
        g["completed"] += s == "completed"
        tpot = request_tpot(c)
        if tpot is not None:
            g["tpots"].append(tpot)
        if with_usage and s == "completed":
            name = (r["usage"] or {}).get("policy")
            g["usage_policies"][str(name)] = g["usage_policies"].get(str(name), 0) + 1
            g["usage_mismatch"] += name != r["policy"]
            if r["usage"]:
                g["evicted"].append(r["usage"].get("evicted_tokens", 0))
    out = {}
    for name, g in sorted(groups.items()):
        entry = {"requests": g["requests"], "completed": g["completed"],
                 "tpot_p50_ms": rounded(1000 * percentile(g["tpots"], 0.5), 2) if g["tpots"] else None}
        if with_usage:
            entry.update(usage_policies=g["usage_policies"], usage_mismatch=g["usage_mismatch"],
                         evicted_tokens_mean=rounded(sum(g["evicted"]) / len(g["evicted"]), 1) if g["evicted"] else None)
        out[name] = entry
    return out


# ----- the replay -----

def new_record(req: dict) -> dict:
    return {"id": req["id"], "policy": req["policy"], "gen": req["gen"], "sent": None, "end": None, "chunks": [],
            "tokens": 0, "error": None, "aborted": None, "queue_time": None, "retractions": 0, "went_back": False,
            "usage": None}


def observe(rec: dict, now: float, meta: dict) -> None:
    """One streamed chunk into the request's record."""
    from kvsieve.radix_ext.usage import last_kv_usage

    tokens = int(meta.get("completion_tokens") or 0)
    rec["went_back"] |= tokens < rec["tokens"]
    rec["tokens"] = tokens
    rec["chunks"].append((now, tokens))
    rec["retractions"] = max(rec["retractions"], int(meta.get("num_retractions") or 0))
    if rec["queue_time"] is None and meta.get("queue_time") is not None:
        rec["queue_time"] = float(meta["queue_time"])
    rec["usage"] = last_kv_usage(meta) or rec["usage"]
    reason = meta.get("finish_reason")
    if isinstance(reason, dict) and reason.get("type") == "abort":
        rec["aborted"] = str(reason.get("message"))[:300]


async def send_one(engine, req: dict, rec: dict, params: dict, t0: float, state: dict) -> None:
    delay = t0 + req["arrival"] - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    if state["closed"]:
        return
    rec["sent"] = time.perf_counter() - t0
    try:
        stream = await engine.async_generate(input_ids=req["prompt"], sampling_params=params, stream=True)
        async for chunk in stream:
            observe(rec, time.perf_counter() - t0, chunk.get("meta_info", {}))
    except Exception as exc:  # noqa: BLE001 - a refused or failed request is a result, not a crash
        rec["error"] = f"{req['policy']}: {type(exc).__name__}: {exc}"[:400]
    rec["end"] = time.perf_counter() - t0


async def sample_load(engine, stop: asyncio.Event, samples: list, errors: list) -> None:
    """The scheduler's load snapshot (shared memory, no round trip) every LOAD_SAMPLE_S."""
    while not stop.is_set():
        try:
            for snap in await engine.tokenizer_manager.get_loads():
                samples.append((snap.num_waiting_reqs, snap.num_running_reqs, snap.token_usage))
        except Exception as exc:  # noqa: BLE001
            if not errors:
                errors.append(f"{type(exc).__name__}: {exc}"[:200])
        try:
            await asyncio.wait_for(stop.wait(), LOAD_SAMPLE_S)
        except asyncio.TimeoutError:
            pass


def load_figures(samples: list, errors: list) -> dict:
    if not samples:
        return {"load_samples": 0, "load_error": errors[0] if errors else "no snapshot"}
    waiting, running, usage = zip(*samples)
    return {"load_samples": len(samples), "queue_depth_max": max(waiting),
            "queue_depth_mean": round(sum(waiting) / len(waiting), 1), "running_max": max(running),
            "running_mean": round(sum(running) / len(running), 1), "token_usage_max": round(max(usage), 3)}


async def replay(engine, requests: list[dict], params_of, timeout: float) -> tuple[list[dict], float | None, dict]:
    """Sends every request at its arrival time; past `timeout` drops the
    unsent and aborts the rest. Returns the records, the cut-off (s from the
    start, None when everything ended) and the load figures."""
    t0 = time.perf_counter()
    state = {"closed": False}
    records = [new_record(r) for r in requests]
    stop, samples, load_errors = asyncio.Event(), [], []
    sampler = asyncio.create_task(sample_load(engine, stop, samples, load_errors))
    tasks = [asyncio.create_task(send_one(engine, r, rec, params_of(r), t0, state))
             for r, rec in zip(requests, records)]
    cut = None
    _, pending = await asyncio.wait(tasks, timeout=timeout) if tasks else (set(), set())
    if pending:
        cut = time.perf_counter() - t0
        state["closed"] = True  # sleepers wake to nothing
        for task, rec in zip(tasks, records):
            if rec["sent"] is None:
                task.cancel()
        engine.tokenizer_manager.abort_request(abort_all=True)
        _, pending = await asyncio.wait(pending, timeout=30)
        for task in pending:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    stop.set()
    await sampler
    return records, cut, load_figures(samples, load_errors)


def sampling_params(req: dict, engine_name: str, specs: dict, temperature: float) -> dict:
    params = {"max_new_tokens": req["gen"], "temperature": temperature, "ignore_eos": True,
              "stream_interval": STREAM_INTERVAL}
    if is_kvsieve(engine_name):
        params["custom_params"] = {"kv_policy": specs[req["policy"]]["kv_policy"]}
    return params


# ----- metrics and engine plumbing -----

def retraction_counter() -> float | None:
    """sglang:num_retracted_requests_total, summed over the engine's processes."""
    try:
        from prometheus_client import CollectorRegistry, multiprocess

        reg = CollectorRegistry()
        multiprocess.MultiProcessCollector(reg)
        return sum(s.value for m in reg.collect() for s in m.samples
                   if s.name == "sglang:num_retracted_requests_total")
    except Exception:  # noqa: BLE001
        return None


def forget_metrics() -> int:
    """Unregister the previous engine's SGLang collectors from this process's
    Prometheus registry (with enable_metrics a second engine would otherwise
    fail to start on a duplicated series); its samples stay in the
    multiprocess files."""
    try:
        from prometheus_client import REGISTRY
    except ImportError:
        return 0
    stale = [c for c, names in list(REGISTRY._collector_to_names.items())
             if any(n.startswith("sglang:") for n in names)]
    for collector in stale:
        REGISTRY.unregister(collector)
    return len(stale)


def engine_kwargs(name: str, args, model: Path, split: dict) -> dict:
    kwargs = dict(model_path=str(model), load_format="dummy", skip_tokenizer_init=True, sampling_backend="pytorch",
                  log_level="warning", mem_fraction_static=args.mem_fraction_static, stream_interval=STREAM_INTERVAL,
                  max_running_requests=args.max_running, random_seed=args.seed, enable_metrics=True)
    if args.device == "cuda":
        kwargs.update(cuda_graph_max_bs_decode=args.cuda_graph_max_bs)
    else:
        kwargs.update(device="cpu", disable_cuda_graph=True)
    if name == "vanilla":
        kwargs.update(attention_backend="triton" if args.device == "cuda" else "torch_native",
                      max_total_tokens=args.kv_tokens)
    else:
        kwargs.update(attention_backend="kvsieve", max_total_tokens=split["pool_tokens"])
    kwargs.update(args.engine_args)
    return kwargs


def step_log_path(args, name: str = "kvsieve") -> str:
    """A kvsieve engine's per-forward log (radix_ext/step_log.py), beside the JSON."""
    suffix = "-" + name.split("-", 1)[1] if is_kvsieve(name) and name != "kvsieve" else ""
    return str(Path(args.out).with_suffix("")) + f"{suffix}-steps.jsonl"


def set_region_env(name: str, split: dict, step_log: str | None = None) -> dict:
    """kvsieve's region pages as the headline sets them, and its step log;
    none for vanilla."""
    variants = sorted({k for env in VARIANT_ENV.values() for k in env})
    keys = ("KVSIEVE_REGION_PAGES", "KVSIEVE_REGION_QUANT_PAGES", "KVSIEVE_STEP_LOG", *variants)
    if is_kvsieve(name):
        os.environ.update(VARIANT_ENV[name])
        os.environ["KVSIEVE_REGION_PAGES"] = str(split["region_pages"])
        os.environ["KVSIEVE_REGION_QUANT_PAGES"] = str(split["quantized_pages"])
        if step_log:
            Path(step_log).unlink(missing_ok=True)
            os.environ["KVSIEVE_STEP_LOG"] = step_log
        return {k: os.environ[k] for k in keys if k in os.environ}
    for k in keys:
        os.environ.pop(k, None)
    return {}


def engine_info(engine) -> dict:
    """Rows and pool the scheduler settled on (inside the engine's loop: a
    call from outside would make a second loop)."""
    try:
        states = engine.loop.run_until_complete(asyncio.wait_for(engine.tokenizer_manager.get_internal_state(), 60))
        state = states[0] if states else {}
        return {"max_running_requests": state.get("effective_max_running_requests_per_dp")
                or state.get("max_running_requests"),
                "max_total_num_tokens": engine._scheduler_init_result.scheduler_infos[0].get("max_total_num_tokens")}
    except Exception as exc:  # noqa: BLE001
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}


def install_death_handler(engine, on_death) -> None:
    """SGLang's children SIGQUIT this process when they fail; record it first."""
    async def install() -> None:
        engine.tokenizer_manager.auto_create_handle_loop()  # SGLang puts its own handler on this loop
        asyncio.get_running_loop().add_signal_handler(signal.SIGQUIT, on_death)

    engine.loop.run_until_complete(install())


def warm_up(engine, args, specs: dict, vocab: int, engine_name: str) -> dict:
    """One short request per policy of the mix, unmeasured: first-use
    compilation stays out of the first rate."""
    if args.warmup_tokens <= 0:
        return {"requests": 0, "seconds": 0.0, "failed": []}
    rng = random.Random(f"{args.seed}:warmup")
    lo, hi = min(1000, vocab // 4), min(100000, vocab)
    reqs = [{"id": f"warmup-{name}", "arrival": 0.0, "gen": args.warmup_tokens, "policy": name,
             "prompt": [rng.randrange(lo, hi) for _ in range(args.prompt_min)]} for name in args.mix]
    started = time.perf_counter()
    records, cut, _ = engine.loop.run_until_complete(replay(
        engine, reqs, lambda r: sampling_params(r, engine_name, specs, args.temperature), args.warmup_timeout))
    failed = [r["error"] or r["aborted"] for r in records if r["error"] or r["aborted"]]
    return {"requests": len(reqs), "tokens": args.warmup_tokens, "seconds": round(time.perf_counter() - started, 1),
            "failed": failed[:MAX_MESSAGES], "cut_off": cut is not None}


# ----- results file -----

def comparable(cfg: dict) -> dict:
    """The settings two merged parts must share (as JSON reads them back)."""
    return json.loads(json.dumps({k: v for k, v in cfg.items() if k not in RUN_ONLY}))


def load_previous(path: Path, cfg: dict, trace: dict) -> dict | None:
    """An earlier part of the same run, or None; a file of another run is refused."""
    if not path.exists():
        return None
    previous = json.loads(path.read_text())
    if previous.get("kind") != "traffic":
        raise SystemExit(f"{path} is not a traffic result; pass another --out")
    before, now = previous.get("comparable") or {}, comparable(cfg)
    differ = sorted(k for k in set(before) | set(now) if before.get(k) != now.get(k))
    if differ:
        raise SystemExit(f"{path} holds a run with other settings: "
                         + ", ".join(f"{k} {before.get(k)!r} (now {now.get(k)!r})" for k in differ)
                         + "; pass another --out or remove it")
    for rate, summary in trace.items():
        old = previous.get("trace", {}).get(rate)
        if old and old["hash"] != summary["hash"]:
            raise SystemExit(f"{path}: rate {rate} was another trace (hash {old['hash']} != {summary['hash']})")
    return previous


def load_baseline(path: Path, cfg: dict, trace: dict, split: dict, running: list) -> tuple[dict, dict]:
    """--baseline: the engines of an earlier result of the same settings and
    trace (load_previous' checks, and the same KV split) that this call does
    not run, and the record of where they came from."""
    if not path.exists():
        raise SystemExit(f"--baseline {path}: no such file")
    base = load_previous(path, cfg, trace)
    if base.get("memory_split") != split:
        raise SystemExit(f"--baseline {path}: another KV split ({base.get('memory_split')} != {split})")
    missing = sorted(rate for rate in trace if rate not in base.get("trace", {}))
    if missing:
        raise SystemExit(f"--baseline {path}: no run of rate(s) {', '.join(missing)}")
    engines = {name: runs for name, runs in base.get("engines", {}).items() if name not in running}
    return engines, {"engines": sorted(engines), "file": str(path), "commit": base.get("commit"),
                     "date": base.get("date"), "device": base.get("device")}


def rate_key(rate: float) -> str:
    return f"{rate:g}"


# ----- main -----

def main(argv: list[str]) -> int:
    t0 = time.monotonic()
    args = parse_args(argv)
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)

    from kvsieve.service.engine import prepare_process_environment

    prepare_process_environment(args.device)  # SGLANG_USE_CPU_ENGINE on cpu; prometheus' multiprocess dir
    from kvsieve.policies import policy_names

    unknown = sorted(set(args.mix) - set(policy_names()))
    if unknown:
        raise SystemExit(f"--mix: unknown policies {unknown}; registered: {','.join(policy_names())}")
    model = model_dir(args.model)
    shape = model_shape(model)
    specs = policy_specs(list(args.mix), args.budget)
    split = memory_split(argparse.Namespace(kv_tokens=args.kv_tokens, pool_share=args.pool_share, tbq_share=0.0),
                         shape)
    trace = make_trace(args.rates, args.duration, seed=args.seed, gen_min=args.gen_min, gen_max=args.gen_max,
                       prompt_min=args.prompt_min, prompt_max=args.prompt_max, prefixes=args.prefixes,
                       prefix_tokens=args.prefix_tokens, private_min=args.private_min, mix=args.mix,
                       vocab=shape["vocab"])
    summaries = {rate_key(r): trace_summary(reqs, args.duration) for r, reqs in trace.items()}
    cfg = {k: v for k, v in vars(args).items()}
    cfg["model"] = str(model)
    command = "python3 bench/traffic.py " + shlex.join(argv)
    previous = load_previous(out_path, cfg, summaries)
    baseline, baseline_part = (load_baseline(Path(args.baseline), cfg, summaries, split, list(args.engines))
                               if args.baseline else ({}, None))
    results = {
        "kind": "traffic", **commit_of(args.commit), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": device_name(args.device), "command": command,
        "commands": (previous or {}).get("commands", []) + [command],
        "config": cfg, "comparable": comparable(cfg), "model_shape": shape, "memory_split": split,
        "policies": specs, "trace": {**(previous or {}).get("trace", {}), **summaries},
        "engines": {**baseline, **(previous or {}).get("engines", {})},
    }
    if previous:
        results["earlier_parts"] = previous.get("earlier_parts", []) + [
            {k: previous.get(k) for k in ("date", "device", "command", "commit")}]
    if baseline_part:
        results["earlier_parts"] = results.get("earlier_parts", []) + [baseline_part]

    def save() -> None:
        results["elapsed_s"] = round(time.monotonic() - t0, 1)
        tmp = out_path.with_suffix(out_path.suffix + ".tmp")
        tmp.write_text(json.dumps(results, indent=1))
        tmp.replace(out_path)

    save()
    print(f"traffic: {results['device']}, rates {args.rates}, "
          + ", ".join(f"{k}/s {v['requests']} req" for k, v in summaries.items())
          + f"; KV {args.kv_tokens} tokens, kvsieve split {json.dumps(split)}", flush=True)
    failed = False
    for name in args.engines:
        failed |= not run_engine(name, args, model, shape, split, specs, trace, results, save, t0)
    save()
    print(f"{'FAILED' if failed else 'OK'}: {out_path} in {results['elapsed_s']} s", flush=True)
    return 1 if failed else 0


def time_left(args, t0: float) -> float | None:
    return args.deadline - (time.monotonic() - t0) if args.deadline else None


def run_engine(name, args, model, shape, split, specs, trace, results, save, t0) -> bool:
    """Start one engine, warm it, replay every rate; True when it ran every
    rate without an error."""
    import sglang

    kwargs = engine_kwargs(name, args, model, split)
    entry = results["engines"].setdefault(name, {"rates": {}})
    entry.update(engine_kwargs=kwargs, env=set_region_env(name, split, step_log_path(args, name)), date=results["date"],
                 command=results["command"])
    forget_metrics()
    started = time.monotonic()
    try:
        engine = sglang.Engine(**kwargs)
    except BaseException as exc:  # noqa: BLE001 - recorded, then the next engine
        entry["start_error"] = f"{type(exc).__name__}: {exc}"[:2000]
        save()
        print(f"{name}: the engine did not start: {exc}", flush=True)
        return False
    entry["start_s"] = round(time.monotonic() - started, 1)

    def on_death() -> None:
        entry["engine_died"] = "a child process sent SIGQUIT (it failed)"
        save()
        print(f"FAILED: {name} died (SIGQUIT from a child); JSON written", flush=True)
        from sglang.srt.utils import kill_process_tree

        kill_process_tree(os.getpid(), include_parent=False)
        os._exit(3)

    ok = True
    try:
        install_death_handler(engine, on_death)
        entry["scheduler"] = engine_info(engine)
        entry["warmup"] = warm_up(engine, args, specs, shape["vocab"], name)
        print(f"{name}: up in {entry['start_s']} s, {json.dumps(entry['scheduler'])}, warm-up "
              f"{entry['warmup'].get('seconds')} s"
              + (f"; warm-up failures: {entry['warmup']['failed']}" if entry["warmup"].get("failed") else ""),
              flush=True)
        ok = not entry["warmup"].get("failed")
        save()
        for rate, requests in trace.items():
            ok &= run_rate(engine, name, rate, requests, args, specs, entry, t0)
            save()
    finally:
        try:
            engine.shutdown()
        except Exception as exc:  # noqa: BLE001
            print(f"{name} shutdown: {exc!r}", flush=True)
    return ok


def run_rate(engine, name, rate, requests, args, specs, entry, t0) -> bool:
    key = rate_key(rate)
    left = time_left(args, t0)
    if left is not None and left < 20:
        entry["rates"][key] = {"rate": rate, "skipped": f"past --deadline {args.deadline:.0f} s"}
        print(f"{name:8s} rate {key:>5s}/s: skipped (deadline)", flush=True)
        return True
    timeout = args.rate_timeout if left is None else max(10.0, min(args.rate_timeout, left - 15))
    entry["rates"][key] = {"rate": rate, "status": "running"}
    flushed = flush_cache(engine)  # each rate starts with the same (empty) radix cache
    before = retraction_counter()
    started = time.monotonic()
    wall_start = time.time()
    try:
        records, cut, load = engine.loop.run_until_complete(replay(
            engine, requests, lambda r: sampling_params(r, name, specs, args.temperature), timeout))
        figures = summarize(records, cut, args.duration, args.queued_threshold, with_usage=is_kvsieve(name))
    except Exception as exc:  # noqa: BLE001 - the driver's own failure: recorded, the next rate runs
        entry["rates"][key] = {"rate": rate, "status": "failed", "errors": 1,
                               "error_messages": [f"{type(exc).__name__}: {exc}"[:400]]}
        print(f"{name:8s} rate {key:>5s}/s: FAILED {exc!r}", flush=True)
        return False
    after = retraction_counter()
    figures.update(load)
    figures.update(rate=rate, timeout_s=round(timeout, 1), wall_s=round(time.monotonic() - started, 1),
                   cache_flushed=flushed, status="done", date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                   command=entry["command"],
                   retracted_counter_delta=None if before is None or after is None else after - before)
    log = step_log_path(args, name)
    if is_kvsieve(name) and os.path.exists(log):
        import capture_churn
        from kvsieve.radix_ext import step_log

        ended = time.time()
        rate_lines = [x for x in step_log.read(log) if wall_start <= x["t"] < ended]  # this rate's forwards
        figures["steps"] = step_log.summarize(rate_lines)
        # The rate's decode seconds as steady steps plus the slow steps' excess by cause.
        figures["steps"]["time_budget"] = capture_churn.time_budget(rate_lines)
    entry["rates"][key] = figures
    print(f"{name:8s} rate {key:>5s}/s: {figures['offered']} offered, {figures['completed']} done, "
          f"{figures['unfinished']} unfinished, {figures['unsent']} unsent, {figures['errors']} errors; "
          f"goodput {figures['goodput_tok_s']} tok/s (generated {figures['generated_tok_s']}); "
          f"TTFT p50/p99 {figures['ttft_p50_s']}/{figures['ttft_p99_s']} s; "
          f"TPOT p50/p99 {figures['tpot_p50_ms']}/{figures['tpot_p99_ms']} ms; queued {figures['queued']}, "
          f"retracted {figures['retracted_requests']} ({figures['wall_s']} s)"
          + (f"; first error: {figures['error_messages'][0]}" if figures["error_messages"] else ""), flush=True)
    if "steps" in figures:
        print(f"{name:8s} rate {key:>5s}/s: forwards {json.dumps(figures['steps']['modes'])}; decode "
              f"{json.dumps(figures['steps']['decode_kinds'])}; graphs {json.dumps(figures['steps'].get('graph_counters'))}; "
              f"compiles {json.dumps(figures['steps'].get('compiles'))}",
              flush=True)
    return figures["errors"] == 0  # cut-off requests are a measurement (overload), errors are not


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
