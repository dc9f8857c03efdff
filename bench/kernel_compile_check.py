"""Compile the extend-attention kernels for a GPU target on a host without
one, and report registers and spill stack per thread (cuobjdump, shipped
with Triton): a GPU-only compile error or a tile that spills shows before
any device time is spent.

    python bench/kernel_compile_check.py [--arch 90] [--decode-tbq [--variant old,new] [--sass]] [--store]

Shapes: R1-Distill-Qwen-7B (G = 7, padded to 8) and Llama-3.1-8B (G = 4),
head_dim 128, page 16, bf16; the tile configurations bench/kernel_check.py
sweeps. `--decode-tbq` compiles the decode kernel instead, over bf16 pages
(block 32) and over quantized pages of the 4-bit class (TBQ): the "old"
variant (block = page 16, 4 and 8 warps) and the "new" one (blocks of 32
and 64 slots of mixed formats, 4 and 8 warps). `--sass` adds, per
kernel, the SASS instructions of each loop body (a backward branch's span
in `cuobjdump -sass`: a static count, each instruction once, so a loop
with branches inside counts every arm) and the global loads in it.
`--store` compiles the store of a decode step's new tokens
(kernels/region_store.py) at the 7B model's shapes, bf16 and fp16
(tests/test_kernel_compile.py runs it: the interpreter does not type-check
what the GPU compiler refuses)."""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kvsieve.kernels import extend_attention as ea

TUNINGS = [(128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 8, 2), (64, 64, 8, 2), (64, 32, 4, 2)]  # as bench/kernel_check.py
GROUPS = {"r1-distill-qwen-7b": 7, "llama-3.1-8b": 4}


def signature(fn, pointers: dict, constexprs: dict) -> dict:
    sig = {}
    for name in inspect.signature(fn.fn).parameters:
        sig[name] = "constexpr" if name in constexprs else pointers.get(name, "fp32" if name == "scale" else "i32")
    return sig


#: Integer arguments that are multiples of 16 at these shapes (head_dim 128,
#: page 16); Triton's launcher specializes them as such, like every pointer.
ALIGNED = {"sq_r", "sq_t", "sq_h", "spk_n", "spk_h", "spv_n", "spv_h", "srk_p", "srk_o", "srv_p", "srv_o", "sva_p",
           "spo_p", "so_r", "so_t", "so_h", "sq_c", "sq_o", "sw_c", "sw_o", "sh_c", "sh_o", "sqks_r",
           "sqvs_r"}


def source(fn, pointers: dict, constexprs: dict) -> ASTSource:
    sig = signature(fn, pointers, constexprs)
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(sig)
             if sig[name].startswith("*") or name in ALIGNED}
    return ASTSource(fn, sig, constexprs, attrs)


def usage(kernel) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        tool = os.path.join(triton.__path__[0], "backends", "nvidia", "bin", "cuobjdump")
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    fields = [line.split() for line in out.splitlines() if "REG:" in line][0]
    return " ".join(f for f in fields if f.startswith(("REG:", "STACK:")))


