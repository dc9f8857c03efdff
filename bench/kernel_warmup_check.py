"""Does the start-up warm-up (radix_ext/kernel_warmup.py) leave any decode
kernel variant to compile mid-serving? In a fresh process on a GPU: the
warm-up on a region at a 7B model's attention shapes, then a sweep of the
decode attention as serving steps launch it (every combination of
observations, with and without other needs, rows of mixed observation
bits, 16-144 rows, page tables 1-80 columns wide as the region grows,
prefixes of 0-2,048 tokens, per-row tensors 8 bytes off alignment, first
and later layers' bit shifts), counting the compiled variants of each
kernel before and after the sweep.

    python bench/kernel_warmup_check.py [--out result.json]

Then LongFlow's select kernel (warm_up_select, then a sweep of group
widths 1-512 columns of 16 slots: 16-8,192 slots, 1-144 rows).

Exit 1 when the sweep compiled a decode or select variant the warm-up did
not (LongFlow's fused attention kernels compile per tile size and are
reported apart).
Run by tests_gpu/test_kernel_warmup_cuda.py in a process of its own."""

from __future__ import annotations

import argparse
import json
import sys

import torch

from kvsieve.kernels import decode_attention as da
from kvsieve.kernels import longflow_fused
from kvsieve.policies import Need
from kvsieve.radix_ext import kernel_warmup
from kvsieve.radix_ext.pages import PageManager, RegionConfig
from kvsieve.radix_ext.step_meta import LATER_LAYERS_SHIFT, observe_bits_of

LAYERS, KV_HEADS, Q_HEADS, HEAD_DIM, PAGE = 4, 4, 28, 128, 16
DECODE = {"_partial_kernel": da._partial_kernel, "_merge_kernel": da._merge_kernel,
          "_observe_kernel": da._observe_kernel}


def variants(kernel) -> int:
    return sum(len(cache[0]) for cache in kernel.device_caches.values())


def fused_kernels() -> dict:
    return {name: k for name, k in vars(longflow_fused).items() if hasattr(k, "device_caches")}


def unaligned(values: torch.Tensor) -> torch.Tensor:
    """The same values in a view 8 bytes past a 16-byte boundary (as a step's shipped per-row views may be)."""
    flat = torch.zeros(values.numel() + 16, dtype=values.dtype, device=values.device)
    step = 8 // values.element_size()
    view = flat[step:step + values.numel()]
    view.copy_(values)
    return view


def sweep(pages, pool_k, pool_v) -> int:
    dev = pages.k.device
    launches = 0
    for columns in (1, 4, 8, 20, 36, 80):
        pages.ensure_width(columns)
        for rows in (16, 48, 144):
            q = torch.randn(rows, Q_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=dev)
            table = pages.table[torch.zeros(rows, dtype=torch.int64, device=dev), :, :, :columns]
            for prefix in (0, 128, 2048):
                slots = torch.zeros((rows, prefix), dtype=torch.int64, device=dev)
                lens = unaligned(torch.full((rows,), prefix // 2, dtype=torch.int64, device=dev))
                row_columns = unaligned(torch.full((rows,), columns, dtype=torch.int32, device=dev))
                for needs in kernel_warmup.need_sets():
                    for extra in (Need.NONE, Need.KEYS):
                        bits = observe_bits_of(needs)
                        observe = unaligned(torch.tensor([bits if i % 3 else 0 for i in range(rows)],
                                                         dtype=torch.int32, device=dev))
                        for layer, shift in ((0, 0), (1, LATER_LAYERS_SHIFT)):
                            da.decode_attention(q, pool_k, pool_v, slots, lens, pages.k, pages.v, pages.valid,
                                                table[:, layer], HEAD_DIM ** -0.5, needs | extra,
                                                region_vnorm=pages.vnorm, quant=pages.quant, formats=pages.format,
                                                row_columns=row_columns, row_observe=observe, observe_shift=shift)
                            launches += 1
    torch.cuda.synchronize()
    return launches


def select_sweep(pages) -> int:
    """longflow_select as policies/longflow.fused_victim launches it: kv
    head 0's views of a group's per-slot tensors, every group width in
    columns a step may pad to (step_meta.width_bucket) up to FUSED_MAX_SLOTS."""
    from kvsieve.policies.longflow import FUSED_MAX_SLOTS
    from kvsieve.radix_ext.step_meta import width_bucket

    dev, heads = pages.k.device, pages.table.shape[2]
    widths = sorted({width_bucket(c) for c in range(1, FUSED_MAX_SLOTS // PAGE + 1)
                     if width_bucket(c) * PAGE <= FUSED_MAX_SLOTS} | {1, 3, 7})
    launches = 0
    for columns in widths:
        slots = columns * PAGE
        for rows in (1, 16, 144):
            pv = torch.rand((rows, heads, slots), device=dev)
            valid = torch.rand((rows, heads, slots), device=dev) > 0.5
            position = torch.arange(slots, device=dev).expand(rows, heads, slots).contiguous()
            protect = torch.ones(rows, dtype=torch.int32, device=dev)
            longflow_fused.longflow_select(pv, valid[:, 0], position[:, 0], protect)
            launches += 1
    torch.cuda.synchronize()
    return launches


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    pages = PageManager(RegionConfig(num_layers=LAYERS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, num_pages=4096,
                                     page_size=PAGE, dtype=torch.bfloat16, device="cuda", max_rows=160))
    pool_k = torch.zeros(8192, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    pool_v = torch.zeros_like(pool_k)
    before = {name: variants(k) for name, k in DECODE.items()}
    launches = kernel_warmup.warm_up_decode(pages, pool_k, pool_v, Q_HEADS, torch.bfloat16)
    warmed = {name: variants(k) for name, k in DECODE.items()}
    fused_warm = {name: variants(k) for name, k in fused_kernels().items()}
    select = longflow_fused._select_kernel
    select_launches = kernel_warmup.warm_up_select(pages)
    select_warm = variants(select)
    swept = sweep(pages, pool_k, pool_v)
    after = {name: variants(k) for name, k in DECODE.items()}
    select_swept = select_sweep(pages)
    result = {"device": torch.cuda.get_device_name(), "warmup_launches": launches, "sweep_launches": swept,
              "variants_before": before, "variants_after_warmup": warmed, "variants_after_sweep": after,
              "new_in_sweep": {name: after[name] - warmed[name] for name in DECODE if after[name] != warmed[name]},
              "select_warmup_launches": select_launches, "select_sweep_launches": select_swept,
              "select_variants_after_warmup": select_warm,
              "select_new_in_sweep": variants(select) - select_warm,
              "fused_new_in_sweep": {name: variants(k) - fused_warm[name] for name, k in fused_kernels().items()
                                     if variants(k) != fused_warm[name]}}
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    sys.exit(1 if result["new_in_sweep"] or result["select_new_in_sweep"] else 0)


if __name__ == "__main__":
    main()
