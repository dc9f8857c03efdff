"""Time the slot view a policy group gathers each layer (radix_ext/backend.py
`_view`): the region's per-slot state (valid, position, score, last_hit) of
the group's page-table rows, as `buffer[table]` does it today, against
other ways of reading the same bytes:

    python bench/view_gather.py OUT.json [--rows 600] [--columns 65] [--device cuda]

At 600 rows x 4 kv heads x 65 columns of 16 slots (budget 1024 and its
slack) the step profile puts the view at 6-13 ms a step on an H200 (28
layers; twenty-fifth and twenty-sixth sessions): this separates the
gathers' own cost from the rest. Forms, each timed per layer (median of
repeats, CUDA events):

  index      buffer[table] for the four buffers (the engine's form without
             the kernel: slot_view.gather_view_reference)
  select     torch.index_select(buffer, 0, table.flatten()) per buffer
  int32      `index` with position held as int32 (half the bytes)
  valid+pos  `index` of valid and position only (a policy without slot state)
  fused      kernels/slot_view.py: the four in one kernel (GPU only)

Writes the median ms per layer per form and the bytes each moves, with
machine, date and command. On CPU it runs the same forms at --rows' size
(slow, for the code path only).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import datetime, timezone

import torch

from kvsieve.kernels import slot_view

HEADS, PAGE = 4, 16


def timed(fn, repeats: int, device: str) -> float:
    """Median ms of `fn` over `repeats` calls (after one warm-up)."""
    fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def region(pages: int, device: str) -> dict:
    return {"valid": torch.rand(pages, PAGE, device=device) < 0.9,
            "position": torch.randint(0, 1 << 20, (pages, PAGE), device=device),
            "score": torch.rand(pages, PAGE, device=device),
            "last_hit": torch.randint(0, 8, (pages, PAGE), dtype=torch.int32, device=device)}


def forms(buffers: dict, table: torch.Tensor) -> dict:
    flat = table.flatten()
    position32 = buffers["position"].to(torch.int32)
    view = (buffers["valid"], buffers["position"], buffers["score"], buffers["last_hit"])
    return {
        "index": lambda: list(slot_view.gather_view_reference(table, *view)),
        "select": lambda: [torch.index_select(b, 0, flat) for b in buffers.values()],
        "int32": lambda: [b[table] for b in (buffers["valid"], position32, buffers["score"], buffers["last_hit"])],
        "valid+pos": lambda: list(slot_view.gather_view_reference(table, *view[:2], None, None)[:2]),
        "fused": lambda: list(slot_view.gather_view(table, *view)),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--rows", type=int, default=600)
    ap.add_argument("--columns", type=int, default=65)
    ap.add_argument("--layers", type=int, default=28, help="layers' pages in the region (the table reads one)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    pages = args.rows * HEADS * args.columns * args.layers
    buffers = region(pages, args.device)
    # One layer's table: each (row, head) owns its columns' pages, scattered over the region.
    table = torch.randperm(pages, device=args.device)[:args.rows * HEADS * args.columns]
    table = table.view(args.rows, HEADS, args.columns)
    slots = table.numel() * PAGE
    results = {}
    for name, fn in forms(buffers, table).items():
        if name == "fused" and args.device != "cuda":
            continue  # Triton compiles for the GPU (TRITON_INTERPRET runs it here, for tests only)
        ms = timed(fn, args.repeats, args.device)
        moved = sum(t.numel() * t.element_size() for t in fn())
        results[name] = {"ms_per_layer": round(ms, 4), "ms_per_step_28_layers": round(28 * ms, 3),
                         "bytes_out": moved, "gb_per_s": round(2 * moved / ms / 1e6, 1)}
        print(name, json.dumps(results[name]), flush=True)
    out = {"machine": torch.cuda.get_device_name(0) if args.device == "cuda" else platform.processor() or "cpu",
           "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "command": "python bench/view_gather.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "rows": args.rows, "heads": HEADS, "columns": args.columns, "slots_per_layer": slots, "forms": results}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
