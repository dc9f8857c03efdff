"""Decode attention over quantized pages (TBQ) against bf16 pages at equal
token count, through the Triton decode kernel (kernels/decode_attention.py):

    python bench/tbq_kernel.py OUT_DIR [--quick] [--variant old,new] [--blocks 32,64]   # GPU
    TRITON_INTERPRET=1 python bench/tbq_kernel.py OUT_DIR --cpu                      # CPU: tiny shapes, checks only

`--variant` names the quantized paths to time, in the same run and on the
same pages (default both): "old" (a block is one 16-token page, a branch on
its format) and "new" (blocks of `--blocks` slots, each block's pages of any
formats; every block size listed is timed, default 32 and 64). Each
variant's correctness against the reference is checked first; the entry of
a mix holds one result per variant (key "old", "new32", "new64") and each
result's speedup over bf16; "new_over_old" compares the best of each.

Every row holds N private tokens per kv head: in bf16 pages, or in
quantized pages (one empty full-precision page per head, as a TBQ request
holds between two groups) of the mix R4E4T2 gives (about 2/3 NVFP4, 1/3
ternary: `--ternary-share`), all NVFP4, or all ternary. First a correctness
check of the kernel against the PyTorch reference on the pages dequantized
(kv_formats), then CUDA-event medians of the kernel alone and with thinkv's
observations (sparsity; 4 and 8 warps tried on quantized pages), at
R1-Distill-Qwen-7B (28 query / 4 kv heads) and Llama-3.1-8B (32 / 8) shapes, head_dim 128, batch 64-512, 1K-16K tokens per
row; speedup = bf16 time / quantized time, and the bytes each reads.
Writes OUT_DIR/gpu-kernels-tbq.json after every case.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from kvsieve.kernels import attention_ref
from kvsieve.kernels import kv_formats as kvf
from kvsieve.kernels.decode_attention import decode_attention
from kvsieve.policies import Need
from kvsieve.radix_ext.pages import PageManager, RegionConfig
from kvsieve.radix_ext.tbq_store import QuantPool

SHAPES = {"r1-distill-qwen-7b": (28, 4), "llama-3.1-8b": (32, 8)}
D = 128
PAGE = 16
BATCHES = [64, 128, 256, 512]
TOKENS = [1024, 4096, 16384]
MAX_KV_BYTES = 24 * 2**30  # bf16 K+V of one case
#: Warps per program tried on quantized pages (8 keeps the decode below 170
#: registers per thread on sm_90, 4 needs about 220; bench/kernel_compile_check.py --decode-tbq).
WARPS = (4, 8)
MIXES = {"R4E4T2": None, "nvfp4": 0.0, "ternary": 1.0}  # share of ternary pages (None: --ternary-share)


def timer(device):
    if device == "cuda":
        def median_ms(fn, iters=20, warmup=3):
            for _ in range(warmup):
                fn()
            times = []
            for _ in range(iters):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            return sorted(times)[len(times) // 2]
    else:
        def median_ms(fn, iters=1, warmup=0):
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
    return median_ms


def build(R, Hq, Hkv, N, ternary_share, device, seed=0, real_codes=False):
    """Two regions holding the same N tokens per (row, kv head): bf16 pages,
    and quantized pages (+ one empty full page per head). On CPU float32
    (Triton's interpreter has no bf16)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(seed)
    M = -(-N // PAGE)
    heads = R * Hkv
    bf = PageManager(RegionConfig(num_layers=1, num_kv_heads=Hkv, head_dim=D, num_pages=heads * M, page_size=PAGE,
                                  dtype=dtype, device=device, max_rows=R))
    bf.k[:-1] = torch.randn(heads * M, PAGE, D, device=device, generator=g).to(dtype)
    bf.v[:-1] = torch.randn(heads * M, PAGE, D, device=device, generator=g).to(dtype)
    bf.valid[:-1] = True
    bf_table = torch.randperm(heads * M, device=device, generator=g).view(R, Hkv, M)
    bf.vnorm[:-1] = bf.v[:-1].float().abs().sum(-1)

    qm = PageManager(RegionConfig(num_layers=1, num_kv_heads=Hkv, head_dim=D, num_pages=heads, page_size=PAGE,
                                  dtype=dtype, device=device, max_rows=R, quant_pages=heads * M, quant_bits=4))
    first = qm.quant.first
    quant_ids = first + torch.randperm(heads * M, device=device, generator=g)
    table = torch.cat([torch.arange(heads, device=device).view(R, Hkv, 1), quant_ids.view(R, Hkv, M)], dim=2)
    fmt = torch.where(torch.rand(heads * M, device=device, generator=g) < ternary_share, kvf.TERNARY, kvf.NVFP4)
    q = qm.quant
    if real_codes:  # quantized from data (correctness)
        k = torch.randn(heads * M, PAGE, D, device=device, generator=g)
        v = torch.randn(heads * M, PAGE, D, device=device, generator=g)
        q.write(torch.arange(heads * M, device=device),
                kvf.quantize_pages(k, v, torch.ones(heads * M, PAGE, dtype=torch.bool, device=device), fmt, 4))
    else:  # random codes and in-range scales (timing: the bytes are what counts)
        rows = slice(0, heads * M)
        q.k_codes[rows] = torch.randint(0, 256, q.k_codes[rows].shape, device=device, generator=g, dtype=torch.uint8)
        q.v_codes[rows] = torch.randint(0, 256, q.v_codes[rows].shape, device=device, generator=g, dtype=torch.uint8)
        q.k_scale[rows] = kvf.e4m3_encode(torch.rand(q.k_scale[rows].shape, device=device, generator=g) * 400 + 1)
        q.v_scale[rows] = kvf.e4m3_encode(torch.rand(q.v_scale[rows].shape, device=device, generator=g) * 400 + 1)
        q.page_scale[rows] = 1e-3
    qm.format[quant_ids] = fmt.to(torch.int8).view(-1)[quant_ids - first]
    qm.valid[quant_ids] = True
    qm.vnorm[quant_ids] = q.dequantize(qm, quant_ids)[1].abs().sum(-1) if real_codes else 1.0
    query = torch.randn(R, Hq, D, device=device, generator=g).to(dtype)
    empty = dict(pool_k=torch.zeros(1, Hkv, D, dtype=dtype, device=device),
                 pool_v=torch.zeros(1, Hkv, D, dtype=dtype, device=device),
                 prefix_slots=torch.zeros(R, 0, dtype=torch.int64, device=device),
                 prefix_len=torch.zeros(R, dtype=torch.int64, device=device))
    return query, empty, (bf, bf_table), (qm, table), fmt


def run_bf16(query, empty, pm, table, needs=Need.NONE):
    return decode_attention(query, empty["pool_k"], empty["pool_v"], empty["prefix_slots"], empty["prefix_len"],
                            pm.k, pm.v, pm.valid, table, D ** -0.5, needs, region_vnorm=pm.vnorm)


def run_quant(query, empty, qm, table, needs=Need.NONE, warps=4, variant="new", block=32):
    return decode_attention(query, empty["pool_k"], empty["pool_v"], empty["prefix_slots"], empty["prefix_len"],
                            qm.k, qm.v, qm.valid, table, D ** -0.5, needs, region_vnorm=qm.vnorm, quant=qm.quant,
                            formats=qm.format, num_warps=warps, variant=variant, block=block)


def variants_of(argv) -> dict:
    """Result key -> (variant, block) of the quantized paths to time."""
    names = argv[argv.index("--variant") + 1].split(",") if "--variant" in argv else ["old", "new"]
    blocks = [int(b) for b in argv[argv.index("--blocks") + 1].split(",")] if "--blocks" in argv else [32, 64]
    out = {}
    for name in names:
        if name == "old":
            out["old"] = ("old", PAGE)
        elif name == "new":
            out.update({f"new{b}": ("new", b) for b in blocks})
        else:
            raise SystemExit(f"unknown variant {name!r} (old, new)")
    return out


def correctness(device, variant="new", block=32) -> dict:
    R, (Hq, Hkv), N = 2, SHAPES["r1-distill-qwen-7b"], 256
    query, empty, _, (qm, table), _ = build(R, Hq, Hkv, N, 1 / 3, device, seed=3, real_codes=True)
    needs = Need.SPARSITY | Need.ATTENTION
    out, obs = run_quant(query, empty, qm, table, needs, variant=variant, block=block)
    k, v = qm.kv_of(table)
    S = table.shape[2] * PAGE
    ref, ref_obs = attention_ref.attend_rows(
        query.float().unsqueeze(1), torch.zeros(R, 0, Hkv, D, device=device), torch.zeros(R, 0, Hkv, D, device=device),
        torch.zeros(R, 0, dtype=torch.bool, device=device), k.float().reshape(R, Hkv, S, D),
        v.float().reshape(R, Hkv, S, D), qm.valid[table].reshape(R, 1, Hkv, S), D ** -0.5, needs)
    return {"max_abs_err_out": float((out.float() - ref[:, 0]).abs().max()),
            "max_abs_err_attention": float((obs.attention - ref_obs.attention).abs().max()),
            "max_abs_err_sparsity": float((obs.sparsity - ref_obs.sparsity).abs().max())}


def time_quant(median_ms, query, empty, quant, variant, block, entry) -> dict:
    """Median times of one quantized path (the faster warp count), alone and
    with sparsity, and its speedups over bf16."""
    by_warps = {w: median_ms(lambda: run_quant(query, empty, *quant, warps=w, variant=variant, block=block))
                for w in WARPS}
    warps = min(by_warps, key=by_warps.get)
    ms = by_warps[warps]
    ms_obs = median_ms(lambda: run_quant(query, empty, *quant, needs=Need.SPARSITY, warps=warps, variant=variant,
                                         block=block))
    return {"ms": round(ms, 4), "ms_by_warps": {w: round(t, 4) for w, t in by_warps.items()}, "warps": warps,
            "sparsity_ms": round(ms_obs, 4), "speedup": round(entry["bf16_ms"] / ms, 2),
            "speedup_with_sparsity": round(entry["bf16_sparsity_ms"] / ms_obs, 2)}


def main() -> None:
    out_dir = sys.argv[1]
    cpu = "--cpu" in sys.argv[2:]
    quick = "--quick" in sys.argv[2:] or cpu
    share = float(sys.argv[sys.argv.index("--ternary-share") + 1]) if "--ternary-share" in sys.argv else 1 / 3
    device = "cpu" if cpu else "cuda"
    median_ms = timer(device)
    results = {"device": "cpu (Triton interpreter: checks only, no timing)" if cpu else torch.cuda.get_device_name(0),
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "command": "python bench/tbq_kernel.py " + " ".join(sys.argv[1:]), "head_dim": D, "page_size": PAGE,
               "bytes_per_page": {"bf16": 2 * PAGE * D * 2, "quantized_4bit_row": QuantPool.bytes_per_page(D, PAGE, 4)},
               "read_bits_per_element": {"bf16": 16, "nvfp4": 4 + 8 / 16, "ternary": 2 + 8 / 16},
               "ternary_share_R4E4T2": share, "timings": []}
    path = os.path.join(out_dir, "gpu-kernels-tbq.json")

    def save():
        with open(path, "w") as f:
            json.dump(results, f, indent=1)

    variants = variants_of(sys.argv)
    results["variants"] = {key: {"variant": v, "block": b} for key, (v, b) in variants.items()}
    results["correctness"] = {key: correctness(device, v, b) for key, (v, b) in variants.items()}
    print("correctness", json.dumps(results["correctness"]), flush=True)
    save()
    bad = {key: c for key, c in results["correctness"].items() if c["max_abs_err_out"] > 2e-2}
    if bad:  # on the GPU the timings still come (the bytes read are the same); on CPU this is the check
        print("WRONG: quantized path differs from the reference:", json.dumps(bad), flush=True)
        if cpu:
            raise SystemExit(1)
    shapes = {"r1-distill-qwen-7b": SHAPES["r1-distill-qwen-7b"]} if cpu else SHAPES
    batches = [2] if cpu else (BATCHES[:2] if quick else BATCHES)
    tokens = [64] if cpu else (TOKENS[:2] if quick else TOKENS)
    for model, (Hq, Hkv) in shapes.items():
        for R in batches:
            for N in tokens:
                kv_bytes = R * Hkv * N * D * 2 * 2
                entry = {"model": model, "batch": R, "tokens_per_row": N, "bf16_kv_bytes": kv_bytes}
                if kv_bytes > MAX_KV_BYTES:
                    entry["skipped"] = f"bf16 K+V of one layer is {kv_bytes / 2**30:.0f} GiB"
                    results["timings"].append(entry)
                    save()
                    continue
                for mix, ternary in MIXES.items():
                    query, empty, bf, quant, _ = build(R, Hq, Hkv, N, share if ternary is None else ternary, device)
                    if "bf16_ms" not in entry:
                        entry["bf16_ms"] = round(median_ms(lambda: run_bf16(query, empty, *bf)), 4)
                        entry["bf16_sparsity_ms"] = round(
                            median_ms(lambda: run_bf16(query, empty, *bf, needs=Need.SPARSITY)), 4)
                    entry[mix] = {}
                    for key, (variant, block) in variants.items():
                        entry[mix][key] = time_quant(median_ms, query, empty, quant, variant, block, entry)
                    best = {v: min((r["ms"] for k, r in entry[mix].items() if variants[k][0] == v), default=None)
                            for v in ("old", "new")}
                    if best["old"] and best["new"]:
                        entry[mix]["new_over_old"] = round(best["old"] / best["new"], 2)
                    del query, empty, bf, quant
                    if device == "cuda":
                        torch.cuda.empty_cache()
                results["timings"].append(entry)
                save()
                print(json.dumps(entry), flush=True)
    save()


if __name__ == "__main__":
    main()
