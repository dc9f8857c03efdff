"""Mixed-batch equality at scale: every row of one batch that mixes every
registered policy against the same row run with its own policy alone
(issue #29, item 5).

One device call on an H100 (planned to end inside 9 minutes with the device
set-up, the cold engine start and graph capture: --deadline 450 s as in
bench/gpu_smoke.py; not yet run on a GPU, so the time is an estimate: about
2 minutes of engine start and 32 workloads of a few seconds each). Build the
wheel first, `pip wheel --no-deps . -w .gpu/`, and carry `.whl` and `.gpu`
as for bench/gpu_smoke.py:

    bash .whl/device-setup.sh && python3 -m pip install -q --no-deps --target /tmp/site2 .gpu/*.whl && PYTHONPATH=/tmp/site2:/tmp/site python3 bench/mixed_equality.py --out $OUT/mixed-equality.json --commit SHA

(defaults: bench/models/r1-distill-qwen-7b with dummy weights, 320 rows,
budget 128, 224 tokens.) On this machine's CPU, the same logic end to end on
tests/tiny_models.py's Llama, in 1-3 minutes on 2 cores (by their load):

    python bench/mixed_equality.py --quick --out /tmp/mixed-equality-cpu.json
    # = --device cpu --model tiny --rows 20 --budget 8 --tokens 40 --kv-tokens 16384 --batch-check full,h2o,rkv

The engine is bench/gpu_smoke.py's (its memory_split, model_dir,
policy_specs, pages_per_head, device_name, commit_of, flush_cache,
region_after and engine_alive are imported from there): kvsieve's attention
backend at the headline's memory split, mem_fraction_static 0.85, decode
CUDA graphs up to batch 128, prefill graphs off, max_running_requests the
row count. Every request is greedy (temperature 0) with ignore_eos and
generates --tokens (default budget + 96) past its own --prompt-tokens prompt
(64 random ids, every prompt starting with a different id, so that no two
rows share a radix prefix). Every registered policy
(kvsieve.policies.policy_names()) runs at --budget (128) with its defaults;
a policy that refuses the budget runs at the smallest larger one it accepts
(crystalcache: at least 132; recorded in `policies`). The rows used are
min(--rows, the engine's max running requests, the rows whose compressed
ceilings fit in the region at once), and at least one per policy. The radix
cache is flushed after every workload. The workloads, in this order:

1. `mixed`: all rows in one batch, the policies dealt round robin (row i
   runs policy i mod P);
2. `solo:<policy>`: each policy's rows of the mixed batch (same prompts,
   same kv_policy, same sampling) as one batch of that policy alone
   (rows / P rows);
3. `half:<policy>:1`, `half:<policy>:2` (batch-size check): the same rows
   again, in two batches of half as many rows each (the policies of
   --batch-check, default all, that have 2 rows or more);
4. `same-size:<policy>` for each policy of --same-size (default `full`;
   `all` for every policy): every row's prompt under that one policy, in
   one batch as large as the mixed one.

What is compared (token ids of each row, first differing position):

* `mixed_vs_solo`: the issue's check. A row of the mixed batch against the
  same row in its policy's solo batch. The two differ in the batch's other
  policies AND in its size (rows vs rows / P) and in how SGLang schedules
  its prefills (20,480 prompt tokens come in several extend batches).
* `batch_size`: a policy's solo batch against its two halves. Nothing
  differs but the batch size and the prefill grouping, so a row that
  differs here differs through batch-variant kernels (the model's GEMMs
  pick tiles and split-K by M, the number of rows; prefill by the extend
  batch's tokens), not through kvsieve's mixing.
* `same_size`: the rows of policy p in `same-size:p` against the mixed
  batch (same batch size and the same prompts in the same order; only the
  other rows' policies differ: what mixing alone changes) and against
  `solo:p` (the same policy at rows against rows / P: batch size alone, at
  the mixed batch's size).

Per policy and comparison: rows compared, equal, differing, errors (rows
with no output in either run), and for differing rows the first differing
position (min / median / max) and the share of tokens equal up to the first
divergence (first position / tokens; mean and min). `verdict` per policy
says which of the comparisons differ. With dummy weights the logits are
nearly flat and near-ties are common, so a batch-variant kernel flips a
greedy token more easily than with real weights: the `batch_size` and
`same_size` checks give the scale of that for the same engine.

Per workload: rows, wall seconds, tokens/s, errors (requests that raised or
ended with an abort, a workload that timed out), region pages still used 15 s
after it (an error), and whether the engine still answers. A workload that
outlasts --workload-timeout is aborted; past --deadline (seconds since start,
450 by default) the rest are skipped (an error). The JSON (--out) is written
before and after every workload, with the commit (--commit wins over `git
rev-parse HEAD`), device, date and command. The exit status is non-zero
when the engine failed to start or died, or any workload had an error or was
skipped; rows that differ are a measurement, not an error.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
import gpu_smoke as smoke  # noqa: E402  (the gate's engine set-up, reused)

MAX_MESSAGES = 5


# ----- options -----

def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="Every row of a mixed batch of every policy against its solo run "
                                             "(see the docstring).")
    ap.add_argument("--out", default=str(REPO / "bench/results/mixed-equality.json"), help="the JSON written")
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default cuda (cpu with --quick)")
    ap.add_argument("--model", default=None,
                    help="checkpoint dir (weights per --load-format); 'tiny' builds tests/tiny_models.py's Llama; "
                         "default bench/models/r1-distill-qwen-7b (tiny with --quick)")
    ap.add_argument("--load-format", default="dummy", help="SGLang's load_format (dummy: random weights from config.json)")
    ap.add_argument("--rows", type=int, default=None, help="rows of the mixed batch (default 320; 20 with --quick)")
    ap.add_argument("--budget", type=int, default=None, help="kv_policy.budget (default 128; 8 with --quick)")
    ap.add_argument("--tokens", type=int, default=None,
                    help="generated tokens per row (default budget + 96; 40 with --quick)")
    ap.add_argument("--prompt-tokens", type=int, default=64, help="prompt length (random ids)")
    ap.add_argument("--policies", default=None, help="comma list (default: every registered policy)")
    ap.add_argument("--same-size", default="full",
                    help="policies run on every row at the mixed batch's size (comma list, 'all' or 'none')")
    ap.add_argument("--batch-check", default=None,
                    help="policies whose rows run again in two batches of half the rows (comma list, 'all' or "
                         "'none'; default all; full,h2o,rkv with --quick)")
    ap.add_argument("--kv-tokens", type=int, default=None,
                    help=f"KV memory in tokens, split like the headline (default {smoke.HEADLINE_KV_TOKENS}; "
                         "16384 with --quick)")
    ap.add_argument("--pool-share", type=float, default=smoke.POOL_SHARE, help="of --kv-tokens to the token pool")
    ap.add_argument("--mem-fraction-static", type=float, default=0.85)
    ap.add_argument("--cuda-graph-max-bs", type=int, default=128, help="cuda_graph_max_bs_decode")
    ap.add_argument("--workload-timeout", type=float, default=None,
                    help="seconds before a workload's requests are aborted (default 120; 300 on cpu)")
    ap.add_argument("--deadline", type=float, default=450.0,
                    help="seconds from start after which no workload starts (0: none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--commit", default=None, help="the commit the wheel was built from (wins over `git rev-parse HEAD`)")
    ap.add_argument("--quick", action="store_true",
                    help="small defaults for a CPU logic check: --device cpu --model tiny --rows 20 --budget 8 "
                         "--tokens 40 --kv-tokens 16384 --batch-check full,h2o,rkv (explicit options win)")
    args = ap.parse_args(argv)
    quick = args.quick
    if args.device is None:
        args.device = "cpu" if quick else "cuda"
    if args.model is None:
        args.model = "tiny" if quick else str(REPO / "bench/models/r1-distill-qwen-7b")
    if args.rows is None:
        args.rows = 20 if quick else 320
    if args.budget is None:
        args.budget = 8 if quick else 128
    if args.tokens is None:
        args.tokens = 40 if quick else args.budget + 96
    if args.kv_tokens is None:
        args.kv_tokens = 16384 if quick else smoke.HEADLINE_KV_TOKENS
    if args.workload_timeout is None:
        args.workload_timeout = 300.0 if args.device == "cpu" else 120.0
    if args.batch_check is None:
        args.batch_check = "full,h2o,rkv" if quick else "all"
    args.tbq_share = 0.0  # memory_split's TBQ share: bf16 pages only (thinkv then runs without TBQ)
    return args


# ----- pure parts: the plan and the comparisons -----

def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """n random prompts, each starting with a different id where the range
    allows (no two rows share a radix-cache prefix)."""
    lo, hi = min(1000, vocab // 4), min(100000, vocab)
    rng = random.Random(seed)
    firsts = rng.sample(range(lo, hi), n) if hi - lo >= n else [rng.randrange(lo, hi) for _ in range(n)]
    return [[first] + [rng.randrange(lo, hi) for _ in range(length - 1)] for first in firsts]


def deal(names: list[str], rows: int) -> list[str]:
    """The policy of each row: round robin, at least one row per policy."""
    return [names[i % len(names)] for i in range(max(rows, len(names)))]


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where a and b differ (a length difference counts
    at the shorter one's end); None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_rows(pairs: list[tuple[list[int] | None, list[int] | None]]) -> dict:
    """Rows equal and differing; for differing rows the first differing
    position and the share of tokens equal up to it."""
    equal, errors, firsts, shares = 0, 0, [], []
    for a, b in pairs:
        if a is None or b is None:
            errors += 1
            continue
        at = first_difference(a, b)
        if at is None:
            equal += 1
        else:
            firsts.append(at)
            shares.append(at / max(len(a), len(b), 1))
    out = {"rows": len(pairs) - errors, "equal": equal, "differing": len(firsts), "errors": errors}
    if firsts:
        out["first_difference"] = {"min": min(firsts), "median": statistics.median(firsts), "max": max(firsts)}
        out["equal_prefix_share"] = {"mean": round(sum(shares) / len(shares), 3), "min": round(min(shares), 3)}
    return out


def totals(per_policy: dict) -> dict:
    keys = ("rows", "equal", "differing", "errors")
    return {k: sum(v.get(k, 0) for v in per_policy.values()) for k in keys}


def verdict(mixed: dict | None, batch: dict | None, same_mixed: dict | None, same_solo: dict | None) -> str:
    """One line per policy: which comparisons differ."""
    if not mixed or not mixed.get("rows"):
        return "not compared"
    if not mixed.get("differing"):
        return "equal: every row of the mixed batch equals its solo run"
    parts = [f"{mixed['differing']} of {mixed['rows']} rows differ from the solo run"]
    if batch and batch.get("rows"):
        parts.append(f"the batch-size check differs in {batch['differing']} of {batch['rows']}"
                     + (" (batch-variant kernels)" if batch["differing"] else ""))
    if same_mixed and same_mixed.get("rows"):
        parts.append(f"at the mixed batch's size, {same_mixed['differing']} of {same_mixed['rows']} differ from the "
                     "mixed batch" + (" (mixing)" if same_mixed["differing"] else " (not mixing)"))
    if same_solo and same_solo.get("rows"):
        parts.append(f"{same_solo['differing']} of {same_solo['rows']} differ between the solo size and the mixed size")
    return "; ".join(parts)


# ----- one workload -----

def run_batch(engine, rows: list[tuple[list[int], dict]], tokens: int, timeout: float) -> dict:
    """Generate every row at once (greedy, ignore_eos); output ids per row
    (None for a row that failed), errors, wall time. Past the timeout
    everything is aborted."""
    loop = engine.loop
    started = time.perf_counter()
    tasks = [loop.create_task(smoke.generate_one(engine, ids, {
        "max_new_tokens": tokens, "temperature": 0.0, "ignore_eos": True,
        "custom_params": {"kv_policy": policy}})) for ids, policy in rows]
    done, pending = loop.run_until_complete(asyncio.wait(tasks, timeout=timeout))
    timed_out = len(pending)
    if pending:
        engine.tokenizer_manager.abort_request(abort_all=True)
        _, pending = loop.run_until_complete(asyncio.wait(pending, timeout=30))
        for task in pending:
            task.cancel()
        if pending:
            loop.run_until_complete(asyncio.wait(pending, timeout=5))
    wall = time.perf_counter() - started
    outputs, errors, generated = [], [], 0
    for task, (_, policy) in zip(tasks, rows):
        out = task.result() if task.done() and not task.cancelled() else RuntimeError("cancelled after the timeout")
        name = policy.get("name")
        if isinstance(out, BaseException):
            errors.append(f"{name}: {type(out).__name__}: {out}"[:400])
            outputs.append(None)
            continue
        reason = out.get("meta_info", {}).get("finish_reason")
        if isinstance(reason, dict) and reason.get("type") == "abort":
            errors.append(f"{name}: abort: {reason.get('message')}"[:400])
            outputs.append(None)
            continue
        ids = list(out.get("output_ids") or [])
        generated += len(ids)
        if len(ids) != tokens:
            errors.append(f"{name}: {len(ids)} tokens, not {tokens}")
        outputs.append(ids)
    failed = len(errors)
    if timed_out:
        errors.insert(0, f"timeout: {timed_out} of {len(rows)} requests unfinished after {timeout:.0f} s (aborted)")
    return {"outputs": outputs, "wall_s": round(wall, 2), "completion_tokens": generated,
            "tokens_per_s": round(generated / wall, 1) if wall else None,
            "errors": max(failed, 1 if timed_out else 0), "error_messages": errors[:MAX_MESSAGES]}


# ----- main -----

def main(argv: list[str]) -> int:
    t0 = time.monotonic()
    args = parse_args(argv)
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)

    from kvsieve.service.engine import prepare_process_environment

    prepare_process_environment(args.device)  # SGLANG_USE_CPU_ENGINE on cpu; prometheus' multiprocess dir
    from kvsieve.policies import policy_names

    model = smoke.model_dir(args.model)
    shape = smoke.model_shape(model)
    names = args.policies.split(",") if args.policies else policy_names()
    unknown = sorted(set(names) - set(policy_names()))
    if unknown:
        raise SystemExit(f"unknown policies {unknown}; registered: {','.join(policy_names())}")
    def subset(option: str, value: str) -> list[str]:
        picked = {"all": list(names), "none": []}.get(value, [n for n in value.split(",") if n])
        if sorted(set(picked) - set(names)):
            raise SystemExit(f"{option} {value}: not among the policies run")
        return picked

    same_size, batch_check = subset("--same-size", args.same_size), subset("--batch-check", args.batch_check)
    specs = smoke.policy_specs(names, args.budget)
    split = smoke.memory_split(args, shape)
    os.environ["KVSIEVE_REGION_PAGES"] = str(split["region_pages"])
    os.environ["KVSIEVE_REGION_QUANT_PAGES"] = str(split["quantized_pages"])

    engine_kwargs = dict(model_path=str(model), load_format=args.load_format, skip_tokenizer_init=True,
                         attention_backend="kvsieve", sampling_backend="pytorch", log_level="warning",
                         mem_fraction_static=args.mem_fraction_static, max_total_tokens=split["pool_tokens"],
                         max_running_requests=max(args.rows, len(names)), random_seed=args.seed, enable_metrics=True)
    if args.device == "cuda":
        engine_kwargs.update(cuda_graph_max_bs_decode=args.cuda_graph_max_bs, disable_prefill_cuda_graph=True)
    else:
        engine_kwargs.update(device="cpu", disable_cuda_graph=True)

    results = {
        "kind": "mixed-equality", **smoke.commit_of(args.commit),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": smoke.device_name(args.device),
        "command": "python3 bench/mixed_equality.py " + shlex.join(argv),
        "settings": {"device": args.device, "model": str(model), "model_shape": shape, "engine": engine_kwargs,
                     "env": {k: os.environ[k] for k in ("KVSIEVE_REGION_PAGES", "KVSIEVE_REGION_QUANT_PAGES")},
                     "memory_split": split, "budget": args.budget, "tokens": args.tokens,
                     "prompt_tokens": args.prompt_tokens, "temperature": 0.0, "ignore_eos": True,
                     "same_size": same_size, "batch_check": batch_check,
                     "workload_timeout_s": args.workload_timeout, "deadline_s": args.deadline or None},
        "policies": specs, "rows": {"requested": args.rows}, "workloads": [], "ok": False,
        "stage": "starting the engine",
    }
    state = {"current": None, "engine_alive": True}

    def save() -> None:
        results["elapsed_s"] = round(time.monotonic() - t0, 1)
        tmp = out_path.with_suffix(out_path.suffix + ".tmp")
        tmp.write_text(json.dumps(results, indent=1))
        tmp.replace(out_path)

    invalid = [n for n in names if "invalid" in specs[n]]
    if invalid:
        results.update(stage="invalid policy specs", failed_workloads=[f"spec:{n}" for n in invalid])
        save()
        print(f"FAILED: no budget accepted by {invalid}", flush=True)
        return 2
    save()
    print(f"mixed_equality: {results['device']}, {len(names)} policies, split {json.dumps(split)}", flush=True)
    engine = smoke.start_engine(engine_kwargs, results, save)
    if engine is None:
        return 2
    exit_code = 1
    try:
        smoke.report_engine_death(engine, state, results, save)
        try:
            states = engine.loop.run_until_complete(asyncio.wait_for(engine.tokenizer_manager.get_internal_state(), 60))
            state0 = states[0] if states else {}
            engine_rows = state0.get("effective_max_running_requests_per_dp") or state0.get("max_running_requests")
        except Exception as exc:  # noqa: BLE001
            engine_rows = None
            results["rows"]["engine_info_error"] = f"{type(exc).__name__}: {exc}"[:400]
        results["rows"]["engine_max_running_requests"] = engine_rows
        per_row = {n: smoke.pages_per_head(n, s["kv_policy"], args.prompt_tokens, args.tokens) for n, s in specs.items()}
        worst = max((p for p in per_row.values() if p), default=0)
        region_rows = split["region_pages"] // (shape["layers"] * shape["kv_heads"] * worst) if worst else None
        rows = min(r for r in (args.rows, engine_rows, region_rows) if r)
        if rows < len(names):
            raise SystemExit(f"{rows} rows hold fewer than one row per policy ({len(names)})")
        plan = deal(names, rows)
        batch = prompts(len(plan), args.prompt_tokens, shape["vocab"], seed=args.seed + 1)
        by_policy = {n: [i for i, p in enumerate(plan) if p == n] for n in names}
        results["rows"].update(region_fit=region_rows, ceiling_pages_per_head=per_row, used=len(plan),
                               per_policy={n: len(ix) for n, ix in by_policy.items()})
        print(f"engine up in {results['engine_start_s']} s; rows {json.dumps(results['rows'])}", flush=True)
        save()

        # (label, row indices, the policy each row runs under)
        workloads = [("mixed", list(range(len(plan))), plan)]
        workloads += [(f"solo:{n}", ix, [n] * len(ix)) for n, ix in by_policy.items()]
        for n, ix in by_policy.items():
            if n in batch_check and len(ix) >= 2:
                half = len(ix) // 2
                workloads += [(f"half:{n}:1", ix[:half], [n] * half),
                              (f"half:{n}:2", ix[half:], [n] * (len(ix) - half))]
        workloads += [(f"same-size:{n}", list(range(len(plan))), [n] * len(plan)) for n in same_size]

        outputs: dict[str, dict[int, list[int] | None]] = {}
        for label, index, policies in workloads:
            entry = {"name": label, "rows": len(index), "status": "running"}
            results["workloads"].append(entry)
            left = args.deadline - (time.monotonic() - t0) if args.deadline else None
            if not state["engine_alive"] or (left is not None and left < 20):
                entry.update(status="skipped", errors=1, error_messages=[
                    "the engine died earlier" if not state["engine_alive"] else f"past --deadline {args.deadline:.0f} s"])
                save()
                print(f"{label:28s} skipped: {entry['error_messages'][0]}", flush=True)
                continue
            timeout = args.workload_timeout if left is None else max(10.0, min(args.workload_timeout, left - 15))
            state["current"] = entry
            save()
            try:
                run = run_batch(engine, [(batch[i], specs[p]["kv_policy"]) for i, p in zip(index, policies)],
                                args.tokens, timeout)
                outputs[label] = dict(zip(index, run.pop("outputs")))
                entry.update(run, status="done")
            except Exception as exc:  # noqa: BLE001 - recorded; the next workload runs
                entry.update(status="failed", errors=max(1, entry.get("errors") or 0),
                             error_messages=[f"{type(exc).__name__}: {exc}"[:400]])
            entry["region_after"] = smoke.region_after()
            if entry["region_after"].get("used"):
                entry["errors"] = (entry.get("errors") or 0) + 1
                entry.setdefault("error_messages", []).append(
                    f"region pages still used 15 s after the workload: {entry['region_after']['used']:.0f}")
            alive, why = smoke.engine_alive(engine, shape["vocab"])
            entry["engine_alive"] = alive
            if not alive:
                state["engine_alive"] = False
                entry["engine_error"] = why
            else:
                entry["cache_flushed"] = smoke.flush_cache(engine)
            state["current"] = None
            save()
            print(f"{label:28s} rows {entry['rows']:4d} {entry.get('wall_s', 0):7.1f} s "
                  f"{entry.get('tokens_per_s') or 0:9.1f} tok/s errors {entry.get('errors')} alive {alive}"
                  + (f" first error: {entry['error_messages'][0]}" if entry.get("error_messages") else ""), flush=True)

        # ----- the comparisons -----
        def pairs(a: str, b: str, index: list[int]) -> list:
            if a not in outputs or b not in outputs:
                return []
            return [(outputs[a].get(i), outputs[b].get(i)) for i in index]

        def halves(n: str) -> dict:
            merged = {**outputs.get(f"half:{n}:1", {}), **outputs.get(f"half:{n}:2", {})}
            return merged if f"half:{n}:1" in outputs and f"half:{n}:2" in outputs else {}

        comparisons: dict[str, dict] = {"mixed_vs_solo": {}, "batch_size": {}, "same_size_vs_mixed": {},
                                        "same_size_vs_solo": {}}
        for n, ix in by_policy.items():
            if pairs("mixed", f"solo:{n}", ix):
                comparisons["mixed_vs_solo"][n] = compare_rows(pairs("mixed", f"solo:{n}", ix))
            merged = halves(n)
            if merged and f"solo:{n}" in outputs:
                comparisons["batch_size"][n] = {**compare_rows([(outputs[f"solo:{n}"].get(i), merged.get(i)) for i in ix]),
                                                "batch_rows": [len(ix), len(ix) // 2, len(ix) - len(ix) // 2]}
            if n in same_size:
                if pairs(f"same-size:{n}", "mixed", ix):
                    comparisons["same_size_vs_mixed"][n] = {**compare_rows(pairs(f"same-size:{n}", "mixed", ix)),
                                                            "batch_rows": len(plan)}
                if pairs(f"same-size:{n}", f"solo:{n}", ix):
                    comparisons["same_size_vs_solo"][n] = {**compare_rows(pairs(f"same-size:{n}", f"solo:{n}", ix)),
                                                           "batch_rows": [len(plan), len(ix)]}
        results["comparisons"] = comparisons
        results["totals"] = {k: totals(v) for k, v in comparisons.items()}
        results["verdict"] = {n: verdict(comparisons["mixed_vs_solo"].get(n), comparisons["batch_size"].get(n),
                                         comparisons["same_size_vs_mixed"].get(n), comparisons["same_size_vs_solo"].get(n))
                              for n in names}
        for n in names:
            print(f"{n:14s} {results['verdict'][n]}", flush=True)
        for k, v in results["totals"].items():
            print(f"{k:20s} rows {v['rows']} equal {v['equal']} differing {v['differing']} errors {v['errors']}",
                  flush=True)
        failed = [w["name"] for w in results["workloads"] if w.get("errors") or w.get("status") != "done"]
        results["failed_workloads"] = failed
        results["engine_alive_at_end"] = state["engine_alive"]
        results["ok"] = not failed and state["engine_alive"]
        results["all_rows_equal"] = results["totals"]["mixed_vs_solo"]["rows"] > 0 and \
            results["totals"]["mixed_vs_solo"]["rows"] == results["totals"]["mixed_vs_solo"]["equal"]
        results["stage"] = "done"
        exit_code = 0 if results["ok"] else 1
    finally:
        save()
        try:
            engine.shutdown()
        except Exception as exc:  # noqa: BLE001
            print(f"shutdown: {exc!r}", flush=True)
    results["elapsed_s"] = round(time.monotonic() - t0, 1)
    save()
    print(f"{'OK' if results['ok'] else 'FAILED'}: {len(results['workloads'])} workloads in {results['elapsed_s']} s; "
          f"mixed rows equal to solo: {results.get('totals', {}).get('mixed_vs_solo')}"
          + (f"; failed: {', '.join(results['failed_workloads'])}" if results.get("failed_workloads") else "")
          + f" -> {out_path}", flush=True)
    return exit_code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
