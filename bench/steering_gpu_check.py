"""skipkv steering's per-forward device work on a GPU: no host sync, the cost
of the decoder-layer hook's masked add, and unflagged rows left bit for bit.

    python -m bench.steering_gpu_check --device cuda --out bench/results/steering-gpu-check.json

R1-Distill-Qwen-7B's shapes (28 layers, hidden 3584, bf16), 1024 req_pool
rows, a decode batch of `--rows` rows of which half are steered, half of
their input tokens newlines. Under torch.cuda.set_sync_debug_mode("error")
it runs the hook's work (SteeringTable.apply) and the per-step α update
(the sentence book's fold with cue counting, alpha_schedule, set_alpha), so
a host sync in either raises. Times are CUDA-event means over `--iters`.
Runs on the CPU too (--device cpu: the sync check is then vacuous).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from kvsieve.policies.observations import to_device
from kvsieve.policies.skipkv.book import SentenceBook, delimiter_table
from kvsieve.policies.skipkv.steering import SteeringTable, alpha_schedule, token_table


def timed(fn, iters: int, device) -> float:
    """Mean ms per call."""
    for _ in range(3):
        fn()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / iters
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t) * 1000 / iters


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--hidden", type=int, default=3584)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--out", default="bench/results/steering-gpu-check.json")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    V, pool_rows, R, layer = 32000, 1024, args.rows, 20
    newline_ids, cue_ids, stop_ids = [13, 271], [14524, 3983], [13, 271, 29889]
    table = SteeringTable(pool_rows, torch.randn(args.layers, args.hidden, device=device, dtype=dtype),
                          token_table(newline_ids, device, size=V))
    rows = torch.randperm(pool_rows)[:R]
    steered = rows[: R // 2].tolist()
    for r in steered:
        table.begin(r, layer, 1.25)
    rows_dev = rows.to(device)
    ids = torch.randint(0, V, (R,), device=device)
    ids[::2] = newline_ids[0]
    hidden = torch.randn(R, args.hidden, device=device, dtype=dtype)
    book = SentenceBook(delimiter_table(stop_ids, device), args.hidden, device)
    book.cue = token_table(cue_ids, device, size=V)
    handles = [book.open(r) for r in steered]
    steered_dev = to_device(steered, torch.int64, device)
    params = [to_device([v] * len(steered), torch.float32, device) for v in (1.25, 0.02, 2.0)]

    def hook_work():
        return table.apply(layer, hidden, ids, rows_dev)

    def step_work():
        tokens = torch.randint(0, V, (len(steered),), device=device)
        book.add_forward([(h, i, 1) for i, h in enumerate(handles)], torch.arange(len(steered), device=device),
                         tokens, torch.randn(len(steered), args.hidden, device=device, dtype=dtype))
        book.flush()
        table.set_alpha(steered_dev, alpha_schedule(*params, book.revalidations(steered_dev)))

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        out = hook_work()
        step_work()
        hook_ms, step_ms = timed(hook_work, args.iters, device), timed(step_work, args.iters, device)
    finally:
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    flagged = torch.isin(rows_dev, steered_dev) & torch.isin(ids, torch.tensor(newline_ids, device=device))
    untouched = bool(torch.equal(out[~flagged], hidden[~flagged]))
    changed = bool((out[flagged] != hidden[flagged]).any(dim=-1).all())
    result = {
        "meta": {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                 "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
                 "command": "python -m bench.steering_gpu_check " + " ".join(argv or []),
                 "shapes": {"layers": args.layers, "hidden": args.hidden, "dtype": str(dtype), "rows": R,
                            "steered_rows": len(steered), "req_pool_rows": pool_rows}},
        "no_host_sync": device.type == "cuda",  # set_sync_debug_mode("error") would have raised
        "unflagged_rows_bit_for_bit": untouched, "flagged_rows_changed": changed,
        "hook_ms_per_forward": round(hook_ms, 4), "alpha_update_ms_per_step": round(step_ms, 4),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0 if untouched and changed else 1


if __name__ == "__main__":
    raise SystemExit(main())
