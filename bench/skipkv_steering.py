"""skipkv with and without adaptive steering on the CPU model: generation
length and answer agreement on math word problems (bench/eval's `math`
task: reasoning-gym's gsm_symbolic, graded with math-verify).

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.skipkv_steering \
        --problems 12 --max-tokens 160 --concurrency 12 --traces 16 --serve-arg=--max-total-tokens=8192 \
        --out bench/results/skipkv-steering-smollm2.json

It calibrates the steering vectors of the model (`kvsieve calibrate skipkv`)
into a fresh file store, starts `kvsieve serve` on that store (the embedded
SmolLM2-135M-Instruct unless --model), and sends every problem, one request
at a time (SGLang's CPU path is not batch-invariant: solo requests keep the
comparison to steering alone; --concurrency N batches each configuration's
problems together, faster, and then a row may also change with the batch
after another row's output changed), under each configuration:

  off      {"name": "skipkv"}                       (no steering)
  default  {"name": "skipkv", "params": {"steering": true}}
  strong   {"name": "skipkv", "params": {"steering": true, "alpha_step": 0.25, "alpha_max": 3.0}}

The budget is skipkv's default (1024 per layer and kv head), above every
generation here, so nothing is evicted: differences come from steering.
Writes per problem and configuration the completion tokens, finish reason,
final answer, grade and kv_usage.steering, and per configuration the mean
length, accuracy and agreement of the final answer with `off`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

from tqdm import tqdm

from bench.eval.grading import grade_math, math_answer
from bench.eval.runner import machine
from bench.eval.server import Client, serve
from bench.eval.tasks import math_items

KVSIEVE = str(Path(sys.executable).with_name("kvsieve"))
CONFIGS = {
    "off": {"name": "skipkv"},
    "default": {"name": "skipkv", "params": {"steering": True}},
    "strong": {"name": "skipkv", "params": {"steering": True, "alpha_step": 0.25, "alpha_max": 3.0}},
}


def summarise(records: list[dict]) -> dict:
    out = {}
    base = {r["id"]: r for r in records if r["config"] == "off"}
    for name in CONFIGS:
        rows = [r for r in records if r["config"] == name]
        if not rows:
            continue
        lengths = [r["completion_tokens"] for r in rows]
        agree = [r["answer"] is not None and r["answer"] == base[r["id"]]["answer"] for r in rows if r["id"] in base]
        same_text = [r["token_ids_hash"] == base[r["id"]]["token_ids_hash"] for r in rows if r["id"] in base]
        steered = [r["steering"]["steered_tokens"] for r in rows if r.get("steering")]
        peaks = [r["steering"]["alpha_peak"] for r in rows if r.get("steering")]
        out[name] = {
            "kv_policy": CONFIGS[name], "problems": len(rows),
            "mean_completion_tokens": round(statistics.mean(lengths), 1),
            "median_completion_tokens": statistics.median(lengths),
            "hit_max_tokens": sum(r["finish_reason"] == "length" for r in rows),
            "accuracy": round(sum(r["correct"] for r in rows) / len(rows), 4),
            "answered": sum(r["answer"] is not None for r in rows),
            "answer_agreement_with_off": round(sum(agree) / len(agree), 4) if agree else None,
            "identical_output_to_off": sum(same_text),
            "mean_steered_newlines": round(statistics.mean(steered), 1) if steered else None,
            "mean_alpha_peak": round(statistics.mean(peaks), 3) if peaks else None,
        }
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="checkpoint directory (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--problems", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--traces", type=int, default=64, help="calibration traces")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--serve-arg", action="append", default=[],
                    help="extra `kvsieve serve` argument (repeatable), e.g. --serve-arg=--max-total-tokens=8192")
    ap.add_argument("--concurrency", type=int, default=1,
                    help="requests in flight (default 1: solo, batch-invariant; more: each configuration's "
                         "problems batched together)")
    ap.add_argument("--out", default="bench/results/skipkv-steering-smollm2.json")
    args = ap.parse_args(argv)
    configs = [c.strip() for c in args.configs.split(",")]
    work = Path(tempfile.mkdtemp(prefix="kvsieve-steering-"))
    env = {"KVSIEVE_STORE__URL": f"file://{work / 'store.json'}"}
    calibrate = [KVSIEVE, "calibrate", "skipkv", "--traces", str(args.traces)] + (
        ["--model", args.model] if args.model else [])
    started = time.time()
    done = subprocess.run(calibrate, env={**os.environ, **env}, capture_output=True, text=True)
    if done.returncode:
        print(done.stderr, file=sys.stderr)
        return done.returncode
    calibration = done.stdout.strip().splitlines()[-1]
    print(calibration, file=sys.stderr)
    items = math_items(args.problems, seed=args.seed, max_tokens=args.max_tokens)
    records = []
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
            "command": " ".join(["python -m bench.skipkv_steering", *(argv or sys.argv[1:])]),
            "model": args.model or "SmolLM2-135M-Instruct (embedded default)", "calibration": calibration,
            "task": "bench/eval math (reasoning-gym gsm_symbolic)", "seed": args.seed,
            "max_tokens": args.max_tokens, "concurrency": args.concurrency, "serve_args": args.serve_arg,
            "requests": ("one at a time (solo)" if args.concurrency == 1 else
                         f"{args.concurrency} in flight, one configuration at a time") + ", greedy",
            "budget": "skipkv's default 1024: no eviction"}

    def save(complete: bool) -> dict:
        result = {"meta": {**meta, "complete": complete, "wall_s": round(time.time() - started, 1)},
                  "summary": summarise(records), "records": records}
        out.write_text(json.dumps(result, indent=1) + "\n")
        return result

    with serve(args.model, extra_args=tuple(args.serve_arg), env=env, log_path=work / "serve.log") as url:
        client = Client(url)
        with tqdm(total=len(items) * len(configs), desc="skipkv steering", unit="request") as bar, \
                ThreadPoolExecutor(args.concurrency) as pool:
            for name in configs:  # one configuration at a time: the same batches until steering changes one
                bodies = pool.map(lambda item: client.chat(item.messages, args.max_tokens, CONFIGS[name]), items)
                for item, body in zip(items, bodies):
                    if "error" in body:
                        raise RuntimeError(f"{item.id} {name}: {body}")
                    choice = body["choices"][0]
                    text = choice["message"]["content"]
                    records.append({
                        "id": item.id, "config": name, "gold": item.answer,
                        "completion_tokens": body["usage"]["completion_tokens"],
                        "finish_reason": choice["finish_reason"], "answer": math_answer(text),
                        "correct": grade_math(text, item.answer),
                        # (Python's hash of a tuple of ints is the same in every process)
                        "token_ids_hash": str(hash(tuple(choice.get("token_ids") or ()))),
                        "steering": body["kv_usage"].get("steering"), "latency_s": round(body["latency_s"], 2),
                        "text": text,
                    })
                    bar.update(1)
                    save(complete=False)  # an interrupted run keeps what it measured
        client.close()
    print(json.dumps(save(complete=True)["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
