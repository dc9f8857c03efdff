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
3. The extend kernel (kernels/extend_attention.py, R1-Distill-Qwen-7B
   shapes, bf16): correctness of the output and of the observation window's
   attention mass per region slot against attend_rows (fp32, in query blocks
   as radix_ext/backend.py's reference path runs it), then timings of chunks
   of 512-2048 private tokens over prefixes of 0-4K: the kernel alone, with a
   64-query observation window and with the whole chunk observed, a small
   tile sweep, SGLang's own triton extend kernel on the same tokens and the
   PyTorch reference path; FLOPs and bytes per case.
Medians of CUDA-event timings. Writes OUT_DIR/gpu-kernels.json
(OUT_DIR/gpu-kernels-extend.json with `--cases extend`).

    python bench/kernel_check.py OUT_DIR [--quick] [--cases decode,extend]
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
from kvsieve.kernels import extend_attention as extend_module
from kvsieve.kernels.extend_attention import extend_attention
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
    # (block, warps, stages): block 32 with 4 warps was the fastest at every shape of a wider sweep on an H100
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


# ----- the extend kernel (kernels/extend_attention.py) ---------------------------------
EXTEND_MODEL = "r1-distill-qwen-7b"
#: Timing grid: rows x private chunk x shared prefix (all rows alike, first chunk of the prompt).
EXTEND_ROWS = 8
EXTEND_CHUNKS = [512, 1024, 2048]
EXTEND_PREFIXES = [0, 1024, 4096]
EXTEND_WINDOW = 64  # an observation window as snapkv's
#: (block_m, block_n, warps, stages) tried per case; the first is the kernel's default.
EXTEND_TUNINGS = [(extend_module.BLOCK_M, extend_module.BLOCK_N, 8, 2), (128, 64, 8, 3), (128, 32, 8, 2),
                  (64, 64, 8, 2), (64, 32, 4, 2)]
#: Queries per attend_rows call in the reference (radix_ext/backend.py's EXTEND_QUERY_BLOCK).
REFERENCE_QUERY_BLOCK = 256


def gemm_tflops() -> float:
    """A bf16 8K x 8K x 8K matmul: the compute ceiling the extend kernel is held to."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn_like(a)
    ms = median_ms(lambda: a @ b)
    del a, b
    return 2 * 8192**3 / ms / 1e9


def extend_case(Hq, Hkv, chunks, prefixes, earlier, seed=0, density=1.0):
    """A compressed extend as radix_ext/backend.py hands it to the kernel. Row
    r: prefixes[r] shared tokens in a token pool; earlier[r] private tokens of
    earlier chunks (a `density` share of them still valid) and the chunks[r]
    tokens of this chunk in its region slots, slot j at position prefix + j
    (the chunk's own K/V already written, as the backend does before
    attending), in shuffled pages."""
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(seed)
    R, T = len(chunks), max(chunks)
    used = [e + n for e, n in zip(earlier, chunks)]
    M = -(-max(used) // PAGE)
    S = M * PAGE
    pages = R * Hkv * M
    region_k = torch.randn(pages + 1, PAGE, D, device=dev, dtype=torch.bfloat16, generator=g)  # + the null page
    region_v = torch.randn(pages + 1, PAGE, D, device=dev, dtype=torch.bfloat16, generator=g)
    table = torch.randperm(pages, device=dev, generator=g).view(R, Hkv, M)
    slot = torch.arange(S, device=dev)
    prefix_t = torch.tensor(prefixes, device=dev).view(R, 1, 1)
    earlier_t = torch.tensor(earlier, device=dev).view(R, 1, 1)
    used_t = torch.tensor(used, device=dev).view(R, 1, 1)
    kept = torch.rand(R, Hkv, S, device=dev, generator=g) < density
    valid = torch.zeros(pages + 1, PAGE, dtype=torch.bool, device=dev)
    position = torch.full((pages + 1, PAGE), -1, dtype=torch.int64, device=dev)
    valid[table] = ((slot < used_t) & ((slot >= earlier_t) | kept)).view(R, Hkv, M, PAGE)
    position[table] = torch.where(slot < used_t, prefix_t + slot, -1).expand(R, Hkv, S).reshape(R, Hkv, M, PAGE)
    pool = max(sum(prefixes), 1)
    pool_k = torch.randn(pool, Hkv, D, device=dev, dtype=torch.bfloat16, generator=g)
    pool_v = torch.randn(pool, Hkv, D, device=dev, dtype=torch.bfloat16, generator=g)
    prefix_slots = torch.randint(0, pool, (R, max(prefixes)), device=dev, generator=g)
    col = torch.arange(T, device=dev).unsqueeze(0)
    n = torch.tensor(chunks, device=dev).unsqueeze(1)
    query_pos = torch.where(col < n, (prefix_t + earlier_t).view(R, 1) + col, -1)
    q = torch.randn(R, T, Hq, D, device=dev, dtype=torch.bfloat16, generator=g)
    return dict(q=q, query_pos=query_pos, pool_k=pool_k, pool_v=pool_v, prefix_slots=prefix_slots,
                prefix_len=torch.tensor(prefixes, dtype=torch.int64, device=dev), region_k=region_k,
                region_v=region_v, region_valid=valid, region_position=position, table=table)


def observe_window(case, window):
    """The last `window` queries of each row (None: all of them)."""
    pos = case["query_pos"]
    real = pos >= 0
    n = real.sum(1, keepdim=True)
    col = torch.arange(pos.shape[1], device=pos.device).unsqueeze(0)
    return real if window is None else real & (col >= n - window)


def extend_reference(case, observe, scale, upcast=True):
    """attend_rows in query blocks with the mask the backend's reference path
    builds: fp32 from the bf16 inputs (upcast), or as the backend runs it."""
    R, P = case["prefix_slots"].shape
    table = case["table"]
    Hkv, M = table.shape[1:]
    S = M * PAGE
    cast = (lambda x: x.float()) if upcast else (lambda x: x)
    prefix_mask = torch.arange(P, device="cuda").unsqueeze(0) < case["prefix_len"].unsqueeze(1)
    pk, pv = cast(case["pool_k"][case["prefix_slots"]]), cast(case["pool_v"][case["prefix_slots"]])
    rk = cast(case["region_k"][table].reshape(R, Hkv, S, D))
    rv = cast(case["region_v"][table].reshape(R, Hkv, S, D))
    valid = case["region_valid"][table].reshape(R, Hkv, S)
    position = case["region_position"][table].reshape(R, Hkv, S)
    q = cast(case["q"])
    out = torch.empty(q.shape, dtype=q.dtype, device="cuda")
    attention = torch.zeros(R, Hkv, S, dtype=torch.float32, device="cuda")
    for b in range(0, q.shape[1], REFERENCE_QUERY_BLOCK):
        pos = case["query_pos"][:, b:b + REFERENCE_QUERY_BLOCK]
        mask = valid.unsqueeze(1) & (position.unsqueeze(1) <= pos.view(R, -1, 1, 1)) & (pos >= 0).view(R, -1, 1, 1)
        o, obs = attention_ref.attend_rows(q[:, b:b + REFERENCE_QUERY_BLOCK], pk, pv, prefix_mask, rk, rv, mask,
                                           scale, Need.ATTENTION, observe=observe[:, b:b + REFERENCE_QUERY_BLOCK])
        out[:, b:b + REFERENCE_QUERY_BLOCK] = o
        attention += obs.attention
    return out, attention


def visible_pairs(case, queries):
    """(query, key) pairs the softmax covers per kv head, over `queries`
    ([R, T] bool): prefix and region separately (averaged over kv heads)."""
    R = case["q"].shape[0]
    table = case["table"]
    Hkv, M = table.shape[1:]
    valid = case["region_valid"][table].reshape(R, Hkv, M * PAGE)
    position = case["region_position"][table].reshape(R, Hkv, M * PAGE)
    keys = torch.where(valid, position, torch.iinfo(torch.int64).max).sort(-1).values
    qpos = case["query_pos"].unsqueeze(1).expand(R, Hkv, -1).contiguous()
    seen = torch.searchsorted(keys, qpos, right=True) * queries.unsqueeze(1)
    prefix = (queries.sum(1) * case["prefix_len"]).sum().item()
    return prefix, seen.sum().item() / Hkv


def extend_correctness(checks: list, save) -> list:
    cases = [  # model, chunks, prefixes, earlier, density, window
        (EXTEND_MODEL, [2048, 512, 1024, 1536], [0, 4096, 1024, 2048], [0, 0, 512, 0], 0.8, EXTEND_WINDOW),
        (EXTEND_MODEL, [512, 2048], [4096, 0], [1536, 0], 0.6, None),
        (EXTEND_MODEL, [100, 7, 333], [7, 0, 4000], [3, 0, 20], 1.0, 16),
        ("llama-3.1-8b", [100, 7, 333], [7, 0, 4000], [3, 0, 20], 0.7, None),
    ]
    scale = D ** -0.5
    for model, chunks, prefixes, earlier, density, window in cases:
        Hq, Hkv = SHAPES[model]
        case = extend_case(Hq, Hkv, chunks, prefixes, earlier, seed=sum(chunks), density=density)
        observe = observe_window(case, window)
        poison()
        out, attention = extend_attention(**case, scale=scale, observe=observe)
        plain, _ = extend_attention(**case, scale=scale)
        ref_out, ref_attention = extend_reference(case, observe, scale)
        real = case["query_pos"] >= 0
        errors = {
            "out": (out[real].float() - ref_out[real]).abs().max().item(),
            "attention": (attention - ref_attention).abs().max().item(),
            "attention_rel": ((attention - ref_attention).abs().max() / ref_attention.abs().max().clamp(min=1)).item(),
        }
        finite = bool(torch.isfinite(out).all() and torch.isfinite(attention).all())
        padding_zero = bool((out[~real] == 0).all())
        same_without_observations = bool(torch.equal(out, plain))
        # bf16 inputs and output: the output is rounded to bf16; the masses
        # come from fp32 logits of bf16 products in both.
        ok = finite and padding_zero and same_without_observations and errors["out"] < 3e-2 \
            and errors["attention_rel"] < 1e-3
        checks.append({"model": model, "chunks": chunks, "prefixes": prefixes, "earlier": earlier,
                       "density": density, "window": window, "max_abs_error": errors, "finite": finite,
                       "padding_zero": padding_zero, "same_without_observations": same_without_observations,
                       "ok": ok})
        save()
        print(json.dumps(checks[-1]), flush=True)
        del case, observe, out, attention, plain, ref_out, ref_attention
        torch.cuda.empty_cache()
    return checks


def sglang_extend_case(case):
    """The same queries, prefix and chunk through SGLang's triton extend
    kernel: the prefix in a token pool through kv_indices, the chunk's own
    K/V causal (what a vanilla row's prefill of these tokens costs)."""
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd

    R, T, Hq, _ = case["q"].shape
    Hkv = case["table"].shape[1]
    real = case["query_pos"] >= 0
    chunks = real.sum(1)
    N = int(chunks.sum().item())
    q = case["q"][real].contiguous()  # [N, Hq, D]
    k = torch.randn(N, Hkv, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    o = torch.empty_like(q)
    qo_indptr = torch.zeros(R + 1, dtype=torch.int32, device="cuda")
    qo_indptr[1:] = chunks.cumsum(0)
    kv_indptr = torch.zeros(R + 1, dtype=torch.int32, device="cuda")
    kv_indptr[1:] = case["prefix_len"].cumsum(0)
    cols = torch.arange(case["prefix_slots"].shape[1], device="cuda").unsqueeze(0)
    kv_indices = case["prefix_slots"][cols < case["prefix_len"].unsqueeze(1)].contiguous()
    max_len = int(chunks.max().item())

    def run():
        extend_attention_fwd(q, k, v, o, case["pool_k"], case["pool_v"], qo_indptr, kv_indptr, kv_indices, None,
                             True, None, max_len, 1.0, 1.0, D ** -0.5)

    return run


def extend_timings(copy_gbs: float, gemm_tflops_: float, quick: bool, rows: list, save) -> list:
    """One entry per (chunk, prefix) case, saved after each. FLOPs count the
    (query, key) pairs the softmax covers (2 x 2 x Hq x D each: QK^T and PV;
    the observation pass adds QK^T of the observed queries over the region);
    bytes count Q, O and every K/V once (compulsory), and an estimate of what
    the tiles stream (each query block reads its prefix and, causally, about
    half of the chunk's region slots)."""
    Hq, Hkv = SHAPES[EXTEND_MODEL]
    scale = D ** -0.5
    R = 4 if quick else EXTEND_ROWS
    for chunk in ([512, 2048] if quick else EXTEND_CHUNKS):
        for prefix in ([0, 4096] if quick else EXTEND_PREFIXES):
            case = extend_case(Hq, Hkv, [chunk] * R, [prefix] * R, [0] * R, seed=chunk + prefix)
            real = case["query_pos"] >= 0
            window = observe_window(case, EXTEND_WINDOW)
            prefix_pairs, region_pairs = visible_pairs(case, real)
            _, window_region_pairs = visible_pairs(case, window)
            flops = 4 * Hq * D * (prefix_pairs + region_pairs)
            q_bytes = int(real.sum().item()) * Hq * D * 2
            kv_bytes = R * (prefix + chunk) * Hkv * D * 2 * 2
            meta_bytes = R * Hkv * chunk * (1 + 8) + R * prefix * 8 + case["table"].numel() * 8
            g_pad = 1 << (Hq // Hkv - 1).bit_length()
            query_blocks = -(-chunk // max(1, extend_module.BLOCK_M // g_pad))
            streamed = 2 * q_bytes + meta_bytes + R * Hkv * D * 2 * 2 * query_blocks * (prefix + chunk / 2)
            compulsory = 2 * q_bytes + kv_bytes + meta_bytes
            entry = {"model": EXTEND_MODEL, "rows": R, "chunk": chunk, "prefix": prefix,
                     "useful_GFLOP": round(flops / 1e9, 2), "compulsory_MB": round(compulsory / 1e6, 1),
                     "streamed_MB_estimate": round(streamed / 1e6, 1),
                     "observe_window_GFLOP": round(2 * Hq * D * window_region_pairs / 1e9, 3),
                     "observe_all_GFLOP": round(2 * Hq * D * region_pairs / 1e9, 2)}
            best = None
            for block_m, block_n, warps, stages in EXTEND_TUNINGS:
                key = f"m{block_m}-n{block_n}-warps{warps}-stages{stages}"
                try:
                    ms = median_ms(lambda: extend_attention(**case, scale=scale, block_m=block_m, block_n=block_n,
                                                            num_warps=warps, num_stages=stages))
                except Exception as err:  # e.g. out of shared memory for a tile: recorded, not fatal
                    entry.setdefault("tuning_errors", {})[key] = repr(err)[:200]
                    continue
                entry.setdefault("tuning_ms", {})[key] = round(ms, 4)
                if best is None or ms < best[1]:
                    best = ((block_m, block_n, warps, stages), ms)
            default = "m{}-n{}-warps{}-stages{}".format(*EXTEND_TUNINGS[0])
            ms = entry.get("tuning_ms", {}).get(default)
            if ms is not None:
                entry["kernel_ms"] = ms
                entry["kernel_TFLOPs"] = round(flops / ms / 1e9, 1)
                entry["kernel_share_of_gemm"] = round(flops / ms / 1e9 / gemm_tflops_, 3)
                entry["kernel_compulsory_share_of_copy_bw"] = round(compulsory / ms / 1e6 / copy_gbs, 3)
            if best is not None:
                entry["best"] = dict(zip(("block_m", "block_n", "warps", "stages"), best[0]))
                entry["best_ms"] = round(best[1], 4)
                entry["best_TFLOPs"] = round(flops / best[1] / 1e9, 1)
                block_m, block_n, warps, stages = best[0]
                for name, observe in (("window64", window), ("whole_chunk", real)):
                    ms = median_ms(lambda: extend_attention(**case, scale=scale, observe=observe, block_m=block_m,
                                                            block_n=block_n, num_warps=warps, num_stages=stages))
                    entry.setdefault("observed_ms", {})[name] = round(ms, 4)
                    entry.setdefault("observation_overhead", {})[name] = round(ms / best[1] - 1, 3)
            try:
                ms = median_ms(sglang_extend_case(case))
                entry["sglang_triton_ms"] = round(ms, 4)
                entry["sglang_triton_TFLOPs"] = round(flops / ms / 1e9, 1)
            except Exception as err:  # recorded, not fatal: the kernel's own numbers stand
                entry["sglang_triton_error"] = repr(err)[:300]
            torch.cuda.empty_cache()
            try:  # the path the kernel replaces: attend_rows in query blocks, bf16 in, fp32 inside
                torch.cuda.reset_peak_memory_stats()
                ms = median_ms(lambda: extend_reference(case, window, scale, upcast=False), iters=5, warmup=1)
                entry["torch_reference_ms"] = round(ms, 3)
                # Peak allocated while it ran (the case's own buffers included).
                entry["torch_reference_peak_GB"] = round(torch.cuda.max_memory_allocated() / 1e9, 2)
            except torch.cuda.OutOfMemoryError as err:
                entry["torch_reference_error"] = repr(err)[:200]
            del case, real, window
            torch.cuda.empty_cache()
            rows.append(entry)
            save()
            print(json.dumps({k: v for k, v in entry.items() if k != "tuning_ms"}), flush=True)
    return rows


def main() -> None:
    out_dir = sys.argv[1]
    quick = "--quick" in sys.argv[2:]
    cases = {"decode", "extend"}
    if "--cases" in sys.argv[2:]:
        cases = set(sys.argv[sys.argv.index("--cases") + 1].split(","))
    results = {"device": torch.cuda.get_device_name(0), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "command": "python bench/kernel_check.py " + " ".join(sys.argv[1:]),
               "block_n": kernel_module.BLOCK_N, "page_size": PAGE, "head_dim": D, "dtype": "bfloat16"}
    name = "gpu-kernels.json" if "decode" in cases else "gpu-kernels-extend.json"

    def save():
        with open(os.path.join(out_dir, name), "w") as f:
            json.dump(results, f, indent=1)

    results["copy_GBps"] = round(copy_bandwidth(), 1)
    print("copy bandwidth", results["copy_GBps"], "GB/s", flush=True)
    if "decode" in cases:
        results["correctness"] = correctness()
        save()
        results["timings"] = []
        timings(results["copy_GBps"], quick, results["timings"], save)
        save()
    if "extend" in cases:
        results["gemm_TFLOPs"] = round(gemm_tflops(), 1)
        print("bf16 GEMM", results["gemm_TFLOPs"], "TFLOP/s", flush=True)
        results["extend"] = {"block_m": extend_module.BLOCK_M, "block_n": extend_module.BLOCK_N,
                             "correctness": [], "timings": []}
        extend_correctness(results["extend"]["correctness"], save)
        extend_timings(results["copy_GBps"], results["gemm_TFLOPs"], quick, results["extend"]["timings"], save)
        save()


if __name__ == "__main__":
    main()
