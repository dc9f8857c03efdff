"""LongFlow's fused decode pass (issue #30 item 6): attention, the |p v| slot
score and the layer's argmin without a logits scratch buffer.

Before it a longflow decode step was three passes: `decode_attention` with
Need.PV_NORM (split-KV attention that writes one fp16 logit per (query
head, key) to a scratch buffer, then a merge of the splits), the
observation kernel (reads the logits back with the final log-sum-exp and
writes ||p v||_1 and the attention mass per slot), and LongFlow's decision
in PyTorch (sum over heads, the newest token protected, argmin).

**Why the split is per kv head, not per chunk of keys.** LongFlow evicts
one slot per layer, the argmin over slots s of

    score_s = sum_h sum_g exp(x_{h,g,s} - lse_{h,g}) * ||v_{h,s}||_1

(h the layer's kv heads, g the query heads of h's group, x the scaled
logit, lse the query head's log-sum-exp over ALL of the row's keys). A
split over chunks of keys knows only its own max m_k and sum l_k per query
head; the true weight of its per-slot terms is exp(m_k - lse_{h,g}), one
factor per query head, known only after the merge. For a score of one
query head that factor is common to every slot of the split, so a per-split
argmin rescaled in the merge would be exact; but the sum over 28 query
heads weighs each head by its own unknown factor, so no per-chunk
min/argmin (nor any per-slot summary smaller than the Hq logits themselves:
that is what the scratch buffer holds) decides it. What does work per split
is a split whose softmax statistics are already final when it scores its
slots: here a program owns every key of one (row, kv head) - prefix, then
region - and keeps the region's logits of its G query heads on chip (fp32
register tiles [G_S, blocks, BLOCK], G_S = G rounded up to a power of two,
never in memory). After its last key block lse_g = m_g + log l_g is exact,
so in its epilogue

    mass_{h,s} = sum_g exp(x_{g,s} - lse_g)          (Need.ATTENTION)
    pv_{h,s}   = mass_{h,s} * ||v_{h,s}||_1           (Need.PV_NORM)

and the attention output acc_g / l_g needs no merge. The merge over splits
(the kv heads) is then linear and normaliser-free:

    score_s = sum_h pv_{h,s};   victim = argmin_{s in candidates} score_s

candidates: valid in kv head 0 (slots line up across heads: evictions are
layer-wide) and, with protect, not the newest valid slot of the layer
(LongFlow's default protection of one token). Ties: the lowest slot index
(torch.argmin's rule, so the PyTorch decision and the kernels agree).

Two forms:
- `longflow_decode` (one kernel: attention, score and argmin, as in the
  paper): one program per row walks the row's kv heads in turn and sums
  their pv on chip; writes the output, the victim slot and its score.
- `decode_attention_observed` (the same kernel, one program per (row, kv
  head)): the attention output plus the observations `decode_attention`
  gives for Need.ATTENTION | Need.PV_NORM, without its scratch or its
  observation kernel; `longflow_select` is its merge (sum over heads,
  protection, min and argmin) in one small kernel. This is the form the
  engine uses (obs.pv_norm is what every path and tensor parallelism
  consume); radix_ext/backend.py reaches it through decode_attention.

Not covered (decode_attention keeps its split path): quantized (TBQ)
pages, Need.SPARSITY, regions wider than ROUTE_MAX_SLOTS slots per head
(the tiles' registers). Keys are not split, so all of a (row, kv head)'s
keys are one program's work: measured faster than the split path from 64
rows up at 1,088 slots a head; with few rows and long shared prefixes the
split path would win (not measured).

On an H100 (docs/gpu-kernels.md, "LongFlow's fused pass"; bf16,
R1-Distill-Qwen-7B heads, budget 1024, one layer, CUDA-graph replay) the
engine's form (fused attention + `longflow_select` + the eviction mask)
took 0.104 / 0.307 / 0.691 ms at 64 / 256 / 640 rows against 0.168 / 0.403
/ 0.880 ms for the three passes, the same victim in every row; the one
kernel form 0.215 / 0.313 / 0.790 ms (a program per row: too few programs
at 64 rows).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kvsieve.policies.observations import Need, Observations

from . import interpreter_compat

interpreter_compat.apply()

#: Keys per block of the region loop. Each block's logits are written into
#: the register tiles with a select over the whole tile, so fewer, larger
#: blocks cost less: on an H100 (R1-Distill-Qwen-7B heads, 1,088 slots a head)
#: 128 and 64 (3 stages) were the fastest, 32 up to 1.23x slower, 16 1.8x
#: (docs/gpu-kernels.md, "LongFlow's fused pass").
BLOCK = 128
#: Warps per program: 8 spread the tiles thinner but ran 1.2-1.9x slower.
NUM_WARPS = 4
NUM_STAGES = 2
#: The widest region (slots per (row, kv head), rounded up to a power of
#: two) the kernels take: the logits tiles live in registers.
MAX_SLOTS = 4096
#: The widest region decode_attention sends to the fused pass. A step of
#: LongFlow rows alone at budget 1024 reads a table of 80 columns (1,280
#: slots: radix_ext/step_meta.step_width_bucket rounds its 65 to 80), and
#: at 9 blocks it took the split path (its scratch and observation kernel:
#: 3.2 ms of a 600-row step on an H200, 2026-12-03); 10 blocks (tiles of
#: 8 + 2) cover it (`bench/longflow_fused.py --width-multiple 16`). Wider
#: regions need larger tiles (more registers, spills): the split path until
#: measured (bench/longflow_fused.py --budget N).
ROUTE_MAX_SLOTS = 10 * 128
#: Logits kept in fp16 instead of fp32: no faster on the H100, and as
#: approximate as the split path's scratch (1 victim of 640 moved by a near
#: tie), so fp32 by default.
TILE_FP16 = False
#: Observations the fused pass produces.
OBSERVED = Need.ATTENTION | Need.PV_NORM
#: KVSIEVE_LONGFLOW_FUSED=0 turns both fused parts off: decode_attention keeps
#: its split-KV path with the logits scratch and LongFlow's decision its
#: PyTorch argmin (A/B timings, a fallback). Read at each call.
ENV = "KVSIEVE_LONGFLOW_FUSED"


def enabled() -> bool:
    return os.environ.get(ENV, "1") not in ("0", "false", "False", "")


def applies(needs: Need, quant, slots: int) -> bool:
    """Whether the fused pass serves a decode_attention call: observations of
    ATTENTION and PV_NORM only, with PV_NORM among them (a step with
    LongFlow rows), full-precision pages, a region no wider than measured."""
    return (enabled() and quant is None and bool(needs & Need.PV_NORM) and not (needs & ~OBSERVED)
            and slots <= ROUTE_MAX_SLOTS)


@triton.jit
def _softmax_step(q, k, v, seen, m, l, acc, scale):
    """Online softmax over one key block for the group's query heads; also
    returns the block's logits (-inf on unseen keys)."""
    qk = tl.dot(q, tl.trans(k)).to(tl.float32) * scale
    qk = tl.where(seen[None, :], qk, float("-inf"))
    m_new = tl.maximum(m, tl.max(qk, 1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(qk - m_new[:, None])
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
    return m_new, l, acc, qk


@triton.jit
def _region_span(q, m, l, acc, X, first, last, r, h, g_ok, scale, S, null_page, RegK, RegV, Valid, Table,
                 srk_p, srk_o, srv_p, srv_o, sva_p, st_r, st_h,
                 G_PAD: tl.constexpr, G_S: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, PAGE: tl.constexpr,
                 BLOCK: tl.constexpr, NX: tl.constexpr):
    """Region key blocks [first, last): attention, and each block's logits
    put in tile X [G_S, NX, BLOCK] (column j: block first + j). Rows of X:
    the group's query heads, G_PAD rows folded to G_S (head g is fold 0, row
    g; every other row is padding, -inf)."""
    d = tl.arange(0, D)
    dv = tl.arange(0, DV)
    cols = tl.arange(0, NX)
    for b in range(first, last):
        s = b * BLOCK + tl.arange(0, BLOCK)
        in_region = s < S
        page = tl.load(Table + r * st_r + h * st_h + s // PAGE, mask=in_region, other=null_page)
        off = s % PAGE
        seen = in_region & (tl.load(Valid + page * sva_p + off, mask=in_region, other=0) != 0)
        k = tl.load(RegK + page[:, None] * srk_p + off[:, None] * srk_o + d[None, :], mask=seen[:, None], other=0.0)
        v = tl.load(RegV + page[:, None] * srv_p + off[:, None] * srv_o + dv[None, :], mask=seen[:, None], other=0.0)
        m, l, acc, qk = _softmax_step(q, k, v, seen, m, l, acc, scale)
        xs = tl.where(g_ok[:, None], qk, float("-inf"))
        xs = tl.max(tl.reshape(xs, [G_PAD // G_S, G_S, BLOCK]), axis=0)
        X = tl.where((cols == b - first)[None, :, None], xs.to(X.dtype)[:, None, :], X)
    return m, l, acc, X


@triton.jit
def _score_tile(X, lse, first, r, h, S, null_page, Table, VNorm, st_r, st_h, svn_p,
                PAGE: tl.constexpr, BLOCK: tl.constexpr, NX: tl.constexpr):
    """Slot ids, attention mass and ||p v||_1 [NX, BLOCK] of tile X (block
    `first` at column 0) with the final log-sum-exp [G_S] of its heads."""
    slot = (first + tl.arange(0, NX))[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    mass = tl.sum(tl.exp(X.to(tl.float32) - lse[:, None, None]), axis=0)  # -inf (unseen, padding): 0
    in_region = slot < S
    page = tl.load(Table + r * st_r + h * st_h + slot // PAGE, mask=in_region, other=null_page)
    norm = tl.load(VNorm + page * svn_p + slot % PAGE, mask=in_region, other=0.0)
    return slot, mass, mass * norm


@triton.jit
def _candidates(slot, S, null_page, r, Table, Valid, Position, st_r, sva_p, spos_p, PAGE: tl.constexpr):
    """Kv head 0's valid bits and positions of slots [.., ..]."""
    in_region = slot < S
    page = tl.load(Table + r * st_r + slot // PAGE, mask=in_region, other=null_page)
    valid = in_region & (tl.load(Valid + page * sva_p + slot % PAGE, mask=in_region, other=0) != 0)
    pos = tl.load(Position + page * spos_p + slot % PAGE, mask=valid, other=-1)
    return valid, pos


@triton.jit
def _min_argmin(score, slot, cand):
    """Min of `score` over `cand` and its lowest slot (+inf and 2^31 - 1
    without a candidate)."""
    key = tl.where(cand, score, float("inf"))
    best = tl.min(tl.min(key, 1), 0)
    victim = tl.min(tl.min(tl.where(cand & (key == best), slot, 2147483647), 1), 0)
    return best, victim


@triton.jit(do_not_specialize=["S", "sps_r", "st_r", "st_h", "sat_r", "sat_h"],  # the shapes' integers
            # per-row views: alignment follows the row count (decode_attention._partial_kernel)
            do_not_specialize_on_alignment=["PrefixLen", "Protect"])
def _fused_kernel(
    Q, PoolK, PoolV, PrefixSlots, PrefixLen, RegK, RegV, Valid, Table, VNorm, Position, Protect,
    Out, Attention, PvNorm, Victim, MinScore,
    scale, S, null_page,
    sq_r, sq_h, spk_n, spk_h, spv_n, spv_h, sps_r, srk_p, srk_o, srv_p, srv_o, sva_p, st_r, st_h, svn_p, spos_p,
    so_r, so_h, sat_r, sat_h,
    G: tl.constexpr, G_PAD: tl.constexpr, G_S: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    PAGE: tl.constexpr, BLOCK: tl.constexpr, NA: tl.constexpr, NB: tl.constexpr, HEADS: tl.constexpr,
    TILE_FP16: tl.constexpr, ATTENTION: tl.constexpr, PV_NORM: tl.constexpr, SELECT: tl.constexpr,
):
    """Grid (rows, kv heads / HEADS): HEADS kv heads of one row, each with
    every one of the row's keys, so its softmax statistics are final before
    its slots are scored. The region's logits live in two register tiles
    (blocks [0, NA) and [NA, NA + NB): powers of two that cover the region
    closely). SELECT (HEADS = all kv heads): the heads' pv summed per slot on
    chip, then the candidates' min and argmin."""
    r = tl.program_id(0)
    g = tl.arange(0, G_PAD)
    g_ok = g < G
    d = tl.arange(0, D)
    dv = tl.arange(0, DV)
    plen = tl.load(PrefixLen + r)
    blocks = tl.cdiv(S, BLOCK)
    tile_dtype = tl.float16 if TILE_FP16 else tl.float32
    total_a = tl.zeros([NA, BLOCK], tl.float32)
    total_b = tl.zeros([NB, BLOCK], tl.float32)
    for i in range(HEADS):
        h = tl.program_id(1) * HEADS + i
        hq = h * G + g
        q = tl.load(Q + r * sq_r + hq[:, None] * sq_h + d[None, :], mask=g_ok[:, None], other=0.0)
        m = tl.full([G_PAD], -1e30, tl.float32)
        l = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, DV], tl.float32)
        # The shared prefix (SGLang's token pool): attention only, never scored.
        for n0 in range(0, tl.cdiv(plen, BLOCK) * BLOCK, BLOCK):
            n = n0 + tl.arange(0, BLOCK)
            seen = n < plen
            slot = tl.load(PrefixSlots + r * sps_r + n, mask=seen, other=0)
            k = tl.load(PoolK + slot[:, None] * spk_n + h * spk_h + d[None, :], mask=seen[:, None], other=0.0)
            v = tl.load(PoolV + slot[:, None] * spv_n + h * spv_h + dv[None, :], mask=seen[:, None], other=0.0)
            m, l, acc, _ = _softmax_step(q, k, v, seen, m, l, acc, scale)
        xa = tl.full([G_S, NA, BLOCK], float("-inf"), tile_dtype)
        xb = tl.full([G_S, NB, BLOCK], float("-inf"), tile_dtype)
        m, l, acc, xa = _region_span(q, m, l, acc, xa, 0, tl.minimum(blocks, NA), r, h, g_ok, scale, S, null_page,
                                     RegK, RegV, Valid, Table, srk_p, srk_o, srv_p, srv_o, sva_p, st_r, st_h,
                                     G_PAD, G_S, D, DV, PAGE, BLOCK, NA)
        m, l, acc, xb = _region_span(q, m, l, acc, xb, NA, blocks, r, h, g_ok, scale, S, null_page,
                                     RegK, RegV, Valid, Table, srk_p, srk_o, srv_p, srv_o, sva_p, st_r, st_h,
                                     G_PAD, G_S, D, DV, PAGE, BLOCK, NB)
        # Every key seen: m and l are final, the output needs no merge.
        tl.store(Out + r * so_r + hq[:, None] * so_h + dv[None, :],
                 (acc / tl.maximum(l, 1e-30)[:, None]).to(Out.dtype.element_ty), mask=g_ok[:, None])
        lse = m + tl.log(tl.maximum(l, 1e-30))  # a head that saw nothing: ~-1e30, its logits all -inf
        lse = tl.max(tl.reshape(tl.where(g < G_S, lse, float("-inf")), [G_PAD // G_S, G_S]), axis=0)
        slot_a, mass_a, pv_a = _score_tile(xa, lse, 0, r, h, S, null_page, Table, VNorm, st_r, st_h, svn_p,
                                           PAGE, BLOCK, NA)
        slot_b, mass_b, pv_b = _score_tile(xb, lse, NA, r, h, S, null_page, Table, VNorm, st_r, st_h, svn_p,
                                           PAGE, BLOCK, NB)
        if ATTENTION:
            tl.store(Attention + r * sat_r + h * sat_h + slot_a, mass_a, mask=slot_a < S)
            tl.store(Attention + r * sat_r + h * sat_h + slot_b, mass_b, mask=slot_b < S)
        if PV_NORM:
            tl.store(PvNorm + r * sat_r + h * sat_h + slot_a, pv_a, mask=slot_a < S)
            tl.store(PvNorm + r * sat_r + h * sat_h + slot_b, pv_b, mask=slot_b < S)
        if SELECT:
            total_a += pv_a  # kv heads in order, as pv_norm.sum(dim=1)
            total_b += pv_b
    if SELECT:
        slot_a = tl.arange(0, NA)[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
        slot_b = (NA + tl.arange(0, NB))[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
        valid_a, pos_a = _candidates(slot_a, S, null_page, r, Table, Valid, Position, st_r, sva_p, spos_p, PAGE)
        valid_b, pos_b = _candidates(slot_b, S, null_page, r, Table, Valid, Position, st_r, sva_p, spos_p, PAGE)
        newest = tl.maximum(tl.max(tl.max(tl.where(valid_a, pos_a, -1), 1), 0),
                            tl.max(tl.max(tl.where(valid_b, pos_b, -1), 1), 0))
        protect = tl.load(Protect + r) > 0
        best_a, victim_a = _min_argmin(total_a, slot_a, valid_a & ~(protect & (pos_a == newest)))
        best_b, victim_b = _min_argmin(total_b, slot_b, valid_b & ~(protect & (pos_b == newest)))
        first = best_a <= best_b  # a tie: tile a's slots are the lower ones
        best = tl.where(first, best_a, best_b)
        victim = tl.where(first, victim_a, victim_b)
        tl.store(Victim + r, tl.where(victim == 2147483647, -1, victim).to(tl.int64))
        tl.store(MinScore + r, best)


@triton.jit(do_not_specialize=["S", "spv_r", "spv_h", "sva_r", "spo_r"],  # the shapes' integers
            do_not_specialize_on_alignment=["Protect"])  # a per-row view (decode_attention._partial_kernel)
def _select_kernel(PvNorm, Valid, Position, Protect, Victim, MinScore, H, S,
                   spv_r, spv_h, sva_r, spo_r,
                   CHUNK: tl.constexpr, CHUNKS: tl.constexpr):
    """Grid (rows,): LongFlow's merge of per-kv-head scores. score_s = sum
    over kv heads of pv_norm; victim = argmin over valid slots of kv head 0
    but, with protect, the newest (Valid/Position: [R, S] views of kv head
    0). One tile of CHUNKS x CHUNK slots."""
    r = tl.program_id(0)
    slot = tl.arange(0, CHUNKS)[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :]
    ok = slot < S
    total = tl.zeros([CHUNKS, CHUNK], tl.float32)
    for h in range(H):
        total += tl.load(PvNorm + r * spv_r + h * spv_h + slot, mask=ok, other=0.0)
    valid = ok & (tl.load(Valid + r * sva_r + slot, mask=ok, other=0) != 0)
    pos = tl.load(Position + r * spo_r + slot, mask=valid, other=-1)
    newest = tl.max(tl.max(tl.where(valid, pos, -1), 1), 0)
    best, victim = _min_argmin(total, slot, valid & ~((tl.load(Protect + r) > 0) & (pos == newest)))
    tl.store(Victim + r, tl.where(victim == 2147483647, -1, victim).to(tl.int64))
    tl.store(MinScore + r, best)


def tiles(slots: int, block: int) -> tuple[int, int]:
    """Key blocks of the two register tiles covering `slots` region slots:
    the largest power of two of blocks, then the rest rounded up to one."""
    blocks = triton.cdiv(max(slots, 1), block)
    first = 1 << (blocks.bit_length() - 1)
    return first, triton.next_power_of_2(max(blocks - first, 1))


def _launch(q, pool_k, pool_v, prefix_slots, prefix_len, region_k, region_v, region_valid, table, scale,
            region_vnorm, heads_per_program, attention, pv_norm, select, region_position=None, protect=None,
            block=BLOCK, num_warps=NUM_WARPS, num_stages=NUM_STAGES, tile_fp16=TILE_FP16):
    R, Hq, D = q.shape
    Hkv = table.shape[1]
    G = Hq // Hkv
    DV = region_v.shape[-1]
    PAGE = region_k.shape[1]
    S = table.shape[2] * PAGE
    dev = q.device
    if triton.next_power_of_2(max(S, 1)) > MAX_SLOTS:
        raise ValueError(f"region of {S} slots per head: above MAX_SLOTS ({MAX_SLOTS})")
    NA, NB = tiles(S, block)
    G_PAD = max(16, triton.next_power_of_2(G))
    G_S = triton.next_power_of_2(G)
    if region_vnorm is None:
        region_vnorm = region_v.float().abs().sum(-1)
    valid = region_valid.view(torch.uint8) if region_valid.dtype == torch.bool else region_valid
    prefix_len = prefix_len.to(torch.int64)
    if prefix_slots.shape[1] == 0:  # a real buffer, never read
        prefix_slots = torch.zeros((R, 1), dtype=torch.int64, device=dev)
    out = torch.empty((R, Hq, DV), dtype=q.dtype, device=dev)
    att = torch.empty((R, Hkv, S), dtype=torch.float32, device=dev) if attention else None
    pv = torch.empty((R, Hkv, S), dtype=torch.float32, device=dev) if pv_norm else None
    victim = torch.empty(R, dtype=torch.int64, device=dev) if select else None
    best = torch.empty(R, dtype=torch.float32, device=dev) if select else None
    if R == 0:
        return out, att, pv, victim, best
    obs = att if att is not None else pv
    sat = (obs.stride(0), obs.stride(1)) if obs is not None else (0, 0)
    position = region_position if region_position is not None else valid  # never read without select
    protect = protect.to(torch.int32) if protect is not None else prefix_len  # likewise
    _fused_kernel[(R, Hkv // heads_per_program)](
        q, pool_k, pool_v, prefix_slots, prefix_len, region_k, region_v, valid, table, region_vnorm, position,
        protect, out, att if att is not None else region_vnorm, pv if pv is not None else region_vnorm,
        victim if victim is not None else prefix_len, best if best is not None else region_vnorm,
        scale, S, region_k.shape[0] - 1,
        q.stride(0), q.stride(1), pool_k.stride(0), pool_k.stride(1), pool_v.stride(0), pool_v.stride(1),
        prefix_slots.stride(0), region_k.stride(0), region_k.stride(1), region_v.stride(0), region_v.stride(1),
        valid.stride(0), table.stride(0), table.stride(1), region_vnorm.stride(0), position.stride(0),
        out.stride(0), out.stride(1), *sat,
        G=G, G_PAD=G_PAD, G_S=G_S, D=D, DV=DV, PAGE=PAGE, BLOCK=block, NA=NA, NB=NB, HEADS=heads_per_program,
        TILE_FP16=tile_fp16, ATTENTION=attention, PV_NORM=pv_norm, SELECT=select,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out, att, pv, victim, best


def decode_attention_observed(q, pool_k, pool_v, prefix_slots, prefix_len, region_k, region_v, region_valid, table,
                              scale, needs: Need = Need.PV_NORM, region_vnorm=None, block: int = BLOCK,
                              num_warps: int = NUM_WARPS, num_stages: int = NUM_STAGES, tile_fp16: bool = TILE_FP16):
    """decode_attention's result for needs within Need.ATTENTION |
    Need.PV_NORM (same inputs, full-precision pages): the output [R, Hq, Dv]
    and attention / pv_norm [R, Hkv, S], from one kernel with no scratch
    (one program per (row, kv head); module docstring)."""
    if needs & ~OBSERVED:
        raise ValueError(f"the fused pass gives {OBSERVED}, not {needs}")
    out, att, pv, _, _ = _launch(q, pool_k, pool_v, prefix_slots, prefix_len, region_k, region_v, region_valid,
                                 table, scale, region_vnorm, 1, bool(needs & Need.ATTENTION),
                                 bool(needs & Need.PV_NORM), False, block=block, num_warps=num_warps,
                                 num_stages=num_stages, tile_fp16=tile_fp16)
    return out, Observations(attention=att, pv_norm=pv)


def longflow_decode(q, pool_k, pool_v, prefix_slots, prefix_len, region_k, region_v, region_valid, table, scale,
                    region_position, protect=None, region_vnorm=None, needs: Need = Need.NONE,
                    block: int = BLOCK, num_warps: int = NUM_WARPS, num_stages: int = NUM_STAGES,
                    tile_fp16: bool = TILE_FP16):
    """Attention, LongFlow's score and its argmin in one kernel (one program
    per row). region_position [pages, page_size] int64 (the region's token
    positions); protect [R] (0/1): whether the newest valid slot is kept out
    of the candidates (LongFlow's default). Returns (output [R, Hq, Dv],
    victim [R] int64 (-1 where no slot is a candidate), its score [R] fp32
    (+inf there), Observations of `needs` within ATTENTION | PV_NORM)."""
    if needs & ~OBSERVED:
        raise ValueError(f"the fused pass gives {OBSERVED}, not {needs}")
    if protect is None:
        protect = torch.ones(q.shape[0], dtype=torch.int32, device=q.device)
    out, att, pv, victim, best = _launch(q, pool_k, pool_v, prefix_slots, prefix_len, region_k, region_v,
                                         region_valid, table, scale, region_vnorm, table.shape[1],
                                         bool(needs & Need.ATTENTION), bool(needs & Need.PV_NORM), True,
                                         region_position=region_position, protect=protect, block=block,
                                         num_warps=num_warps, num_stages=num_stages, tile_fp16=tile_fp16)
    return out, victim, best, Observations(attention=att, pv_norm=pv)


def longflow_select(pv_norm, valid, position, protect=None):
    """LongFlow's merge for pv_norm [R, H, S] (per kv head): score summed
    over heads, argmin over `valid` [R, S] slots (kv head 0's, any strides
    with a unit last one) but, where protect [R] > 0, the newest by
    `position` [R, S]. Returns (victim [R] int64, -1 without a candidate;
    its score [R], +inf there)."""
    R, H, S = pv_norm.shape
    dev = pv_norm.device
    if protect is None:
        protect = torch.ones(R, dtype=torch.int32, device=dev)
    victim = torch.empty(R, dtype=torch.int64, device=dev)
    best = torch.empty(R, dtype=torch.float32, device=dev)
    if R == 0:
        return victim, best
    valid = valid.view(torch.uint8) if valid.dtype == torch.bool else valid
    if pv_norm.stride(-1) != 1 or valid.stride(-1) != 1 or position.stride(-1) != 1:
        raise ValueError("slots must be the unit-stride dimension")
    width = triton.next_power_of_2(max(S, 1))
    chunk = min(width, 256)
    _select_kernel[(R,)](pv_norm, valid, position, protect.to(torch.int32), victim, best, H, S,
                         pv_norm.stride(0), pv_norm.stride(1), valid.stride(0), position.stride(0),
                         CHUNK=chunk, CHUNKS=width // chunk, num_warps=4)
    return victim, best
