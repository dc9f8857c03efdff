"""A mixed batch's decode attention against its members', kernel by kernel:

    python bench/mixed_attention_ab.py OUT.json [--rows 128] [--split-keys 256,1024] [--quick]

One layer's decode_attention (kernels/decode_attention.py) on a synthetic
step shaped as a served one (bench/results/logs/h200-2026-12-02d: 128 rows of
the issue's eight decode-time policies, 64-token prompts, the groups' widths
of the step log): each class of rows its own page-table columns and
observation bits (step_meta.observe_bits_of of its policy's needs in a
layer past the first: 27 of a step's 28 launches). Times:

* `mixed`: the step as served (one launch, the union of the needs);
* each member alone at the same row count, with its own width and needs
  (LongFlow through its fused kernel, as a LongFlow-only step runs); their
  mean weighted by rows is what the mix would cost at its members' speed;
* variants of the mix that drop one thing at a time (sparsity, |p*v|, the
  observation pass) and knobs of the kernel (observation blocks a program,
  the most keys a split), to say which part of the excess is whose; each
  split size timed by kernel too.

Each timing is the GPU time of one launch (a step launches one per layer),
from CUDA graph replays as the engine runs them. Writes OUT.json
with the machine, the date and the command."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

import torch

from kvsieve.kernels import decode_attention as kernel
from kvsieve.policies import Need, get_policy
from kvsieve.radix_ext.step_meta import LATER_LAYERS_SHIFT, observe_bits_of

Q_HEADS, KV_HEADS, HEAD_DIM, PAGE = 28, 4, 128, 16  # R1-Distill-Qwen-7B
PROMPT = 64
PREFIX_WIDTH = 128  # step_meta.prefix_bucket(64)
#: (policy, page-table columns) of the eight decode-time policies as a served
#: 128-row mixed step held them (the step log's group widths).
CLASSES = [("h2o", 20), ("rkv", 20), ("streaming", 20), ("skipkv", 20), ("thinkv", 20), ("crystal_kv", 36),
           ("longflow", 20), ("crystalcache", 24)]


def later_layer_needs(name: str) -> Need:
    """What a row of policy `name` asks of a layer past the first (the
    launches of 27 of a step's 28 layers): its needs, or none for a policy
    that observes the first layer only (backend's later_needs)."""
    policy = get_policy(name)
    return Need.NONE if policy.observes_first_layer_only else policy.needs


def rows_per_class(classes: int, rows: int) -> list[int]:
    """Rows of each class when `rows` are dealt to `classes` in blocks."""
    return [rows // classes + (i < rows % classes) for i in range(classes)]


def make_step(classes, rows: int, device, dtype, seed: int = 0):
    """decode_attention's inputs for `rows` rows dealt to `classes` in
    blocks (as step_meta groups them), with the observation bits of each."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    per = rows_per_class(len(classes), rows)
    cols = [c for (_, c), n in zip(classes, per) for _ in range(n)]
    bits = [observe_bits_of(later_layer_needs(name)) for (name, _), n in zip(classes, per) for _ in range(n)]
    width = max(cols)
    pages = rows * KV_HEADS * width
    region_k = torch.randn(pages + 1, PAGE, HEAD_DIM, generator=g).to(dtype)
    region_v = torch.randn(pages + 1, PAGE, HEAD_DIM, generator=g).to(dtype)
    valid = torch.ones(pages + 1, PAGE, dtype=torch.bool)
    valid[-1] = False  # the null page
    table = torch.randperm(pages, generator=g).view(rows, KV_HEADS, width)
    for r, c in enumerate(cols):
        table[r, :, c:] = pages  # null columns past a row's own
    pool = rows * PROMPT + 8
    step = dict(q=torch.randn(rows, Q_HEADS, HEAD_DIM, generator=g).to(dtype),
                pool_k=torch.randn(pool, KV_HEADS, HEAD_DIM, generator=g).to(dtype),
                pool_v=torch.randn(pool, KV_HEADS, HEAD_DIM, generator=g).to(dtype),
                prefix_slots=torch.randint(0, pool, (rows, PREFIX_WIDTH), generator=g),
                prefix_len=torch.full((rows,), PROMPT), region_k=region_k, region_v=region_v,
                region_valid=valid, table=table,
                region_vnorm=region_v.float().abs().sum(-1),
                row_columns=torch.tensor(cols, dtype=torch.int32),
                row_observe=torch.tensor(bits, dtype=torch.int32))
    # The union, as the engine passes it: a step of attention and |p*v|
    # only (LongFlow alone) goes through LongFlow's fused kernel, any other
    # need (keys, token ids) keeps the split-KV path.
    needs = Need.NONE
    for name, _ in classes:
        needs |= later_layer_needs(name)
    return {k: v.to(device) for k, v in step.items()}, needs


def graph_ms(fn, iters: int) -> float:
    """GPU time of one call: `fn` captured in a CUDA graph (as the engine
    replays its steps) and replayed `iters` times between two events, so
    the host's launch work is not counted."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # compile and warm up outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def kernel_ms(fn, iters: int = 20) -> dict:
    """GPU time per call of each kernel `fn` launches (torch.profiler, eager
    calls): which kernel a variant's time goes to."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if us:  # names cut short: kernels of one family summed
            key = e.key[:60]
            out[key] = round(out.get(key, 0.0) + us / iters / 1000, 4)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


@contextlib.contextmanager
def knob(name: str, value):
    """A module constant of the kernel set for the duration (read at launch)."""
    old = getattr(kernel, name)
    setattr(kernel, name, value)
    try:
        yield
    finally:
        setattr(kernel, name, old)


def time_step(step, needs, iters, shift=LATER_LAYERS_SHIFT, **kw):
    args = dict(step, **kw)
    return graph_ms(lambda: kernel.decode_attention(scale=HEAD_DIM ** -0.5, needs=needs, observe_shift=shift,
                                                     **args), iters)


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--quick", action="store_true", help="a few iterations (a check that it runs)")
    ap.add_argument("--split-keys", type=ints, default=[256, 1024],
                    help="KEYS_PER_SPLIT values to time the mix at (multiples of the kernel's block, 32)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("needs a GPU")
    iters = 5 if args.quick else args.iters
    dev, dtype = torch.device("cuda"), torch.bfloat16
    t0 = time.time()
    step, needs = make_step(CLASSES, args.rows, dev, dtype)
    results = {"mixed": time_step(step, needs, iters)}
    no_sparsity = dict(step, row_observe=step["row_observe"] & ~(
        observe_bits_of(Need.SPARSITY) | observe_bits_of(Need.SPARSITY) << LATER_LAYERS_SHIFT))
    variants = {
        "mixed without sparsity (ThinKV's rows observe nothing)": (no_sparsity, needs & ~Need.SPARSITY, {}),
        "mixed without |p*v| (LongFlow's rows attention only)": (step, needs & ~Need.PV_NORM, {}),
        "mixed, attention only (no observation pass)": (step, Need.NONE, {}),
    }
    for name, (s, n, kw) in variants.items():
        results[name] = time_step(s, n, iters, **kw)
    narrow_step, narrow_needs = make_step([(name, 20) for name, _ in CLASSES], args.rows, dev, dtype)
    results["mixed, every class at 20 columns"] = time_step(narrow_step, narrow_needs, iters)
    results["mixed, every class at 20 columns, attention only"] = time_step(narrow_step, Need.NONE, iters)
    for blocks in (2, 4, 16):
        with knob("OBSERVE_BLOCKS_PER_PROGRAM", blocks):
            results[f"mixed, {blocks} observation blocks a program"] = time_step(step, needs, iters)
    call = lambda st, nd: (lambda: kernel.decode_attention(scale=HEAD_DIM ** -0.5, needs=nd,  # noqa: E731
                                                             observe_shift=LATER_LAYERS_SHIFT, **st))
    breakdown = {"mixed": kernel_ms(call(step, needs)),
                 "mixed, every class at 20 columns": kernel_ms(call(narrow_step, narrow_needs))}
    # Keys a split: `_partial_kernel` is latency-bound at these shapes (its
    # time follows the longest split's chain of blocks, as long as the
    # programs fit in one wave), so the sweep looks for the split that
    # keeps the wide rows' chains as short as the narrow rows' without a
    # second wave.
    for keys in args.split_keys:
        with knob("KEYS_PER_SPLIT", keys):
            results[f"mixed, {keys} keys a split"] = time_step(step, needs, iters)
            results[f"mixed, {keys} keys a split, attention only"] = time_step(step, Need.NONE, iters)
            breakdown[f"mixed, {keys} keys a split"] = kernel_ms(call(step, needs))
    members = {}
    for cls in CLASSES:
        s, n = make_step([cls], args.rows, dev, dtype)
        members[cls[0]] = time_step(s, n, iters)
        members[cls[0] + " (attention only)"] = time_step(s, Need.NONE, iters)
        if cls[0] in ("h2o", "thinkv", "crystal_kv"):
            breakdown[cls[0]] = kernel_ms(call(s, n))
    per = rows_per_class(len(CLASSES), args.rows)
    weighted = sum(members[c[0]] * n for c, n in zip(CLASSES, per)) / args.rows
    weighted_att = sum(members[c[0] + " (attention only)"] * n for c, n in zip(CLASSES, per)) / args.rows
    out = {
        "command": "python " + " ".join([sys.argv[0]] + (argv if argv is not None else sys.argv[1:])),
        "device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "rows": args.rows, "classes": [[c, w, str(later_layer_needs(c))] for c, w in CLASSES],
        "ms_per_launch": {k: round(v, 4) for k, v in results.items()},
        "members_ms_per_launch": {k: round(v, 4) for k, v in members.items()},
        "members_weighted_ms": round(weighted, 4), "members_weighted_attention_only_ms": round(weighted_att, 4),
        "mixed_over_members_ms": round(results["mixed"] - weighted, 4),
        "kernels_ms_per_launch": breakdown,
        "seconds": round(time.time() - t0, 1),
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    for k, v in {**out["ms_per_launch"], **out["members_ms_per_launch"]}.items():
        print(f"{v:8.4f} ms  {k}")
    for k, v in breakdown.items():
        print(k, json.dumps(v))
    print(f"members weighted {weighted:.4f} ms (attention only {weighted_att:.4f}); mixed {results['mixed']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
