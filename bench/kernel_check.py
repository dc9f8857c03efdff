"""Check and time the Triton decode-attention kernel on a GPU, in one call:

    python bench/kernel_check.py OUT_DIR [--quick]

1. Correctness at real shapes (R1-Distill-Qwen-7B: 28 query / 4 kv heads,
   Llama-3.1-8B: 32 / 8, head_dim 128), bf16, fresh random inputs, outputs
   poisoned with NaN before each call (a slot the kernel forgets to write
   shows), against the PyTorch reference (kernels/attention_ref.py) in fp32.
2. Achieved bandwidth of the kernel (bytes it must move: every key and value
   of every row once, plus valid bits and page-table entries) at batch
   64-512 and 1K-32K tokens per row, all in the compressed region, against
   the host's copy bandwidth (a device-to-device copy) and against SGLang's
   own triton decode kernel over the same number of tokens in its token
   pool; the cost of the fused observations over attention alone.
Medians of CUDA-event timings. Writes OUT_DIR/gpu-kernels.json.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from kvsieve.kernels import attention_ref
from kvsieve.kernels import decode_attention as kernel_module
from kvsieve.kernels.decode_attention import decode_attention
from kvsieve.policies import Need

SHAPES = {"r1-distill-qwen-7b": (28, 4), "llama-3.1-8b": (32, 8)}
D = 128
PAGE = 16
BATCHES = [64, 128, 256, 512]
TOKENS = [1024, 4096, 16384, 32768]
MAX_KV_BYTES = 24 * 2**30  # one layer's K+V per case (the SGLang comparison allocates the same again)
OBSERVED = {"attention": Need.ATTENTION, "attention+pv_norm": Need.ATTENTION | Need.PV_NORM,
            "all (with sparsity)": Need.ATTENTION | Need.PV_NORM | Need.SPARSITY}


def median_ms(fn, iters=20, warmup=3) -> float:
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
    times.sort()
    return times[len(times) // 2]


def copy_bandwidth() -> float:
    """Device-to-device copy, GB/s counting the read and the write."""
    src = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    del src, dst
    return 2 * 2 * 2**30 / ms / 1e6


def poison():
    """Fill the caching allocator's free memory with NaN, so outputs the
    kernel allocates with torch.empty start as NaN."""
    free = torch.cuda.mem_get_info()[0]
    blob = torch.full((int(free * 0.5) // 4,), float("nan"), dtype=torch.float32, device="cuda")
    del blob


def region_case(R, Hq, Hkv, N, prefix=0, seed=0, density=1.0):
    """Every row's N private tokens in region pages (shuffled page order),
    `prefix` shared tokens in a token pool."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    M = -(-N // PAGE)
    pages = R * Hkv * M
    region_k = torch.randn(pages + 1, PAGE, D, device="cuda", dtype=torch.bfloat16, generator=g)
    region_v = torch.randn(pages + 1, PAGE, D, device="cuda", dtype=torch.bfloat16, generator=g)
    valid = torch.zeros(pages + 1, PAGE, dtype=torch.bool, device="cuda")
    valid[:-1].view(-1)[:] = torch.rand(pages * PAGE, device="cuda", generator=g) < density
    table = torch.randperm(pages, device="cuda", generator=g).view(R, Hkv, M)
    pool = max(prefix * 2, 1)
    pool_k = torch.randn(pool, Hkv, D, device="cuda", dtype=torch.bfloat16, generator=g)
    pool_v = torch.randn(pool, Hkv, D, device="cuda", dtype=torch.bfloat16, generator=g)
    prefix_slots = torch.randint(0, pool, (R, prefix), device="cuda", generator=g)
    prefix_len = torch.randint(0, prefix + 1, (R,), device="cuda", generator=g) if prefix else \
        torch.zeros(R, dtype=torch.int64, device="cuda")
    q = torch.randn(R, Hq, D, device="cuda", dtype=torch.bfloat16, generator=g)
    return dict(q=q, pool_k=pool_k, pool_v=pool_v, prefix_slots=prefix_slots, prefix_len=prefix_len,
                region_k=region_k, region_v=region_v, region_valid=valid, table=table)


