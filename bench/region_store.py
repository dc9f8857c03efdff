"""Time the store of a decode step's new tokens, a whole step of layers,
PyTorch writes against the fused kernel (kernels/region_store.py):

    python bench/region_store.py OUT.json [--rows 48,128,640] [--device cuda] [--wide-columns 36]

Each form stores one step's tokens into every layer of a R1-Distill-Qwen-7B
shaped region (28 layers, 4 kv heads, head_dim 128, bf16, pages of 16, 20
columns a row: budget 256 and its slack), captured in one CUDA graph per
form and replayed, as the engine's whole-stack graphs run it (the PyTorch
form is launch-bound: a graph saves the host's launches, not the GPU's
per-kernel cost). On CPU only the PyTorch form runs (eagerly). Writes the
median ms a step per (form, rows), with machine, date and command.

--wide-columns N: a mixed batch's widths too: one row in WIDE_EVERY holds N
columns (crystal_kv's 36 at budget 256), the others 20, and the table is
as wide as the widest row (null pages past a row's own columns), each row's
columns passed to the store where it takes them (`row_columns`).
"""

from __future__ import annotations

import argparse
import inspect
import json
import platform
import statistics
import sys
import time
from datetime import datetime, timezone

import torch

from kvsieve.kernels import region_store

LAYERS, HEADS, DIM, PAGE, COLUMNS = 28, 4, 128, 16, 20
#: With --wide-columns, every this many rows one is wide (the eight-policy
#: mix's one class in eight).
WIDE_EVERY = 8


def step_case(rows: int, device: str, seed: int = 0, wide_columns: int = 0) -> list[dict]:
    """One store call's arguments per layer: distinct pages per (row, head),
    80% of slots taken, the batch's K/V strided as SGLang's qkv gives them.
    wide_columns: every WIDE_EVERY-th row that wide, the table too."""
    g = torch.Generator().manual_seed(seed)
    width = max(COLUMNS, wide_columns)
    pages = LAYERS * rows * HEADS * width
    null_page = pages
    valid = (torch.rand(pages + 1, PAGE, generator=g) < 0.8).to(device)
    valid[null_page] = False
    region = dict(
        region_k=torch.zeros(pages + 1, PAGE, DIM, dtype=torch.bfloat16, device=device),
        region_v=torch.zeros(pages + 1, PAGE, DIM, dtype=torch.bfloat16, device=device),
        valid=valid, vnorm=torch.zeros(pages + 1, PAGE, device=device),
        position=torch.zeros(pages + 1, PAGE, dtype=torch.int64, device=device),
        score=torch.zeros(pages + 1, PAGE, device=device),
        last_hit=torch.zeros(pages + 1, PAGE, dtype=torch.int32, device=device),
        overflow_flags=torch.zeros(rows + 1, dtype=torch.bool, device=device), null_page=null_page,
        zero=torch.zeros((), device=device), zero_int=torch.zeros((), dtype=torch.int32, device=device))
    tables = torch.randperm(pages, generator=g).view(rows, LAYERS, HEADS, width)
    columns = torch.full((rows,), COLUMNS, dtype=torch.int32)
    if wide_columns:
        columns[::WIDE_EVERY] = width
        tables[columns < width, :, :, COLUMNS:] = null_page
    tables = tables.to(device)
    step = dict(batch_index=torch.randperm(rows, device=device), positions=torch.arange(rows, device=device) + 1000,
                pool_rows=torch.arange(rows, device=device) + 1)
    if wide_columns:
        step["row_columns"] = columns.to(device)
    calls = []
    for layer in range(LAYERS):
        qkv = torch.randn(rows, 3 * HEADS, DIM, dtype=torch.bfloat16, device=device)
        calls.append(dict(region, **step, table=tables[:, layer], k=qkv[:, HEADS:2 * HEADS], v=qkv[:, 2 * HEADS:]))
    return calls


def time_form(store, calls, device: str, repeats: int = 50) -> float:
    """Median ms of one step (every layer's store). A store that does not
    take `row_columns` (an older build) scans every row's table to its end."""
    if "row_columns" not in inspect.signature(store).parameters:
        calls = [{k: v for k, v in call.items() if k != "row_columns"} for call in calls]

    def step():
        for call in calls:
            store(**call)

    step()  # compile (Triton) and warm up
    if device != "cuda":
        times = []
        for _ in range(max(3, repeats // 10)):
            start = time.perf_counter()
            step()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    times = []
    for _ in range(repeats):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end))
    return statistics.median(times)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--rows", default="48,128,640")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--wide-columns", type=int, default=0,
                        help="one row in 8 this many columns wide (a mixed batch); 0: every row 20")
    args = parser.parse_args(argv)
    forms = {"pytorch": region_store.store_new_tokens_reference}
    if args.device == "cuda":
        forms["fused"] = region_store.store_new_tokens
    results = []
    for rows in [int(r) for r in args.rows.split(",")]:
        calls = step_case(rows, args.device, wide_columns=args.wide_columns)
        for name, store in forms.items():
            ms = time_form(store, calls, args.device)
            results.append({"form": name, "rows": rows, "layers": LAYERS, "wide_columns": args.wide_columns,
                            "step_ms": round(ms, 4)})
            print(f"{name:8s} rows {rows:4d}: {ms:.3f} ms a step ({LAYERS} layers)", flush=True)
    report = {
        "kind": "region_store", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu",
        "command": "python " + " ".join(["bench/region_store.py", *(argv if argv is not None else sys.argv[1:])]),
        "shape": {"layers": LAYERS, "kv_heads": HEADS, "head_dim": DIM, "page": PAGE, "columns": COLUMNS},
        "results": results}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
