"""LongFlow's decode step: today's three passes against the fused kernels
(kernels/longflow_fused.py), on one GPU, in one call:

    python3 bench/longflow_fused.py --out $OUT/longflow-fused.json

Per size (rows 64/256/640 by default; budget 1024 tokens, so 1,025 held
slots per head before the eviction in a 68-column page table of 16-slot
pages, as the engine lays out a row past its budget; 28 query / 4 kv heads,
head_dim 128, bf16; no shared prefix unless --prefix), one layer's step,
timed per variant as CUDA-event medians, eagerly and replayed from a CUDA
graph (the engine replays the compressed pass from graphs):

- `attention_only`: decode_attention without observations (the floor).
- `today`: decode_attention(Need.ATTENTION | Need.PV_NORM) - split-KV
  attention writing fp16 logits to a scratch buffer, the merge, the
  observation kernel - then LongFlow's decision in PyTorch as it was before
  the fused path (sum over heads, newest_mask, argmin, the eviction mask).
- `fused_observed`: the fused attention (one program per (row, kv head), no
  scratch, attention and pv_norm from its epilogue) then `longflow_select`
  (one kernel: sum over heads, the newest protected, min/argmin) and the
  eviction mask: what the engine runs now.
- `fused_one_kernel`: `longflow_decode` (one program per row: attention,
  score and argmin in one kernel) and the eviction mask.

Fused variants run over a small sweep of (block, warps, fp16 tile, stages),
the serving default first; the JSON keeps every configuration and names the
best. `passes` times each pass on its own (today's attention with its
observations, today's PyTorch decision, the merge kernel, the fused
attention with and without its observations). Checks per size: every
variant's victim slot per row against the fp32 PyTorch reference
(kernels/attention_ref.attend_rows; a mismatch is reported with its
relative score gap: a near tie, or a bug), today's against the fused ones,
the attention output against the reference. "x28" figures multiply one
layer's time by R1-Distill-Qwen-7B's 28 layers.

`--quick` runs the same code on CPU in Triton's interpreter at tiny sizes
(no timings worth reading; tests/test_longflow_fused_bench.py runs it).
Writes --out (JSON: device, date, command, versions, results).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
import types
from pathlib import Path

QUICK = "--quick" in sys.argv
if QUICK:  # before triton.language is imported anywhere
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _import_kvsieve():
    """kvsieve's kernels and observations, installed or from this checkout
    (on a bare GPU host the package is not installed: its folders are
    mapped without running policies/__init__.py, which needs pydantic)."""
    try:
        import kvsieve.kernels.longflow_fused  # noqa: F401
    except ImportError:
        for name in [m for m in sys.modules if m == "kvsieve" or m.startswith("kvsieve.")]:
            del sys.modules[name]
        for name, folder in (("kvsieve", "kvsieve"), ("kvsieve.policies", "policies"), ("kvsieve.kernels", "kernels")):
            module = types.ModuleType(name)
            module.__path__ = [str(ROOT / folder)]
            sys.modules[name] = module
    from kvsieve.kernels import attention_ref, decode_attention, longflow_fused
    from kvsieve.policies.observations import Need, newest_mask
    return attention_ref, decode_attention, longflow_fused, Need, newest_mask


attention_ref, decode_attention_module, lf, Need, newest_mask = _import_kvsieve()
decode_attention = decode_attention_module.decode_attention
OBSERVED = Need.ATTENTION | Need.PV_NORM
#: The fused kernels' sweep, block:warps:tile:stages: the serving default
#: (kernels/longflow_fused.py) first, then the runners-up of the sweeps on an
#: H100 and the former default block.
DEFAULT_CONFIGS = "128:4:fp32:2,64:4:fp32:3,128:4:fp16:2,32:4:fp32:2"


def make_case(R, budget, Hq, Hkv, D, page, prefix, dtype, device, seed, width_multiple=4):
    """One layer of R rows past their budget: budget + 1 valid slots per
    (row, kv head) (the new token stored), lined up across heads (the same
    positions in the same slots), in pages scattered over the region, a
    page-table width rounded up to `width_multiple` columns (the engine's
    rounding; the rest null pages). Positions: distinct per row, the new
    token the newest, the rest shuffled over the slots."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    held = budget + 1
    used = -(-held // page)
    M = -(-used // width_multiple) * width_multiple
    S = M * page
    pages = R * Hkv * used
    null_page = pages
    perm = torch.randperm(pages, generator=g)
    table = torch.full((R, Hkv, M), null_page, dtype=torch.int64)
    table[:, :, :used] = perm.view(R, Hkv, used)
    slot_valid = torch.arange(S) < held  # [S]
    # Token positions per row: prefix .. prefix + a span, the newest last-stored.
    position_of_slot = torch.full((R, S), -1, dtype=torch.int64)
    for r in range(R):
        span = prefix + torch.randperm(4 * held, generator=g)[:held - 1].sort().values
        newest = prefix + 4 * held
        order = torch.randperm(held - 1, generator=g)
        position_of_slot[r, :held - 1] = span[order]
        position_of_slot[r, held - 1] = newest
    region_valid = torch.zeros(pages + 1, page, dtype=torch.bool)
    region_position = torch.full((pages + 1, page), -1, dtype=torch.int64)
    flat = table[:, :, :used].reshape(R, Hkv, used)
    for h in range(Hkv):
        region_valid[flat[:, h]] = slot_valid[:used * page].view(used, page)
        region_position[flat[:, h]] = position_of_slot[:, :used * page].view(R, used, page)
    pool_slots = max(1, R * prefix) + 1
    prefix_slots = torch.randperm(pool_slots - 1, generator=g)[:R * prefix].view(R, prefix) + 1
    case = dict(prefix_slots=prefix_slots, prefix_len=torch.full((R,), prefix, dtype=torch.int64),
                region_valid=region_valid, table=table)
    case = {k: v.to(device) for k, v in case.items()}
    gd = torch.Generator(device=device).manual_seed(seed)  # the large tensors drawn where they live
    case["region_k"] = torch.randn(pages + 1, page, D, generator=gd, device=device).to(dtype)
    case["region_v"] = torch.randn(pages + 1, page, D, generator=gd, device=device).to(dtype)
    case["pool_k"] = torch.randn(pool_slots, Hkv, D, generator=gd, device=device).to(dtype)
    case["pool_v"] = torch.randn(pool_slots, Hkv, D, generator=gd, device=device).to(dtype)
    # Queries at twice unit scale: sharper attention than unit queries over random keys.
    case["q"] = (torch.randn(R, Hq, D, generator=gd, device=device) * 2).to(dtype)
    region_position = region_position.to(device)
    region_vnorm = case["region_v"].float().abs().sum(-1)
    # The policy's view of kv heads' slots (the backend gathers it for every decision).
    view_valid = case["region_valid"][case["table"]].reshape(R, Hkv, S)
    view_position = region_position[case["table"]].reshape(R, Hkv, S)
    return case, region_position, region_vnorm, view_valid, view_position


def select_today(pv_norm, view_valid, view_position, budget, protect_recent, max_protect):
    """LongFlowPolicy.select_decode's PyTorch decision as it was before the
    fused path (one rank): returns (evict mask [R, H, S], victim [R])."""
    budget = budget.view(-1)
    held = view_valid[:, 0].sum(dim=-1)
    over = held > budget
    protect = torch.minimum(protect_recent.clamp(min=1), budget).view(-1, 1)
    protected = newest_mask(view_valid[:, 0], view_position[:, 0], protect.view(-1), max(1, max_protect))
    score = pv_norm.sum(dim=1)
    candidates = view_valid[:, 0] & ~protected
    victim = torch.where(candidates, score, torch.full_like(score, float("inf"))).argmin(dim=-1)
    slots = torch.arange(score.shape[-1], device=score.device)
    evict = (slots == victim.unsqueeze(-1)) & over.unsqueeze(-1)
    return evict.unsqueeze(1) & view_valid, victim


def evict_mask(victim, view_valid, budget):
    """The fused paths' eviction mask (what select_decode returns)."""
    over = view_valid[:, 0].sum(dim=-1) > budget.view(-1)
    slots = torch.arange(view_valid.shape[-1], device=view_valid.device)
    return ((slots == victim.unsqueeze(-1)) & over.unsqueeze(-1)).unsqueeze(1) & view_valid


def reference(case, scale, region_vnorm, view_valid, view_position):
    """fp32 attend_rows: output [R, Hq, Dv] and the exact layer score [R, S]
    with the candidates' victim (newest protected)."""
    R, P = case["prefix_slots"].shape
    table = case["table"]
    Hkv, M = table.shape[1:]
    page = case["region_k"].shape[1]
    S = M * page
    prefix_mask = torch.arange(P, device=table.device).unsqueeze(0) < case["prefix_len"].unsqueeze(1)
    pk = case["pool_k"][case["prefix_slots"]]
    pv = case["pool_v"][case["prefix_slots"]]
    rk = case["region_k"][table].reshape(R, Hkv, S, -1)
    rv = case["region_v"][table].reshape(R, Hkv, S, -1)
    out, obs = attention_ref.attend_rows(case["q"].float().unsqueeze(1), pk.float(), pv.float(), prefix_mask,
                                         rk.float(), rv.float(), view_valid.unsqueeze(1), scale, Need.PV_NORM)
    score = obs.pv_norm.sum(dim=1)  # ||v||_1 from V in fp32: the same as region_vnorm
    valid0, pos0 = view_valid[:, 0], view_position[:, 0]
    newest = torch.where(valid0, pos0, -1).amax(-1, keepdim=True)
    cand = valid0 & (pos0 != newest)
    victim = torch.where(cand, score, torch.full_like(score, float("inf"))).argmin(-1)
    return out[:, 0], score, cand, victim


def agreement(victim, ref_victim, score, cand):
    """Rows whose victim differs from the reference's, and the largest
    relative score gap among them (0: exact ties only)."""
    differ = victim != ref_victim
    rows = int(differ.sum())
    if rows == 0:
        return {"rows_differing": 0, "max_relative_gap": 0.0, "all_candidates": True}
    v = victim.clamp(min=0)
    chosen = score.gather(1, v.unsqueeze(1)).squeeze(1)
    best = score.gather(1, ref_victim.unsqueeze(1)).squeeze(1)
    gap = ((chosen - best) / best.abs().clamp(min=1e-30))[differ]
    ok = cand.gather(1, v.unsqueeze(1)).squeeze(1)[differ] & (victim[differ] >= 0)
    return {"rows_differing": rows, "max_relative_gap": float(gap.max()), "all_candidates": bool(ok.all())}


def timer(device, graphs):
    """ms per call of fn: medians of CUDA-event timings (CPU: wall clock)."""

    def run(fn, iters, warmup=3 if device.type == "cuda" else 0):
        for _ in range(warmup):
            fn()
        if device.type != "cuda":
            times = []
            for _ in range(iters):
                t = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t) * 1e3)
            return sorted(times)[len(times) // 2]
        call = fn
        if graphs:
            torch.cuda.synchronize()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                fn()  # allocations of the capture's pool settle
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            call = graph.replay
            for _ in range(warmup):
                call()
        torch.cuda.synchronize()
        times = []
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return sorted(times)[len(times) // 2]

    return run


def today_scratch_bytes(case):
    """decode_attention's scratch with observations: fp16 logits per (query
    head, key), block maxima, split partials."""
    R, Hq, _ = case["q"].shape
    P = case["prefix_slots"].shape[1]
    page = case["region_k"].shape[1]
    S = case["table"].shape[2] * page
    block = decode_attention_module.BLOCK_N
    P_pad = -(-P // block) * block
    keys = P_pad + S
    splits = decode_attention_module.default_splits(keys)
    DV = case["region_v"].shape[-1]
    return R * Hq * keys * 2 + R * Hq * (-(-keys // block)) * 4 + R * Hq * splits * (DV + 2) * 4


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="CPU, Triton's interpreter, tiny sizes")
    ap.add_argument("--rows", default=None, help="comma list (default 64,256,640; --quick 3,5)")
    ap.add_argument("--budget", type=int, default=None, help="tokens per layer and head (default 1024; --quick 40)")
    ap.add_argument("--prefix", type=int, default=0, help="shared-prefix tokens per row in the token pool")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--width-multiple", type=int, default=4,
                    help="page-table columns rounded up to this (4: a group's width; 16: a solo step's width "
                         "at budget 1024, 80 columns: radix_ext/step_meta.step_width_bucket)")
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--configs", default=None,
                    help="fused sweep: block:warps:tile[:stages] (tile fp32/fp16, stages 2 unless given), comma "
                         f"list (default {DEFAULT_CONFIGS})")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    if args.quick:
        rows = [int(x) for x in (args.rows or "2,3").split(",")]
        budget = args.budget or 40
        Hq, Hkv, D, page = 8, 2, 32, 8
        dtype = torch.float32
        iters = args.iters or 1
        configs = args.configs or "16:4:fp32,16:4:fp16:3"
    else:
        rows = [int(x) for x in (args.rows or "64,256,640").split(",")]
        budget = args.budget or 1024
        Hq, Hkv, D, page = 28, 4, 128, 16
        dtype = torch.bfloat16
        iters = args.iters or 30
        configs = args.configs or DEFAULT_CONFIGS
    configs = [(int(c[0]), int(c[1]), c[2] == "fp16", int(c[3]) if len(c) > 3 else 2)
               for c in (x.split(":") for x in configs.split(","))]
    scale = D ** -0.5
    result = {
        "command": "python3 " + " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else f"cpu ({platform.machine()}, "
                                                                           "Triton interpreter)",
        "versions": {"torch": torch.__version__, "triton": __import__("triton").__version__,
                     "python": platform.python_version()},
        "commit": _commit(),
        "shape": {"q_heads": Hq, "kv_heads": Hkv, "head_dim": D, "page": page, "dtype": str(dtype),
                  "budget": budget, "held_slots": budget + 1, "prefix": args.prefix, "layers": args.layers,
                  "width_multiple": args.width_multiple},
        "timing": "CUDA-event medians of %d calls per variant, eager and CUDA-graph replay; one layer" % iters
                  if device.type == "cuda" else "wall-clock medians (interpreter: not a speed)",
        "fused_defaults": {"block": lf.BLOCK, "warps": lf.NUM_WARPS, "stages": lf.NUM_STAGES,
                           "tile": "fp16" if lf.TILE_FP16 else "fp32", "route_max_slots": lf.ROUTE_MAX_SLOTS},
        "sizes": [],
    }
    print(f"{result['device']}: {result['shape']}", flush=True)
    for R in rows:
        entry = measure(R, budget, Hq, Hkv, D, page, dtype, device, scale, iters, configs, args)
        result["sizes"].append(entry)
        print(json.dumps({"rows": R, "best": entry.get("best"),
                          "today": entry["variants"]["today"]}, indent=None), flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


def measure(R, budget, Hq, Hkv, D, page, dtype, device, scale, iters, configs, args) -> dict:
    """One size: the reference, every variant checked, then timed."""
    case, position, vnorm, view_valid, view_position = make_case(
        R, budget, Hq, Hkv, D, page, args.prefix, dtype, device, seed=R, width_multiple=args.width_multiple)
    S = view_valid.shape[-1]
    budget_t = torch.full((R,), budget, dtype=torch.int64, device=device)
    protect_recent = torch.zeros(R, dtype=torch.int64, device=device)
    protect = torch.ones(R, dtype=torch.int32, device=device)
    ref_out, ref_score, cand, ref_victim = reference(case, scale, vnorm, view_valid, view_position)
    entry = {"rows": R, "slots_per_head": S, "table_columns": case["table"].shape[2],
             "kv_bytes_per_layer": 2 * R * Hkv * (budget + 1) * D * case["region_k"].element_size(),
             "today_scratch_bytes_per_layer": today_scratch_bytes(case), "variants": {}}

    def today():
        out, obs = decode_attention(**case, scale=scale, needs=OBSERVED, region_vnorm=vnorm, fused=False)
        evict, victim = select_today(obs.pv_norm, view_valid, view_position, budget_t, protect_recent, 0)
        return out, victim, evict

    def attention_only():
        return decode_attention(**case, scale=scale, needs=Need.NONE, fused=False)[0]

    def tuning(cfg):
        block, warps, fp16, stages = cfg
        return dict(block=block, num_warps=warps, tile_fp16=fp16, num_stages=stages)

    def observed(cfg):
        def fn():
            out, obs = lf.decode_attention_observed(**case, scale=scale, needs=OBSERVED, region_vnorm=vnorm,
                                                    **tuning(cfg))
            victim, _ = lf.longflow_select(obs.pv_norm, view_valid[:, 0], view_position[:, 0], protect)
            return out, victim, evict_mask(victim, view_valid, budget_t)
        return fn

    def one_kernel(cfg):
        def fn():
            out, victim, _, _ = lf.longflow_decode(**case, scale=scale, region_position=position, protect=protect,
                                                   region_vnorm=vnorm, **tuning(cfg))
            return out, victim, evict_mask(victim, view_valid, budget_t)
        return fn

    # The passes on their own (timed only): where the time goes.
    pv_fixed = decode_attention(**case, scale=scale, needs=OBSERVED, region_vnorm=vnorm, fused=False)[1].pv_norm
    passes = {
        "today: attention + observations (passes 1-2)":
            lambda: decode_attention(**case, scale=scale, needs=OBSERVED, region_vnorm=vnorm, fused=False),
        "today: decision in PyTorch (pass 3)":
            lambda: select_today(pv_fixed, view_valid, view_position, budget_t, protect_recent, 0),
        "fused: longflow_select + eviction mask":
            lambda: evict_mask(lf.longflow_select(pv_fixed, view_valid[:, 0], view_position[:, 0], protect)[0],
                               view_valid, budget_t),
    }
    for cfg in configs:
        tag = _tag(cfg)
        passes[f"fused: attention + observations [{tag}]"] = (
            lambda cfg=cfg: lf.decode_attention_observed(**case, scale=scale, needs=OBSERVED, region_vnorm=vnorm,
                                                         **tuning(cfg)))
        passes[f"fused: attention alone, keys unsplit (no tile) [{tag}]"] = (
            lambda cfg=cfg: lf.decode_attention_observed(**case, scale=scale, needs=Need.NONE,
                                                         region_vnorm=vnorm, **tuning(cfg)))

    def check(name, fn):
        out, victim, evict = fn()
        v = entry["variants"].setdefault(name, {})
        v["output_max_abs_error"] = float((out.float() - ref_out).abs().max())
        v["victims_vs_reference"] = agreement(victim, ref_victim, ref_score, cand)
        v["evicts_one_slot_per_head"] = bool((evict.sum(-1) == 1).all())
        return victim

    today_victim = check("today", today)
    entry["variants"]["attention_only"] = {}
    fused = [("today", today, None), ("attention_only", attention_only, None)]
    for cfg in configs:
        tag = _tag(cfg)
        for kind, make in (("fused_observed", observed), ("fused_one_kernel", one_kernel)):
            name = f"{kind}[{tag}]"
            try:
                victim = check(name, make(cfg))
            except Exception as exc:  # noqa: BLE001 - a config that does not compile is a result
                entry["variants"][name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
                print(f"  R={R} {name}: {exc}", flush=True)
                continue
            entry["variants"][name]["victims_equal_today"] = int((victim == today_victim).sum())
            fused.append((name, make(cfg), cfg))
    for graphs in ([False, True] if device.type == "cuda" else [False]):
        run = timer(device, graphs)
        key = "graph_ms" if graphs else "eager_ms"
        for name, fn, _ in fused:
            try:
                entry["variants"][name][key] = round(run(fn, iters), 4)
            except Exception as exc:  # noqa: BLE001
                entry["variants"][name][key + "_error"] = f"{type(exc).__name__}: {exc}"[:300]
        for name, fn in passes.items():
            try:
                entry.setdefault("passes", {}).setdefault(name, {})[key] = round(run(fn, iters), 4)
            except Exception as exc:  # noqa: BLE001
                entry.setdefault("passes", {}).setdefault(name, {})[key + "_error"] = \
                    f"{type(exc).__name__}: {exc}"[:300]
    for key in (["eager_ms", "graph_ms"] if device.type == "cuda" else ["eager_ms"]):
        base = entry["variants"]["today"].get(key)
        for kind in ("fused_observed", "fused_one_kernel"):
            timed = {n: v[key] for n, v in entry["variants"].items() if n.startswith(kind + "[") and key in v}
            if not timed or base is None:
                continue
            best = min(timed, key=timed.get)
            entry.setdefault("best", {}).setdefault(key, {})[kind] = {
                "variant": best, "ms": timed[best], "today_ms": base,
                "speedup_vs_today": round(base / timed[best], 3),
                "x28_ms": round(timed[best] * args.layers, 3), "today_x28_ms": round(base * args.layers, 3)}
    return entry

def _tag(cfg) -> str:
    block, warps, fp16, stages = cfg
    return f"block{block}_warps{warps}_{'fp16' if fp16 else 'fp32'}_stages{stages}"


def _commit():
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except Exception:  # noqa: BLE001 - a copy without git
        return None


if __name__ == "__main__":
    main()