def reference(case, scale, needs):
    R, P = case["prefix_slots"].shape
    table = case["table"]
    Hkv, M = table.shape[1:]
    prefix_mask = torch.arange(P, device="cuda").unsqueeze(0) < case["prefix_len"].unsqueeze(1)
    rk = case["region_k"][table].reshape(R, Hkv, M * PAGE, D).float()
    rv = case["region_v"][table].reshape(R, Hkv, M * PAGE, D).float()
    mask = case["region_valid"][table].reshape(R, 1, Hkv, M * PAGE)
    pk = case["pool_k"][case["prefix_slots"]].float()
    pv = case["pool_v"][case["prefix_slots"]].float()
    out, obs = attention_ref.attend_rows(case["q"].float().unsqueeze(1), pk, pv, prefix_mask, rk, rv, mask, scale,
                                         needs)
    return out[:, 0], obs


def correctness() -> list[dict]:
    checks = []
    all_needs = Need.ATTENTION | Need.PV_NORM | Need.SPARSITY
    for model, (Hq, Hkv) in SHAPES.items():
        for R, N, prefix, density in [(64, 1024, 128, 0.8), (16, 4096, 512, 0.6), (3, 100, 7, 1.0)]:
            case = region_case(R, Hq, Hkv, N, prefix=prefix, seed=R + N, density=density)
            scale = D ** -0.5
            poison()
            vnorm = case["region_v"].float().abs().sum(-1)
            out, obs = decode_attention(**case, scale=scale, needs=all_needs, region_vnorm=vnorm)
            ref_out, ref = reference(case, scale, all_needs)
            errors = {
                "out": (out.float() - ref_out).abs().max().item(),
                "attention": (obs.attention - ref.attention).abs().max().item(),
                "pv_norm_rel": ((obs.pv_norm - ref.pv_norm).abs() / ref.pv_norm.abs().clamp(min=1)).max().item(),
                "sparsity": (obs.sparsity - ref.sparsity).abs().max().item(),
            }
            finite = bool(torch.isfinite(out).all() and torch.isfinite(obs.attention).all())
            # bf16 inputs and output: the output is rounded to bf16 (8 bits);
            # probabilities come from fp32 logits of bf16 products.
            # Observations come from fp16 logits relative to their block's max.
            ok = finite and errors["out"] < 3e-2 and errors["attention"] < 1e-3 and errors["pv_norm_rel"] < 1e-2 \
                and errors["sparsity"] < 2e-2
            checks.append({"model": model, "rows": R, "region_tokens": N, "prefix": prefix, "density": density,
                           "max_abs_error": errors, "finite": finite, "ok": ok})
            print(json.dumps(checks[-1]), flush=True)
    return checks


