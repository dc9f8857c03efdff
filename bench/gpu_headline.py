"""The end-to-end headline in one device call:

    python bench/gpu_headline.py MODEL_DIR OUT_DIR [--generate 8192,16384,32768] [--budgets 1024,2048]
        [--policies streaming,longflow,h2o,rkv,thinkv,crystal_kv,skipkv,crystalcache]
        [--kv-tokens 786432] [--max-running 512] [--tail 192]
        [--parts machine,vanilla,kvsieve] [--check-prompt 2048] [--policy-params '{"crystal_kv": {...}}']
        [--temperatures 0,0.7] [--tbq 1] [--tp 2] [--mixed streaming,rkv,skipkv]

R1-Distill-Qwen-7B architecture, dummy weights, both engines given the same
KV memory (--kv-tokens tokens of bf16 K and V). Generating G tokens is
timed without generating all of them (a 32K generation would not fit in a
10-minute call), from decode throughput measured in a steady window:

* vanilla SGLang (triton, CUDA graphs): N = kv_tokens // (G + 64) requests
  (all fit at once at the end of their generation) with prompts of G/2
  tokens, decoding --tail tokens. A step's time is linear in the context
  (weights + KV bytes), so the mean step time over a generation from 0 to G
  is the step time at G/2: this window's throughput is the whole
  generation's, at constant concurrency N.
* kvsieve, each policy at budget B: min(fit, --max-running) requests of
  64-token prompts (kept in the radix cache) decoding B + 2*tail tokens; the
  window opens once every request holds B generated tokens (each step then
  evicts: the step cost from there on no longer depends on G), so this is
  the throughput of any generation G >> B, slightly below it in fact (the
  ramp to B is cheaper).
* `full` through the kvsieve engine against vanilla on one workload that
  both pools hold (the SGLang path with the plugin installed).

Each window: from the moment every request has reached its threshold to the
first request's finish; tokens counted from streamed chunks
(stream_interval 8). TPOT p50/p99 from chunk gaps in the window. Peak KV
memory: vanilla N*(G/2 + tail + 64)... reported as the pool's bytes in use
at the end of the window (tokens x bytes/token); kvsieve as the sum of the
requests' retained_kv_bytes (kv_usage) at their end. Roofline per point:
the step's weight GEMMs at the measured bf16 GEMM time for that batch
(28 layers of qkv/o/gate_up/down + lm_head, timed on this GPU) plus the
step's KV bytes at the measured copy bandwidth. Writes
OUT_DIR/gpu-headline.json after every run.

`--tbq 1` gives the region quantized pages (TBQ, docs/design/tbq.md) for
thinkv's default R4E4T2: the same region bytes split into one bf16 page and
the budget's 4-bit pages per (layer, kv head) of each request, so about 3x
more rows fit; run it with `--policies thinkv` (other policies would find
only the few bf16 pages). Without it the region holds bf16 pages only and
thinkv runs without TBQ (its kv_usage says `tbq: false`); pass
`--policy-params '{"thinkv": {"tbq": false}}'` to make that explicit.

`--tp N` runs both engines with N tensor-parallel ranks (SGLang's tp_size)
at the same total KV memory: the token pool holds the same tokens (each
rank its share of the heads) and the region's pages are split over the
ranks (KVSIEVE_REGION_PAGES is per rank). The roofline stays one GPU's.

`--mixed a,b,c` (issue #29: a mixed batch of policies as fast as its
members) adds, at each budget and temperature after the --policies runs, ONE
batch of the same row count with those policies dealt round robin (request
i runs policy i mod P, each with its own --policy-params), measured by the
same two methods (steady window from the moment every request holds the
budget, and the whole run) and recorded in `kvsieve` with policy
`mixed:a+b+c`, `members`, `member_rows`, `member_budgets` and `options`
(how the rows were dealt). A member that refuses the budget runs at the
smallest larger one it accepts (bench/gpu_smoke.py's policy_specs;
crystalcache needs at least 132), and the batch's window then opens at the
largest member budget, every request generating that + 2 * --tail; its row
count is the one that fits at that budget. With `--policies` naming the
members, the JSON holds the mixed entry beside its members' solo entries of
the same call, e.g. one call on an H100 (estimated 6-8 minutes with the
device set-up: the `full` check and four batches of 320 rows x 1,280
tokens; not yet run on a GPU; the wheel and `.whl` carried as for
bench/gpu_smoke.py):

    bash .whl/device-setup.sh && python3 -m pip install -q --no-deps --target /tmp/site2 .gpu/*.whl && PYTHONPATH=/tmp/site2:/tmp/site python3 bench/gpu_headline.py bench/models/r1-distill-qwen-7b $OUT --parts kvsieve --policies streaming,rkv,skipkv --mixed streaming,rkv,skipkv --budgets 1024 --max-running 320 --tail 128

With the defaults, one command runs the whole benchmark (about 25 minutes
on an H100). Under the device tool's 10-minute calls, run it in parts
(`--parts`, `--policies`, `--budgets`) into the same OUT_DIR: each part adds
to the JSON and records its command (`commands`); docs/gpu-kernels.md lists
the parts of the committed run.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import time

LAYERS, KV_HEADS, HEAD_DIM, PAGE = 28, 4, 128, 16
HIDDEN, INTER, VOCAB, Q_HEADS = 3584, 18944, 152064, 28
BYTES_PER_TOKEN = LAYERS * KV_HEADS * HEAD_DIM * 2 * 2  # K and V, bf16
SHORT_PROMPT = 64
STREAM_INTERVAL = 8
CHECK_TAIL = 192  # tokens each request of the `full` check decodes (the same for both engines)
POOL_SHARE = 0.15  # of the KV memory given to kvsieve's token pool (prompts, `full`); the rest is the region


#: The served policies that evict while decoding (snapkv compresses the prompt
#: only: past its budget it never reaches a steady window; `full` is the check).
DECODE_POLICIES = "streaming,longflow,h2o,rkv,thinkv,crystal_kv,skipkv,crystalcache"


def options() -> dict:
    opts = dict(zip(sys.argv[3::2], sys.argv[4::2]))
    ints = lambda key, default: [int(x) for x in opts.get(key, default).split(",")]  # noqa: E731
    return {"generate": ints("--generate", "8192,16384,32768"), "budgets": ints("--budgets", "1024,2048"),
            "policies": opts.get("--policies", DECODE_POLICIES).split(","),
            "kv_tokens": int(opts.get("--kv-tokens", 786432)), "max_running": int(opts.get("--max-running", 512)),
            "tail": int(opts.get("--tail", 192)),
            # {"policy": {param: value}}: options a policy runs with (recorded in each entry)
            "policy_params": json.loads(opts.get("--policy-params", "{}")),
            # kvsieve points at each temperature (0: greedy; SGLang's sampler then skips its vocabulary sort)
            "temperatures": [float(t) for t in opts.get("--temperatures", "0").split(",")],
            "mixed": [p for p in opts.get("--mixed", "").split(",") if p],
            "tbq": opts.get("--tbq", "0") == "1", "tp": int(opts.get("--tp", 1)), "check_prompt": int(opts.get("--check-prompt", 2048)), "parts": opts.get("--parts", "machine,vanilla,kvsieve").split(",")}


VOCAB_IDS = (1000, 100000)  # random prompt ids are drawn here (set from the model's vocab in main)


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(*VOCAB_IDS) for _ in range(length)] for _ in range(n)]


# ----- the machine: copy bandwidth and the weight GEMMs per batch ----------
def machine(batches: list[int], known: dict | None = None) -> dict:
    """The host's copy bandwidth and weight-GEMM time per batch; with `known`
    (an earlier part's result), only the batches it lacks."""
    import torch

    def timed(fn, repeats=10) -> float:
        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        return sorted(times)[len(times) // 2]

    if known:
        copy_gbs = known["copy_gb_s"]
        batches = [m for m in batches if str(m) not in known["weight_gemm_ms"] and m not in known["weight_gemm_ms"]]
    else:
        src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        copy_s = timed(lambda: dst.copy_(src))
        copy_gbs = 2 * src.numel() / copy_s / 1e9
        del src, dst
    # One layer's weights (distinct tensors per layer would exceed nothing but
    # time; one layer's 466 MB already dwarfs the L2, so reuse is fair).
    shapes = [(HIDDEN, HIDDEN + 2 * KV_HEADS * HEAD_DIM), (HIDDEN, HIDDEN), (HIDDEN, 2 * INTER), (INTER, HIDDEN)]
    weights = [torch.randn(k, n, dtype=torch.bfloat16, device="cuda") for k, n in shapes]
    head = torch.randn(HIDDEN, VOCAB, dtype=torch.bfloat16, device="cuda")
    gemm_ms = {}
    for m in batches:
        xs = {k: torch.randn(m, k, dtype=torch.bfloat16, device="cuda") for k in (HIDDEN, INTER)}

        def step():
            for _ in range(LAYERS):
                for w in weights:
                    xs[w.shape[0]] @ w
            xs[HIDDEN] @ head
        gemm_ms[m] = round(1000 * timed(step, repeats=5), 3)
    flops_per_token = 2 * (LAYERS * sum(k * n for k, n in shapes) + HIDDEN * VOCAB)
    if known:
        gemm_ms = {**{str(k): v for k, v in known["weight_gemm_ms"].items()}, **{str(k): v for k, v in gemm_ms.items()}}
    return {"copy_gb_s": round(copy_gbs, 1), "weight_gemm_ms": gemm_ms, "flops_per_token": flops_per_token}


def roofline(mach: dict, batch: int, kv_tokens_read: float) -> dict:
    gemm = mach["weight_gemm_ms"].get(batch) or mach["weight_gemm_ms"].get(str(batch))
    kv_ms = 1000 * kv_tokens_read * BYTES_PER_TOKEN / (mach["copy_gb_s"] * 1e9)
    step_ms = gemm + kv_ms
    return {"step_ms": round(step_ms, 3), "weights_ms": gemm, "kv_ms": round(kv_ms, 3),
            "tokens_per_s": round(1000 * batch / step_ms, 1)}


# ----- one timed workload -------------------------------------------------
async def stream_one(engine, ids, params, record):
    # The record goes in first and grows in place: a run cut by timed_run's
    # timeout still shows what every request had generated.
    entry = {"trace": [], "meta": {}, "done": False}
    record.append(entry)
    async for chunk in await engine.async_generate(input_ids=ids, sampling_params=params, stream=True):
        entry["trace"].append((time.perf_counter(), chunk["meta_info"]["completion_tokens"]))
        entry["meta"] = chunk["meta_info"]
    entry["done"] = True


def tokens_at(trace, t) -> float:
    """Tokens a request had at time t (linear between its chunks)."""
    prev_t, prev_n = None, 0
    for ct, n in trace:
        if ct >= t:
            if prev_t is None:
                return 0.0
            return prev_n + (n - prev_n) * (t - prev_t) / max(ct - prev_t, 1e-9)
        prev_t, prev_n = ct, n
    return float(prev_n)


def window(records, threshold: int) -> dict:
    opens = [next((t for t, n in r["trace"] if n >= threshold), None) for r in records]
    if any(o is None for o in opens):
        return {"error": f"a request never reached {threshold} tokens"}
    start = max(opens)
    end = min(r["trace"][-1][0] for r in records)
    if end <= start:
        return {"error": "no steady window: the first request finished before the last reached its threshold"}
    tokens = sum(tokens_at(r["trace"], end) - tokens_at(r["trace"], start) for r in records)
    gaps = []
    for r in records:
        for (t0, n0), (t1, n1) in zip(r["trace"], r["trace"][1:]):
            if t0 >= start and t1 <= end and n1 > n0:
                gaps.append(1000 * (t1 - t0) / (n1 - n0))
    gaps.sort()
    pick = lambda q: round(gaps[min(len(gaps) - 1, int(q * len(gaps)))], 2) if gaps else None  # noqa: E731
    return {"window_s": round(end - start, 2), "window_tokens": round(tokens), "tokens_per_s": round(tokens / (end - start), 1),
            "tpot_p50_ms": pick(0.5), "tpot_p99_ms": pick(0.99)}


def timed_run(engine, ids, params, threshold: int, timeout: float | None = None) -> dict:
    """params: one sampling-params dict for every request, or a list of one
    per request (a mixed batch). `timeout` (s): past it every request is
    aborted and the entry says `timed_out` with what was generated until then."""
    per_request = params if isinstance(params, list) else [params] * len(ids)
    records: list = []
    started = time.perf_counter()
    runs = asyncio.gather(*(stream_one(engine, i, p, records) for i, p in zip(ids, per_request)))
    if timeout is None:
        engine.loop.run_until_complete(runs)
    else:
        try:
            engine.loop.run_until_complete(asyncio.wait_for(runs, timeout))
        except asyncio.TimeoutError:
            cut = time.perf_counter() - started
            engine.tokenizer_manager.abort_request(abort_all=True)
            tokens = sum(r["trace"][-1][1] for r in records if r["trace"])
            return {"error": f"timed out after {timeout:.0f} s", "timed_out": True, "requests": len(ids),
                    "finished": sum(r["done"] for r in records), "seconds": round(cut, 1),
                    "tokens_at_timeout": tokens, "tokens_per_s_until_timeout": round(tokens / cut, 1),
                    "min_tokens_at_timeout": min((r["trace"][-1][1] if r["trace"] else 0 for r in records), default=0)}
    result = window(records, threshold)
    seconds = time.perf_counter() - started
    # The second method: every request generated to its end, wall clock
    # (prompts, the ramp to the budget and the window together).
    result.update(requests=len(ids), seconds=round(seconds, 1),
                  whole_run_tokens_per_s=round(sum(p["max_new_tokens"] for p in per_request) / seconds, 1))
    usage = [r["meta"].get("kvsieve_kv_usage") for r in records]
    usage = [u[-1] if isinstance(u, list) else u for u in usage]
    usage = [u for u in usage if u]
    if usage:
        result["retained_kv_bytes_sum"] = sum(u.get("retained_kv_bytes", 0) for u in usage)
        result["evicted_tokens_mean"] = round(sum(u.get("evicted_tokens", 0) for u in usage) / len(usage), 1)
        bits = [u["kv_bits_per_element"] for u in usage if u.get("kv_bits_per_element")]
        if bits:
            result["kv_bits_per_element_mean"] = round(sum(bits) / len(bits), 3)
        result["tbq_requests"] = sum(1 for u in usage if u.get("tbq"))
    return result


def params(tokens: int, policy=None, temperature: float = 0.0) -> dict:
    p = {"max_new_tokens": tokens, "temperature": temperature, "ignore_eos": True}
    if policy is not None:
        p["custom_params"] = {"kv_policy": policy}
    return p


def mixed_run(engine, cfg: dict, specs: dict, budget: int, top: int, n: int, temperature: float) -> dict:
    """One batch of n requests, cfg["mixed"]'s policies dealt round robin
    (each with its --policy-params and the budget policy_specs gave it),
    timed as a solo policy is; the window opens at the largest member budget."""
    names = cfg["mixed"]
    policies = {}
    for name in names:
        policies[name] = dict(specs[name]["kv_policy"])
        if cfg["policy_params"].get(name):
            policies[name]["params"] = cfg["policy_params"][name]
    rows = [names[i % len(names)] for i in range(max(n, len(names)))]
    per_request = [params(top + 2 * cfg["tail"], policies[name], temperature) for name in rows]
    entry = timed_run(engine, prompts(len(rows), SHORT_PROMPT, 7), per_request, top)
    entry.update(policy="mixed:" + "+".join(names), budget=budget, members=names,
                 member_rows={m: rows.count(m) for m in names},
                 member_budgets={m: specs[m]["budget"] for m in names},
                 params={m: policies[m]["params"] for m in names if "params" in policies[m]},
                 temperature=temperature, tbq_region=cfg["tbq"], rows=len(rows),
                 options={"dealt": "round robin: request i runs members[i % len(members)]",
                          "window_threshold_tokens": top, "generated_tokens": top + 2 * cfg["tail"]})
    return entry


def main() -> None:
    global VOCAB_IDS
    model, out_dir = sys.argv[1], sys.argv[2]
    cfg = options()
    vocab = json.load(open(os.path.join(model, "config.json")))["vocab_size"]
    VOCAB_IDS = (min(1000, vocab // 4), min(100000, vocab))
    import torch
    if not torch.cuda.is_available():
        os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    import sglang as sgl

    results = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu (smoke run)", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "command": "python bench/gpu_headline.py " + " ".join(sys.argv[1:]), "config": cfg,
               "kv_bytes": cfg["kv_tokens"] * BYTES_PER_TOKEN, "vanilla": [], "kvsieve": [], "full_check": {}}
    os.makedirs(out_dir, exist_ok=True)  # a part's results must not be lost to a missing folder (2026-12-03)
    path = os.path.join(out_dir, "gpu-headline.json")
    if os.path.exists(path):  # a later part of the same round adds to the earlier one
        previous = json.load(open(path))
        for key in ("machine", "vanilla", "kvsieve", "full_check", "full_check_runs"):
            if previous.get(key):
                results[key] = previous[key]
        results["commands"] = previous.get("commands", [previous.get("command")]) + [results["command"]]

    def save():
        with open(path, "w") as f:
            json.dump(results, f, indent=1)

    pool_tokens = int(cfg["kv_tokens"] * POOL_SHARE)
    vanilla_n = {g: min(cfg["max_running"], cfg["kv_tokens"] // (g + SHORT_PROMPT)) for g in cfg["generate"]}
    region_tokens = cfg["kv_tokens"] - pool_tokens
    mixed_specs = {}
    if cfg["mixed"]:
        # Per budget, each member's kv_policy with the budget it accepts (crystalcache: >= 132).
        from gpu_smoke import policy_specs

        mixed_specs = {b: policy_specs(cfg["mixed"], b) for b in cfg["budgets"]}
        bad = {n: s["invalid"] for specs in mixed_specs.values() for n, s in specs.items() if "invalid" in s}
        if bad:
            raise SystemExit(f"--mixed: no budget accepted by {bad}")
    # The budget a batch's rows are sized for: a mixed batch's largest member budget.
    top_budget = {b: max([b] + [s["budget"] or b for s in mixed_specs.get(b, {}).values()]) for b in cfg["budgets"]}
    kvsieve_n = {b: min(cfg["max_running"], region_tokens // (-(-(b + STREAM_INTERVAL + 1) // PAGE) * PAGE)
                        // 1) for b in sorted(set(cfg["budgets"]) | set(top_budget.values()))}
    if cfg["tbq"]:
        # One bf16 page (the group being filled) and the ceiling in 4-bit pages per (layer, kv head) and row.
        from kvsieve.radix_ext.tbq_store import QuantPool

        full_page, quant_page = PAGE * HEAD_DIM * 2 * 2, QuantPool.bytes_per_page(HEAD_DIM, PAGE, 4)
        region_bytes = region_tokens * BYTES_PER_TOKEN
        row_bytes = {b: LAYERS * KV_HEADS * (full_page + -(-(b + STREAM_INTERVAL + 1) // PAGE) * quant_page)
                     for b in kvsieve_n}
        kvsieve_n = {b: min(cfg["max_running"], region_bytes // row_bytes[b]) for b in kvsieve_n}
        tbq_full_pages = max(kvsieve_n.values()) * LAYERS * KV_HEADS
        tbq_quant_pages = (region_bytes - tbq_full_pages * full_page) // quant_page
    # A check workload both pools hold: prompts of 2K, the pool's share.
    check_prompt = cfg["check_prompt"]
    check_n = min(64, cfg["max_running"], pool_tokens // (check_prompt + 2 * CHECK_TAIL))

    if "machine" in cfg["parts"] and torch.cuda.is_available():
        results["machine"] = machine(sorted(set(vanilla_n.values()) | set(kvsieve_n.values()) | {check_n}))
        print("machine", json.dumps(results["machine"]), flush=True)
        save()
        torch.cuda.empty_cache()

    common = dict(model_path=model, load_format="dummy", skip_tokenizer_init=True, sampling_backend="pytorch",
                  log_level="warning", mem_fraction_static=0.85, stream_interval=STREAM_INTERVAL,
                  tp_size=cfg["tp"])
    vanilla_backend = "triton"
    graphs = dict(cuda_graph_max_bs_decode=128)  # vanilla batches and the `full` check stay below 128
    if not torch.cuda.is_available():  # a CPU smoke run of this script's logic on a tiny model
        vanilla_backend, graphs = "torch_native", dict(device="cpu", disable_cuda_graph=True)
    if "vanilla" in cfg["parts"]:
        started = time.perf_counter()
        engine = sgl.Engine(attention_backend=vanilla_backend, max_total_tokens=cfg["kv_tokens"],
                            max_running_requests=cfg["max_running"], **graphs, **common)
        results["vanilla_start_s"] = round(time.perf_counter() - started, 1)
        try:
            entry = timed_run(engine, prompts(check_n, check_prompt, 1), params(CHECK_TAIL), 1)
            results["full_check"]["vanilla"] = entry
            print("check vanilla", json.dumps(entry), flush=True)
            for g in cfg["generate"]:
                n = vanilla_n[g]
                entry = timed_run(engine, prompts(n, g // 2, g), params(cfg["tail"]), 1)
                entry.update(generate=g, context_at_window=g // 2, kv_in_use_bytes=n * (g // 2 + cfg["tail"]) * BYTES_PER_TOKEN)
                if results.get("machine"):
                    entry["roofline"] = roofline(results["machine"], n, n * (g // 2 + cfg["tail"] // 2))
                results["vanilla"].append(entry)
                print("vanilla", json.dumps(entry), flush=True)
                save()
                engine.flush_cache()
        finally:
            engine.shutdown()
        save()

    if "kvsieve" in cfg["parts"] and results.get("machine") and torch.cuda.is_available():
        results["machine"] = machine(sorted(set(kvsieve_n.values())), known=results["machine"])
        save()
        torch.cuda.empty_cache()
    if "kvsieve" in cfg["parts"]:
        region_pages = region_tokens * LAYERS * KV_HEADS // PAGE
        quant_pages = 0
        if cfg["tbq"]:
            region_pages, quant_pages = tbq_full_pages, tbq_quant_pages
        # Per rank: each holds its share of the kv heads' pages.
        os.environ["KVSIEVE_REGION_PAGES"] = str(region_pages // cfg["tp"])
        os.environ["KVSIEVE_REGION_QUANT_PAGES"] = str(quant_pages // cfg["tp"])
        results["kvsieve_memory"] = {"pool_tokens": pool_tokens, "region_pages": region_pages, "page_size": PAGE,
                                     "quantized_pages": quant_pages}
        started = time.perf_counter()
        engine = sgl.Engine(attention_backend="kvsieve", max_total_tokens=pool_tokens,
                            max_running_requests=cfg["max_running"], **graphs, **common)
        results["kvsieve_start_s"] = round(time.perf_counter() - started, 1)
        try:
            entry = timed_run(engine, prompts(check_n, check_prompt, 1), params(CHECK_TAIL, "full"), 1)
            results["full_check"]["kvsieve_full"] = entry
            if "vanilla" in results["full_check"] and "tokens_per_s" in entry:
                entry["vs_vanilla"] = round(entry["tokens_per_s"] / results["full_check"]["vanilla"]["tokens_per_s"], 3)
            # Every round's check is kept: one 2-second window is noisy.
            results.setdefault("full_check_runs", []).append({**entry, "date": results["date"]})
            print("check full", json.dumps(entry), flush=True)
            save()
            for budget in cfg["budgets"]:
                n = kvsieve_n[budget]
                for name, temperature in [(p, t) for p in cfg["policies"] for t in cfg["temperatures"]]:
                    policy = {"name": name, "budget": budget}
                    if cfg["policy_params"].get(name):
                        policy["params"] = cfg["policy_params"][name]
                    entry = timed_run(engine, prompts(n, SHORT_PROMPT, 7),
                                      params(budget + 2 * cfg["tail"], policy, temperature), budget)
                    entry.update(policy=name, budget=budget, params=policy.get("params", {}), temperature=temperature,
                                 tbq_region=cfg["tbq"], rows=n)
                    if results.get("machine"):
                        entry["roofline"] = roofline(results["machine"], n, n * (budget + SHORT_PROMPT))
                    results["kvsieve"].append(entry)
                    print("kvsieve", json.dumps(entry), flush=True)
                    save()
                    engine.flush_cache()
                for temperature in (cfg["temperatures"] if cfg["mixed"] else []):
                    entry = mixed_run(engine, cfg, mixed_specs[budget], budget, top_budget[budget],
                                      kvsieve_n[top_budget[budget]], temperature)
                    if results.get("machine") and entry["rows"] == kvsieve_n[top_budget[budget]]:
                        entry["roofline"] = roofline(results["machine"], entry["rows"],
                                                     entry["rows"] * (top_budget[budget] + SHORT_PROMPT))
                    results["kvsieve"].append(entry)
                    print("kvsieve", json.dumps(entry), flush=True)
                    save()
                    engine.flush_cache()
        finally:
            engine.shutdown()
    save()


if __name__ == "__main__":
    main()
