"""What ThinKV's TBQ group flush costs (radix_ext/tbq_store.flush): every
`page_size` decode steps each TBQ row moves its full-precision group of 16
tokens, in every layer and kv head, into quantized pages. Times one flush
of `--rows` rows x `--layers` layers (stacked, as the backend flushes after
a whole-forward replay) x `--heads` heads, each group going into empty
pages (a fresh request) and into pages with holes (after evictions), for
the flush and for its per-token reference (tests/helpers/tbq_reference.py:
the formulation before 2026-11-26, which rebuilt a destination page once
per token that joined it).

    python bench/tbq_flush.py --rows 64 --layers 1 --out bench/results/tbq-flush-cpu.json
    python bench/tbq_flush.py --device cuda --rows 640 --layers 28 --skip-reference --out OUT/tbq-flush-gpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from kvsieve.kernels import kv_formats as kvf
from kvsieve.radix_ext import tbq_store
from kvsieve.radix_ext.pages import PageManager, RegionConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def state(rows: int, layers: int, heads: int, columns: int, device: str, holes: bool, seed: int = 0):
    """A region whose every (row, layer, head) has a whole group in its
    full-precision page and `columns` quantized pages: empty, or holding
    earlier groups with a third of their slots evicted."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    pm = PageManager(RegionConfig(num_layers=layers, num_kv_heads=heads, head_dim=128, num_pages=rows * layers * heads,
                                  quant_pages=rows * layers * heads * columns, quant_bits=4, max_rows=rows,
                                  dtype=torch.bfloat16, device=device))
    for r in range(rows):
        pm.allocate(f"r{r}", 1, columns)
        pm.bind(f"r{r}", r)
    pm.flush()
    table = pm.table[:rows].flatten(0, 1)  # [rows * layers, heads, 1 + columns]
    fmt = torch.full((table.shape[0],), kvf.NVFP4, dtype=torch.int64, device=device)

    def fill_group():
        buffer = table[:, :, 0]
        pm.k[buffer] = torch.randn(*buffer.shape, 16, 128, generator=g).to(device, torch.bfloat16)
        pm.v[buffer] = torch.randn(*buffer.shape, 16, 128, generator=g).to(device, torch.bfloat16)
        pm.valid[buffer] = True
        pm.position[buffer] = torch.arange(16, device=device)

    if holes:  # earlier groups, then evictions
        for _ in range(columns - 1):
            fill_group()
            tbq_store.flush(pm, table, fmt)
        quantized = table[:, :, 1:]
        pm.valid[quantized] &= (torch.rand(*quantized.shape, 16, generator=g) < 0.67).to(device)
    fill_group()
    return pm, table, fmt


def timed(flush, rows, layers, heads, columns, device, holes, repeat) -> float:
    times = []
    for i in range(repeat):
        pm, table, fmt = state(rows, layers, heads, columns, device, holes, seed=i)
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        flush(pm, table, fmt)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return round(1000 * min(times), 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--columns", type=int, default=4, help="quantized pages per (layer, head)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--skip-reference", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(1)
    from helpers.tbq_reference import flush_rows_per_token

    def reference(pm, table, fmt):
        return torch.cat([flush_rows_per_token(pm, table[i:i + 128], fmt[i:i + 128])
                          for i in range(0, table.shape[0], 128)])

    results = []
    for holes in (False, True):
        shape = (args.rows, args.layers, args.heads, args.columns, args.device, holes, args.repeat)
        entry = {"destinations": "pages with holes" if holes else "empty pages",
                 "flush_ms": timed(tbq_store.flush, *shape)}
        if not args.skip_reference:
            entry["per_token_reference_ms"] = timed(reference, *shape)
            entry["speedup"] = round(entry["per_token_reference_ms"] / entry["flush_ms"], 1)
        results.append(entry)
        print(json.dumps(entry), flush=True)
    if args.out:
        name = torch.cuda.get_device_name() if args.device == "cuda" else f"{platform.machine()}, 1 torch thread"
        doc = {"date_utc": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M"), "machine": name,
               "command": "python bench/tbq_flush.py " + " ".join(sys.argv[1:]),
               "rows": args.rows, "layers": args.layers, "heads": args.heads, "columns": args.columns,
               "results": results}
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