def sglang_case(R, Hq, Hkv, N):
    """The same tokens in a token pool read by SGLang's triton decode kernel."""
    from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd

    k = torch.randn(R * N, Hkv, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(R * N, Hkv, D, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(R, Hq, D, device="cuda", dtype=torch.bfloat16)
    o = torch.empty(R, Hq, D, device="cuda", dtype=torch.bfloat16)
    indptr = torch.arange(0, (R + 1) * N, N, device="cuda", dtype=torch.int32)
    indices = torch.randperm(R * N, device="cuda").to(torch.int32)
    splits = 16
    logits = torch.empty(R, Hq, splits, D, device="cuda", dtype=torch.float32)
    lse = torch.empty(R, Hq, splits, device="cuda", dtype=torch.float32)
    num_splits = torch.full((R,), splits, device="cuda", dtype=torch.int32)

    def run():
        decode_attention_fwd(q, k, v, o, indptr, indices, logits, lse, num_splits, splits, D ** -0.5, 1.0, 1.0)

    return run, (k, v)


def timings(copy_gbs: float, quick: bool, rows: list, save) -> list[dict]:
    """Appends one entry per case to `rows`, saving after each."""
    # (block, warps, stages): round 2 found block 32, 4 warps best everywhere (bench/results/gpu-kernels-round2.json)
    tunings = [(32, 4, 2), (32, 4, 3)]
    for model, (Hq, Hkv) in SHAPES.items():
        for R in BATCHES[:2] if quick else BATCHES:
            for N in TOKENS[:2] if quick else TOKENS:
                kv_bytes = R * Hkv * N * D * 2 * 2
                entry = {"model": model, "batch": R, "tokens_per_row": N, "kv_bytes": kv_bytes}
                if kv_bytes > MAX_KV_BYTES:
                    entry["skipped"] = f"K+V of one layer is {kv_bytes / 2**30:.0f} GiB (> {MAX_KV_BYTES >> 30} GiB)"
                    rows.append(entry)
                    save()
                    continue
                case = region_case(R, Hq, Hkv, N, seed=1)
                vnorm = case["region_v"].float().abs().sum(-1)
                moved = kv_bytes + case["region_valid"][:-1].numel() + case["table"].numel() * 8 + \
                    R * Hq * D * 2 * 2
                scale = D ** -0.5
                best = None
                for block, warps, stages in tunings:
                    for splits in [None, 8, 16]:
                        ms = median_ms(lambda: decode_attention(**case, scale=scale, num_splits=splits, block=block,
                                                                num_warps=warps, num_stages=stages))
                        key = f"block{block}-warps{warps}-stages{stages}-splits{splits or 'auto'}"
                        entry.setdefault("tuning_ms", {})[key] = round(ms, 4)
                        if best is None or ms < best[1]:
                            best = ((block, warps, stages, splits), ms)
                default_ms = entry["tuning_ms"]["block32-warps4-stages2-splitsauto"]
                entry["kernel_ms"] = default_ms
                entry["kernel_GBps"] = round(moved / default_ms / 1e6, 1)
                entry["kernel_share_of_copy_bw"] = round(moved / default_ms / 1e6 / copy_gbs, 3)
                entry["best"] = dict(zip(("block", "warps", "stages", "splits"), best[0]))
                entry["best_ms"] = round(best[1], 4)
                entry["best_GBps"] = round(moved / best[1] / 1e6, 1)
                entry["best_share_of_copy_bw"] = round(moved / best[1] / 1e6 / copy_gbs, 3)
                block, warps, stages, splits = best[0]
                for name, needs in OBSERVED.items():
                    ms = median_ms(lambda: decode_attention(**case, scale=scale, needs=needs, region_vnorm=vnorm,
                                                            num_splits=splits, block=block, num_warps=warps,
                                                            num_stages=stages))
                    entry.setdefault("observed_ms", {})[name] = round(ms, 4)
                    entry.setdefault("observation_overhead", {})[name] = round(ms / best[1] - 1, 3)
                del case, vnorm
                torch.cuda.empty_cache()
                if R * N * Hkv * D >= 2**31:
                    # SGLang's decode kernel indexes its buffers with int32 offsets
                    # (an illegal address at 256 x 32K tokens in the first round).
                    entry["sglang_triton_skipped"] = "buffer of >= 2^31 elements: int32 offsets in SGLang's kernel"
                else:
                    try:
                        run, buffers = sglang_case(R, Hq, Hkv, N)
                        ms = median_ms(run)
                        entry["sglang_triton_ms"] = round(ms, 4)
                        entry["sglang_triton_GBps"] = round((kv_bytes + R * N * 4) / ms / 1e6, 1)
                        entry["sglang_triton_share_of_copy_bw"] = round((kv_bytes + R * N * 4) / ms / 1e6 / copy_gbs,
                                                                        3)
                        del buffers, run
                    except Exception as err:  # recorded, not fatal: the kernel's own numbers stand
                        entry["sglang_triton_error"] = repr(err)[:300]
                torch.cuda.empty_cache()
                rows.append(entry)
                save()
                print(json.dumps({k: v for k, v in entry.items() if k != "tuning_ms"}), flush=True)
    return rows


def main() -> None:
    out_dir = sys.argv[1]
    quick = "--quick" in sys.argv[2:]
    results = {"device": torch.cuda.get_device_name(0), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "command": "python bench/kernel_check.py " + " ".join(sys.argv[1:]),
               "block_n": kernel_module.BLOCK_N, "page_size": PAGE, "head_dim": D, "dtype": "bfloat16"}

    def save():
        with open(os.path.join(out_dir, "gpu-kernels.json"), "w") as f:
            json.dump(results, f, indent=1)

    results["copy_GBps"] = round(copy_bandwidth(), 1)
    print("copy bandwidth", results["copy_GBps"], "GB/s", flush=True)
    results["correctness"] = correctness()
    save()
    results["timings"] = []
    timings(results["copy_GBps"], quick, results["timings"], save)
    save()


if __name__ == "__main__":
    main()