def sass_loops(kernel) -> str:
    """Instructions and global loads of each loop body in the kernel's SASS
    (the span from a backward branch's target to the branch)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        tool = os.path.join(triton.__path__[0], "backends", "nvidia", "bin", "cuobjdump")
        out = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
    code = []  # (address, text)
    for line in out.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            code.append((int(m.group(1), 16), m.group(2)))
    loops = []
    for i, (addr, text) in enumerate(code):
        m = re.search(r"\bBRA\b.*?(0x[0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            body = [t for a, t in code if int(m.group(1), 16) <= a <= addr]
            loads = sum(1 for t in body if re.search(r"\bLDG", t))
            loops.append(f"{len(body)} instr / {loads} LDG")
    return "loops [" + "; ".join(loops) + "]"


#: (label, QUANT, block, warps) of --decode-tbq.
DECODE_CONFIGS = [("bf16", 0, 32, 4), ("old", 1, 16, 4), ("old", 1, 16, 8), ("new", 2, 32, 4), ("new", 2, 32, 8),
                  ("new", 2, 64, 4), ("new", 2, 64, 8)]


def decode_tbq(target, variants, sass: bool) -> None:
    from kvsieve.kernels import decode_attention as da

    dt = "*bf16"
    ptrs = dict(Q=dt, PoolK=dt, PoolV=dt, PrefixSlots="*i64", PrefixLen="*i64", RegK=dt, RegV=dt, Valid="*u8",
                Table="*i64", PartO="*fp32", PartM="*fp32", PartL="*fp32", Logits="*fp16", BlockMax="*fp32",
                Format="*i8", QK="*u8", QV="*u8", QKScale="*u8", QVScale="*u8", QPageScale="*fp32", QKW="*i32",
                QVW="*i32", QKH="*i16", QVH="*i16")
    for model, G in GROUPS.items():
        for label, quant, block, warps in DECODE_CONFIGS:
            if label not in variants:
                continue
            for observe in (False, True):
                ce = dict(G=G, G_PAD=16, D=128, DV=128, PAGE=16, BLOCK=block, STORE_REGION_LOGITS=observe,
                          STORE_PREFIX_LOGITS=observe, QUANT=quant, HAS_FP8=False)
                k = triton.compile(source(da._partial_kernel, ptrs, ce), target=target,
                                   options=dict(num_warps=warps, num_stages=2))
                print(f"decode {model} {label} block {block} warps {warps} observed {observe}: "
                      f"{usage(k)} shared {k.metadata.shared}" + (f" {sass_loops(k)}" if sass else ""), flush=True)


def compile_store(target) -> list[str]:
    """The region store kernel for `target`: one line per K/V dtype."""
    from kvsieve.kernels import region_store as rs

    lines = []
    for dt in ("*bf16", "*fp16"):
        ptrs = dict(Table="*i64", BatchIndex="*i64", Positions="*i64", PoolRows="*i64", RowColumns="*i32", K=dt, V=dt,
                    RegK=dt, RegV=dt, Valid="*u8", VNorm="*fp32", Position="*i64", Score="*fp32", LastHit="*i32",
                    Overflow="*u8")
        # As served: each row to its own columns (radix_ext/backend.py passes them).
        ce = dict(PAGE=16, D=128, BLOCK_D=128, BLOCK_S=rs.BLOCK_SLOTS, OWN_COLUMNS=True)
        k = triton.compile(source(rs._store_kernel, ptrs, ce), target=target, options=dict(num_warps=4))
        lines.append(f"store {dt[1:]}: {usage(k)} shared {k.metadata.shared}")
    return lines


def main() -> None:
    arch = int(sys.argv[sys.argv.index("--arch") + 1]) if "--arch" in sys.argv else 90
    target = GPUTarget("cuda", arch, 32)
    if "--store" in sys.argv:
        print("\n".join(compile_store(target)), flush=True)
        return
    if "--decode-tbq" in sys.argv:
        variants = sys.argv[sys.argv.index("--variant") + 1].split(",") if "--variant" in sys.argv else \
            ["bf16", "old", "new"]
        decode_tbq(target, variants, "--sass" in sys.argv)
        return
    dt = "*bf16"
    extend_ptrs = dict(Q=dt, Pos="*i64", PoolK=dt, PoolV=dt, PrefixSlots="*i64", PrefixLen="*i64", RegK=dt, RegV=dt,
                       Valid="*u8", Position="*i64", Table="*i64", Out=dt, Lse="*fp32")
    observe_ptrs = dict(Q=dt, Pos="*i64", Observe="*u8", Lse="*fp32", RegK=dt, Valid="*u8", Position="*i64",
                        Table="*i64", Attention="*fp32")
    for model, G in GROUPS.items():
        g_pad = triton.next_power_of_2(G)
        for block_m, block_n, warps, stages in TUNINGS:
            q = max(1, block_m // g_pad)
            options = dict(num_warps=warps, num_stages=stages)
            ce = dict(G=G, G_PAD=g_pad, D=128, DV=128, PAGE=16, BLOCK_Q=q, BLOCK_N=block_n, STORE_LSE=True)
            k1 = triton.compile(source(ea._extend_kernel, extend_ptrs, ce),
                                target=target, options=options)
            ce = dict(G=G, G_PAD=g_pad, D=128, PAGE=16, BLOCK_Q=q, BLOCK_N=block_n)
            k2 = triton.compile(source(ea._observe_kernel, observe_ptrs, ce),
                                target=target, options=options)
            print(f"sm_{arch} {model} block_m {block_m} block_n {block_n} warps {warps} stages {stages}: "
                  f"extend {usage(k1)} shared {k1.metadata.shared}; observe {usage(k2)} shared {k2.metadata.shared}",
                  flush=True)


if __name__ == "__main__":
    main()
