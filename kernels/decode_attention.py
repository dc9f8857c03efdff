"""Triton decode attention for compressed rows, with the policies'
observations from the same pass.

One query token per row attends to two parts of its KV: the radix-shared
prefix in SGLang's token pool (slots through `prefix_slots`, a row of
req_to_token) and the row's private slots in the compressed region (pages
through the layer's page table, a valid bit per slot). Both are one index
space per row, [prefix 0..P) then [region 0..S), split into chunks that run
in parallel (split-KV); a second kernel merges the chunks with their
log-sum-exp. GQA: one program serves the G query heads of a kv head, so each
key and value is read once for the group.

Observations (policies.observations.Need) cost a third kernel and, in the
first, one fp32 logit per (query head, key) written to a scratch buffer:
with the final log-sum-exp known after the merge, the third kernel turns
them into the probability mass per region slot summed over the group
(ATTENTION), that mass times ||v||_1 (PV_NORM: ||p v||_1 = p ||v||_1 for
p >= 0) and, per query head, the share of keys whose probability is below
1% of the row's largest (SPARSITY). K/V are never read twice.

`kernels.attention_ref.attend_rows` is the PyTorch reference of the same
computation (tests compare the two).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kvsieve.policies.observations import Need, Observations

from . import interpreter_compat, longflow_fused
from .attention_ref import SPARSITY_THRESHOLD

interpreter_compat.apply()

#: Keys per inner-loop block.
BLOCK_N = 32
#: The quantized path serving uses: "new" (blocks of BLOCK_N slots, 4 warps),
#: checked against the reference and timed on an H100 against "old" (one
#: page per block): 1.6-3.1x faster on every case of
#: bench/results/gpu-kernels-tbq.json (2026-11-25, `bench/tbq_kernel.py OUT
#: --quick --variant old,new --blocks 32,64`); "old" stays for A/B timings.
SERVING_TBQ_VARIANT = "new"
#: Key blocks one program of the observation kernel reads (fewer, larger programs).
OBSERVE_BLOCKS_PER_PROGRAM = 8
#: ln(SPARSITY_THRESHOLD): a probability below threshold x the row max has a
#: logit below the row's max logit + this.
LOG_SPARSITY = math.log(SPARSITY_THRESHOLD)
#: Keys of one split by default: the prefix and the region each start at a
#: split boundary, so a row's keys fall in the same splits whatever the
#: batch's longest prefix and widest row (row_splits; doubled past
#: MAX_DEFAULT_SPLITS splits, which only batches of over 8K keys reach).
KEYS_PER_SPLIT = 512
MAX_DEFAULT_SPLITS = 16

#: row_observe's bits, OBSERVE_BITS of them a layer group (a step's first
#: layer from bit 0, its later layers above): the region's attention; the
#: prefix's and region's sparsity; the region's |p*v| (with OBSERVE_REGION).
#: |p*v| has a bit of its own because only LongFlow reads it: in a mixed
#: batch the other observing rows skip loading their values' norms.
OBSERVE_REGION = tl.constexpr(1)
OBSERVE_SPARSITY = tl.constexpr(2)
OBSERVE_PV = tl.constexpr(4)
OBSERVE_BITS = tl.constexpr(3)
OBSERVE_ALL = tl.constexpr(7)  # the bits of one layer group

# Integers that follow the step's shapes (widths, prefixes, split counts and
# the strides of scratch sized by them) are not specialized: Triton compiles
# a kernel per value of "equals 1" and "16 divides it" of each specialized
# integer, and a flip mid-serving is a compile of seconds while every request
# waits (tests/interpreted/test_kernel_specialization.py). What stays
# specialized is fixed per server (the model's and the region's strides) or
# always a multiple of 16 (the logits' strides, whose stores are vectors).


@triton.jit
def _e4m3(bits):
    """FP8 E4M3 bits (int32, 0..255) as float32."""
    e = (bits >> 3) & 15
    m = (bits & 7).to(tl.float32)
    mag = tl.where(e == 0, m * 0.001953125, (8.0 + m) * tl.exp2((e - 10).to(tl.float32)))
    return tl.where((bits & 128) != 0, -mag, mag)


@triton.jit
def _e2m1(nib):
    """E2M1 codes (int32, 0..15: sign << 3 | exponent << 1 | mantissa) as
    float32, through FP16 bits: no transcendental per element."""
    e = (nib >> 1) & 3
    m = nib & 1
    bits = tl.where(e == 0, m * (14 << 10), ((e + 14) << 10) | (m << 9)) | ((nib & 8) << 12)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _quantized_page(Codes, Scale, PageScale, row, off, fmt, d, sq_c, sq_o, ss_r, ss_o, ok, PER_CHANNEL: tl.constexpr):
    """One quantized page's slots [PAGE, D] as float32 (kernels.kv_formats),
    its format `fmt` a scalar (a block is one page): only that format's
    bytes are read and decoded. PER_CHANNEL: keys (an E4M3 scale per channel
    of the page) or values (per 16 channels of a slot)."""
    base = Codes + row * sq_c + off[:, None] * sq_o
    page_scale = tl.load(PageScale + row * 2)  # [pages, 2]: keys, values
    if fmt == 3:  # FP8: a byte per element, the page's FP32 scale
        x = _e4m3(tl.load(base + d[None, :], mask=ok[:, None], other=0).to(tl.int32))
    else:
        if PER_CHANNEL:
            group = _e4m3(tl.load(Scale + row * ss_r + d).to(tl.int32))[None, :]
        else:
            group = _e4m3(tl.load(Scale + row * ss_r + off[:, None] * ss_o + d[None, :] // 16, mask=ok[:, None],
                                  other=0).to(tl.int32))
        if fmt == 2:  # NVFP4: two per byte, element 2j in the low nibble
            b = tl.load(base + d[None, :] // 2, mask=ok[:, None], other=0).to(tl.int32)
            x = _e2m1((b >> ((d[None, :] % 2) * 4)) & 15) * group
        else:  # ternary: four per byte; 01 = +1, 11 = -1
            b = tl.load(base + d[None, :] // 4, mask=ok[:, None], other=0).to(tl.int32)
            two = (b >> ((d[None, :] % 4) * 2)) & 3
            x = ((two == 1).to(tl.float32) - (two == 3).to(tl.float32)) * group
    return x * page_scale


@triton.jit
def _e4m3_fp16(bits):
    """FP8 E4M3 bits (int32, 0..255) as FP16 holding the value / 256: the
    exponent and mantissa bits shifted into FP16's fields give it exactly,
    subnormals included (two shifts and masks, no exp2)."""
    return (((bits & 127) << 7) | ((bits & 128) << 8)).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _spread_ternary(t):
    """16-bit words of ternary codes (int32; eight 2-bit codes, code i at
    bits 2i) as 32-bit words of eight E2M1 nibbles (nibble i at bits 4i),
    NVFP4's layout: code bit 0 (nonzero) becomes 1.0's exponent bit, bit 1
    the sign; so 01 -> +1.0, 11 -> -1.0, 10 -> -0. Ten operations per
    eight codes."""
    x = (t | (t << 8)) & 0x00FF00FF
    x = (x | (x << 4)) & 0x0F0F0F0F
    x = (x | (x << 2)) & 0x33333333
    return ((x & 0x11111111) << 1) | ((x & 0x22222222) << 2)


@triton.jit
def _nibble_pair(w, i: tl.constexpr):
    """Nibbles i and i + 4 of 32-bit words w (int32) as FP16 bits in the low
    and high half of one int32 (two elements per operation): each FP16 holds
    the E2M1 value / 2^14, the three magnitude bits landing in FP16's
    exponent and top mantissa bit (0.5 as a subnormal), the fourth in the
    sign. Returns the two halves as FP16."""
    if i == 3:
        mag = (w >> 3) & 0x0E000E00
    else:
        mag = (w << (9 - 4 * i)) & 0x0E000E00
    h = mag | ((w << (12 - 4 * i)) & -2147450880)  # 0x80008000 as an int32
    lo = (h & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)
    hi = (h >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    return lo, hi


@triton.jit
def _packed_tile(Halves, Words, row, off, nv, tern, sh_c, sh_o, sw_c, sw_o, BLOCK: tl.constexpr, D: tl.constexpr):
    """Codes of BLOCK slots in NVFP4 (`nv`) or ternary (`tern`) as [BLOCK, D]
    FP16 (E2M1 value / 2^14; 0 where neither). Each slot's bytes are read
    once, as 32-bit words of eight elements: NVFP4 words (`Words`, an int32
    view of the codes), ternary 16-bit words (`Halves`, an int16 view)
    spread to the same nibble layout, so one decode serves both formats and
    a block may mix them."""
    j = tl.arange(0, D // 8)
    w = tl.load((Words + row * sw_c + off * sw_o)[:, None] + j[None, :], mask=nv[:, None], other=0)
    t = tl.load((Halves + row * sh_c + off * sh_o)[:, None] + j[None, :], mask=tern[:, None], other=0)
    w = w | _spread_ternary(t.to(tl.int32) & 0xFFFF)
    lo0, hi0 = _nibble_pair(w, 0)
    lo1, hi1 = _nibble_pair(w, 1)
    lo2, hi2 = _nibble_pair(w, 2)
    lo3, hi3 = _nibble_pair(w, 3)
    # [.., j, half, i // 2, i % 2]: element 8j + 4 half + i.
    x = tl.join(tl.join(tl.join(lo0, hi0), tl.join(lo2, hi2)), tl.join(tl.join(lo1, hi1), tl.join(lo3, hi3)))
    return tl.reshape(x, [BLOCK, D])


@triton.jit
def _fp8_tile(Codes, row, off, fp8, sq_c, sq_o, D: tl.constexpr):
    """FP8 slots' codes as [BLOCK, D] float32 / 256 (0 for the others)."""
    d = tl.arange(0, D)
    b = tl.load((Codes + row * sq_c + off * sq_o)[:, None] + d[None, :], mask=fp8[:, None], other=0)
    return _e4m3_fp16(b.to(tl.int32)).to(tl.float32)  # / 256: folded into the page scale


@triton.jit
def _scores(q, k, seen, scale):
    qk = tl.dot(q, tl.trans(k)).to(tl.float32) * scale  # [G_PAD, BLOCK]
    return tl.where(seen[None, :], qk, float("-inf"))


@triton.jit
def _softmax_block(qk, m, n, hq, g_ok, keep, Logits, BlockMax, r, slg_r, slg_h, sbm_r, sbm_h,
                   BLOCK: tl.constexpr, STORE: tl.constexpr):
    """Online-softmax step of one block: the new running max, the factor of
    the old terms and the block's probabilities; with STORE, the block's
    fp16 logits relative to its running max (<= 0: fp16 keeps them to
    ~1e-3 where the probability matters) and that max, for the
    observations."""
    m_new = tl.maximum(m, tl.max(qk, 1))
    if STORE:
        tl.store(Logits + r * slg_r + hq[:, None] * slg_h + n[None, :], (qk - m_new[:, None]).to(tl.float16),
                 mask=g_ok[:, None] & keep[None, :])
        tl.store(BlockMax + r * sbm_r + hq * sbm_h + tl.min(n, 0) // BLOCK, m_new, mask=g_ok)
    return m_new, tl.exp(m - m_new), tl.exp(qk - m_new[:, None])


@triton.jit
def _accumulate(qk, v, m, l, acc, n, hq, g_ok, keep, Logits, BlockMax, r, slg_r, slg_h, sbm_r, sbm_h,
                BLOCK: tl.constexpr, STORE: tl.constexpr):
    """Online softmax over one block (`_softmax_block`), values added."""
    m_new, alpha, p = _softmax_block(qk, m, n, hq, g_ok, keep, Logits, BlockMax, r, slg_r, slg_h, sbm_r, sbm_h,
                                     BLOCK, STORE)
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
    return m_new, l, acc


@triton.jit
def _page_kinds(Table, r, h, st_r, st_h, first, end, P_pad, null_page, PAGE: tl.constexpr):
    """Whether the region's keys [first, end) lie in full-precision pages
    (int32 0/1) and whether in quantized ones: a program picks its loop once
    (a TBQ row's full page is its first column, so most of its splits hold
    quantized pages only; rows without TBQ hold full pages only)."""
    full = tl.full([], 0, tl.int32)
    quant = tl.full([], 0, tl.int32)
    for p0 in range((first - P_pad) // PAGE, tl.cdiv(end - P_pad, PAGE), 64):
        p = p0 + tl.arange(0, 64)
        page = tl.load(Table + r * st_r + h * st_h + p, mask=p * PAGE < end - P_pad, other=null_page)
        full = tl.maximum(full, tl.max((page < null_page).to(tl.int32), 0))
        quant = tl.maximum(quant, tl.max((page > null_page).to(tl.int32), 0))
    return full, quant


@triton.jit
def _full_region(q, m, l, acc, r, h, hq, g_ok, first, end, P_pad, null_page, scale, Table, Valid, RegK, RegV,
                 Logits, BlockMax, srk_p, srk_o, srv_p, srv_o, sva_p, st_r, st_h, slg_r, slg_h, sbm_r, sbm_h,
                 D: tl.constexpr, DV: tl.constexpr, PAGE: tl.constexpr, BLOCK: tl.constexpr, STORE: tl.constexpr):
    """The region's keys [first, end) over full-precision pages only."""
    d = tl.arange(0, D)
    dv = tl.arange(0, DV)
    for n0 in range(first, end, BLOCK):
        n = n0 + tl.arange(0, BLOCK)
        in_region = n < end
        s = n - P_pad
        page = tl.load(Table + r * st_r + h * st_h + s // PAGE, mask=in_region, other=null_page)
        off = s % PAGE
        seen = in_region & (tl.load(Valid + page * sva_p + off, mask=in_region, other=0) != 0)
        k = tl.load(RegK + page[:, None] * srk_p + off[:, None] * srk_o + d[None, :], mask=seen[:, None], other=0.0)
        v = tl.load(RegV + page[:, None] * srv_p + off[:, None] * srv_o + dv[None, :], mask=seen[:, None], other=0.0)
        m, l, acc = _accumulate(_scores(q, k, seen, scale), v, m, l, acc, n, hq, g_ok, in_region, Logits, BlockMax,
                                r, slg_r, slg_h, sbm_r, sbm_h, BLOCK, STORE)
    return m, l, acc


@triton.jit
def _tbq_region(q, m, l, acc, r, h, hq, g_ok, first, end, P_pad, null_page, scale,
                Table, Valid, Format, RegK, RegV, QK, QKW, QKH, QV, QVW, QVH, QKScale, QVScale, QPageScale, Logits,
                BlockMax, sq_c, sq_o, sw_c, sw_o, sh_c, sh_o, sqks_r, sqvs_r, sqvs_o, srk_p, srk_o, srv_p, srv_o, sva_p,
                st_r, st_h, slg_r, slg_h, sbm_r, sbm_h,
                D: tl.constexpr, DV: tl.constexpr, PAGE: tl.constexpr, BLOCK: tl.constexpr, STORE: tl.constexpr,
                HAS_FP8: tl.constexpr, FULL: tl.constexpr):
    """The region's keys [first, end) over quantized pages (and, with FULL,
    full-precision ones), BLOCK slots (BLOCK / PAGE pages) per trip with no
    branch on the data: each slot's loads are masked by its page's kind and
    format (full, NVFP4, ternary, FP8), so a block mixes them and the loop
    is one straight body the compiler can pipeline. Page scales scale the
    logits (keys) and the probabilities (values) per slot instead of every
    element; the keys' channel scales are decoded once per page."""
    d = tl.arange(0, D)
    dv = tl.arange(0, DV)
    PAGES: tl.constexpr = BLOCK // PAGE
    for n0 in range(first, end, BLOCK):
        n = n0 + tl.arange(0, BLOCK)
        in_region = n < end
        s = n - P_pad
        page = tl.load(Table + r * st_r + h * st_h + s // PAGE, mask=in_region, other=null_page)
        off = s % PAGE
        seen = in_region & (tl.load(Valid + page * sva_p + off, mask=in_region, other=0) != 0)
        quant = page > null_page  # radix_ext/tbq_store.py: quantized rows follow the null page
        row = tl.where(quant, page - null_page - 1, 0)
        fmt = tl.where(quant, tl.load(Format + page, mask=in_region, other=0).to(tl.int32), 0)
        nv = seen & (fmt == 2)
        tern = seen & (fmt == 1)
        fp8 = seen & (fmt == 3)
        packed = nv | tern
        # Per page: the keys' E4M3 channel scales (/ 256, as _e4m3_fp16 gives them).
        first_page = (n0 - P_pad) // PAGE + tl.arange(0, PAGES)
        ppage = tl.load(Table + r * st_r + h * st_h + first_page, mask=n0 + tl.arange(0, PAGES) * PAGE < end,
                        other=null_page)
        pfmt = tl.load(Format + ppage).to(tl.int32)
        prow = tl.where(ppage > null_page, ppage - null_page - 1, 0)
        ks = tl.load(QKScale + prow[:, None] * sqks_r + d[None, :],
                     mask=((ppage > null_page) & ((pfmt == 1) | (pfmt == 2)))[:, None], other=0)
        ks = _e4m3_fp16(ks.to(tl.int32)).to(tl.float32)
        kx = _packed_tile(QKH, QKW, row, off, nv, tern, sh_c, sh_o, sw_c, sw_o, BLOCK, D).to(tl.float32)
        kx = tl.reshape(tl.reshape(kx, [PAGES, PAGE, D]) * ks[:, None, :], [BLOCK, D])
        if HAS_FP8:
            kx = tl.where(fp8[:, None], _fp8_tile(QK, row, off, fp8, sq_c, sq_o, D), kx)
        if FULL:
            kf = tl.load((RegK + page * srk_p + off * srk_o)[:, None] + d[None, :], mask=(seen & ~quant)[:, None],
                         other=0.0)
            k = tl.where(quant[:, None], kx.to(q.dtype), kf)
        else:
            k = kx.to(q.dtype)
        # Per slot: the FP32 page scales (1 on full pages), times what the FP16 decodes left out: 2^8 for
        # E4M3 (FP8 codes, group scales) and 2^14 for E2M1.
        unit = tl.where(fp8, 256.0, tl.where(packed, 4194304.0, 1.0))
        kcol = tl.load(QPageScale + row * 2, mask=seen & quant, other=1.0) * unit
        vcol = tl.load(QPageScale + row * 2 + 1, mask=seen & quant, other=1.0) * unit
        qk = tl.dot(q, tl.trans(k)).to(tl.float32) * (kcol * scale)[None, :]
        qk = tl.where(seen[None, :], qk, float("-inf"))
        # Values: an E4M3 scale per 16 channels of a slot.
        vs = tl.load((QVScale + row * sqvs_r + off * sqvs_o)[:, None] + tl.arange(0, DV // 16)[None, :],
                     mask=packed[:, None], other=0)
        vs = _e4m3_fp16(vs.to(tl.int32)).to(tl.float32)
        vx = _packed_tile(QVH, QVW, row, off, nv, tern, sh_c, sh_o, sw_c, sw_o, BLOCK, DV).to(tl.float32)
        vx = tl.reshape(tl.reshape(vx, [BLOCK, DV // 16, 16]) * vs[:, :, None], [BLOCK, DV])
        if HAS_FP8:
            vx = tl.where(fp8[:, None], _fp8_tile(QV, row, off, fp8, sq_c, sq_o, DV), vx)
        if FULL:
            vf = tl.load((RegV + page * srv_p + off * srv_o)[:, None] + dv[None, :], mask=(seen & ~quant)[:, None],
                         other=0.0)
            v = tl.where(quant[:, None], vx.to(vf.dtype), vf)
        else:
            v = vx.to(RegV.dtype.element_ty)
        m_new, alpha, p = _softmax_block(qk, m, n, hq, g_ok, in_region, Logits, BlockMax, r, slg_r, slg_h, sbm_r,
                                         sbm_h, BLOCK, STORE)
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot((p * vcol[None, :]).to(v.dtype), v).to(tl.float32)
        m = m_new
    return m, l, acc


#: Pointers to one value per row (prefix lengths, columns, observe bits):
#: views into a step's shipped bytes (policies.observations.rows_to_device,
#: radix_ext/byte_pack.py), so their 16-byte alignment follows the row count.
#: Triton specializes pointers on that alignment: a new row count compiled
#: another variant in the middle of serving (1.1 s a step, H200 traffic
#: 2026-11-29). They are read one value a program, so nothing is lost.
@triton.jit(do_not_specialize=["P_pad", "S", "keys_per_split", "sps_r", "st_r", "st_h", "spo_r", "spo_h", "spm_r",
                               "spm_h", "sbm_r", "sbm_h"],
            do_not_specialize_on_alignment=["PrefixLen", "RowColumns"])
def _partial_kernel(
    Q, PoolK, PoolV, PrefixSlots, PrefixLen, RegK, RegV, Valid, Table, RowColumns,
    PartO, PartM, PartL, Logits, BlockMax,
    Format, QK, QV, QKScale, QVScale, QPageScale, QKW, QVW, QKH, QVH,
    scale, P_pad, S, keys_per_split, null_page,
    sq_c, sq_o, sqks_r, sqvs_r, sqvs_o, sw_c, sw_o, sh_c, sh_o,
    sq_r, sq_h,
    spk_n, spk_h, spv_n, spv_h,
    sps_r, srk_p, srk_o, srv_p, srv_o, sva_p,
    st_r, st_h,
    spo_r, spo_h, spo_s, spm_r, spm_h,
    slg_r, slg_h, sbm_r, sbm_h,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, PAGE: tl.constexpr,
    BLOCK: tl.constexpr, STORE_REGION_LOGITS: tl.constexpr, STORE_PREFIX_LOGITS: tl.constexpr,
    QUANT: tl.constexpr, HAS_FP8: tl.constexpr,
):
    """Grid (rows, kv heads, splits): one split of one row's keys for the G
    query heads of one kv head; partial output, max and sum per query head.
    Keys: [0, P_pad) the prefix (padded to whole blocks), then [P_pad,
    P_pad + S) the region; a block is all prefix or all region, so each part
    has a loop of its own with only its loads. QUANT: 0 full-precision
    pages only; 1 quantized pages too, a block being one page with a branch
    on its format (the "old" variant); 2 quantized pages too, blocks of
    several pages of any formats (`_tbq_region`)."""
    r = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    g = tl.arange(0, G_PAD)
    g_ok = g < G
    hq = h * G + g
    d = tl.arange(0, D)
    dv = tl.arange(0, DV)
    plen = tl.load(PrefixLen + r)
    start = split * keys_per_split  # a multiple of BLOCK, as P_pad is
    row_end = _row_end(RowColumns, r, P_pad, S, PAGE)
    if _dead_split(split, keys_per_split, plen, P_pad, row_end):
        return  # nothing of this row's: the merge skips it
    q = tl.load(Q + r * sq_r + hq[:, None] * sq_h + d[None, :], mask=g_ok[:, None], other=0.0)
    end = tl.minimum(start + keys_per_split, row_end)
    m = tl.full([G_PAD], -1e30, tl.float32)
    l = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, DV], tl.float32)
    # The shared prefix, in SGLang's token pool: this row's blocks only (P_pad
    # is the batch's longest prefix; the blocks past the row's own are
    # skipped, their logits left unwritten: the observation masks them).
    for n0 in range(start, tl.minimum(tl.minimum(end, P_pad), tl.cdiv(plen, BLOCK) * BLOCK), BLOCK):
        n = n0 + tl.arange(0, BLOCK)
        seen = n < plen
        slot = tl.load(PrefixSlots + r * sps_r + n, mask=seen, other=0)
        k = tl.load(PoolK + slot[:, None] * spk_n + h * spk_h + d[None, :], mask=seen[:, None], other=0.0)
        v = tl.load(PoolV + slot[:, None] * spv_n + h * spv_h + dv[None, :], mask=seen[:, None], other=0.0)
        m, l, acc = _accumulate(_scores(q, k, seen, scale), v, m, l, acc, n, hq, g_ok, n < P_pad, Logits, BlockMax,
                                r, slg_r, slg_h, sbm_r, sbm_h, BLOCK, STORE_PREFIX_LOGITS)
    if QUANT == 2:  # one of three loops per program, by the kinds of pages its keys lie in
        first = tl.maximum(start, P_pad)
        full, quant = _page_kinds(Table, r, h, st_r, st_h, first, end, P_pad, null_page, PAGE)
        if quant == 0:
            m, l, acc = _full_region(q, m, l, acc, r, h, hq, g_ok, first, end, P_pad, null_page, scale, Table, Valid,
                                     RegK, RegV, Logits, BlockMax, srk_p, srk_o, srv_p, srv_o, sva_p, st_r, st_h,
                                     slg_r, slg_h, sbm_r, sbm_h, D, DV, PAGE, BLOCK, STORE_REGION_LOGITS)
        elif full == 0:
            m, l, acc = _tbq_region(q, m, l, acc, r, h, hq, g_ok, first, end, P_pad, null_page, scale, Table, Valid,
                                    Format, RegK, RegV, QK, QKW, QKH, QV, QVW, QVH, QKScale, QVScale, QPageScale,
                                    Logits, BlockMax, sq_c, sq_o, sw_c, sw_o, sh_c, sh_o, sqks_r, sqvs_r, sqvs_o,
                                    srk_p, srk_o, srv_p, srv_o, sva_p, st_r, st_h, slg_r, slg_h, sbm_r, sbm_h, D, DV,
                                    PAGE, BLOCK, STORE_REGION_LOGITS, HAS_FP8, False)
        else:
            m, l, acc = _tbq_region(q, m, l, acc, r, h, hq, g_ok, first, end, P_pad, null_page, scale, Table, Valid,
                                    Format, RegK, RegV, QK, QKW, QKH, QV, QVW, QVH, QKScale, QVScale, QPageScale,
                                    Logits, BlockMax, sq_c, sq_o, sw_c, sw_o, sh_c, sh_o, sqks_r, sqvs_r, sqvs_o,
                                    srk_p, srk_o, srv_p, srv_o, sva_p, st_r, st_h, slg_r, slg_h, sbm_r, sbm_h, D, DV,
                                    PAGE, BLOCK, STORE_REGION_LOGITS, HAS_FP8, True)
    else:
        for n0 in range(tl.maximum(start, P_pad), end, BLOCK):  # the private slots, in region pages
            n = n0 + tl.arange(0, BLOCK)
            in_region = n < end
            s = n - P_pad
            page = tl.load(Table + r * st_r + h * st_h + s // PAGE, mask=in_region, other=null_page)
            off = s % PAGE
            seen = in_region & (tl.load(Valid + page * sva_p + off, mask=in_region, other=0) != 0)
            if QUANT == 1:  # a block is one page; pages past the null page are quantized (radix_ext/tbq_store.py)
                pid = tl.max(page, 0)
                if pid > null_page:
                    row = pid - null_page - 1
                    fmt = tl.load(Format + pid).to(tl.int32)
                    k = _quantized_page(QK, QKScale, QPageScale, row, off, fmt, d, sq_c, sq_o, sqks_r, 0, seen,
                                        True).to(q.dtype)
                    v = _quantized_page(QV, QVScale, QPageScale + 1, row, off, fmt, dv, sq_c, sq_o, sqvs_r, sqvs_o,
                                        seen, False).to(RegV.dtype.element_ty)
                else:
                    k = tl.load(RegK + page[:, None] * srk_p + off[:, None] * srk_o + d[None, :], mask=seen[:, None],
                                other=0.0)
                    v = tl.load(RegV + page[:, None] * srv_p + off[:, None] * srv_o + dv[None, :], mask=seen[:, None],
                                other=0.0)
            else:
                k = tl.load(RegK + page[:, None] * srk_p + off[:, None] * srk_o + d[None, :], mask=seen[:, None],
                            other=0.0)
                v = tl.load(RegV + page[:, None] * srv_p + off[:, None] * srv_o + dv[None, :], mask=seen[:, None],
                            other=0.0)
            m, l, acc = _accumulate(_scores(q, k, seen, scale), v, m, l, acc, n, hq, g_ok, in_region, Logits,
                                    BlockMax, r, slg_r, slg_h, sbm_r, sbm_h, BLOCK, STORE_REGION_LOGITS)
    tl.store(PartO + r * spo_r + hq[:, None] * spo_h + split * spo_s + dv[None, :], acc, mask=g_ok[:, None])
    tl.store(PartM + r * spm_r + hq * spm_h + split, m, mask=g_ok)
    tl.store(PartL + r * spm_r + hq * spm_h + split, l, mask=g_ok)


@triton.jit
def _dead_split(split, keys_per_split, plen, P_pad, row_end):
    """A split that sees none of the row's keys: wholly past the row's
    prefix and before the region (a batch's longer prefix made it), or past
    the row's own region columns (a batch's wider row made it: a mixed
    batch's snapkv or `full` rows; every region split of a pool-only row).
    The partial kernel writes nothing for it and the merge skips it, as it
    would add an empty split's exact zeros (m -1e30, l 0, o 0)."""
    start = split * keys_per_split
    return ((start >= plen) & (start + keys_per_split <= P_pad)) | (start >= row_end)


@triton.jit
def _row_end(RowColumns, r, P_pad, S, PAGE: tl.constexpr):
    """The end of row r's keys: the step is padded to its widest row (one
    long row widens every row), and the columns past a row's own hold null
    pages only."""
    return P_pad + tl.minimum(S, tl.load(RowColumns + r).to(tl.int32) * PAGE)


@triton.jit(do_not_specialize=["num_splits", "keys_per_split", "P_pad", "S", "spo_r", "spo_h", "spm_r", "spm_h"],
            do_not_specialize_on_alignment=["PrefixLen", "RowColumns"])
def _merge_kernel(
    PartO, PartM, PartL, Out, Lse, RowMax, PrefixLen, RowColumns,
    num_splits, keys_per_split, P_pad, S, spo_r, spo_h, spo_s, spm_r, spm_h, so_r, so_h,
    DV: tl.constexpr, PAGE: tl.constexpr,
):
    """Grid (rows, query heads): the splits merged by their log-sum-exp, one
    after another in split order. A split that saw none of the row's keys
    (m -1e30, l 0, o 0) adds exact zeros, so the merge of a row's splits is
    the same bits however many empty splits a batch puts between them (a
    tree sum pairs them differently by their positions); the splits between
    the row's prefix and the region, and those past its own columns, are not
    even read (_dead_split)."""
    r = tl.program_id(0)
    hq = tl.program_id(1)
    dv = tl.arange(0, DV)
    plen = tl.load(PrefixLen + r)
    row_end = _row_end(RowColumns, r, P_pad, S, PAGE)
    top = tl.full([], -1e30, tl.float32)
    for sp in range(num_splits):
        live = _dead_split(sp, keys_per_split, plen, P_pad, row_end) == 0
        top = tl.maximum(top, tl.load(PartM + r * spm_r + hq * spm_h + sp, mask=live, other=-1e30))
    total = tl.full([], 0.0, tl.float32)
    acc = tl.zeros([DV], tl.float32)
    for sp in range(num_splits):
        live = _dead_split(sp, keys_per_split, plen, P_pad, row_end) == 0
        w = tl.exp(tl.load(PartM + r * spm_r + hq * spm_h + sp, mask=live, other=-1e30) - top)
        total += tl.load(PartL + r * spm_r + hq * spm_h + sp, mask=live, other=0.0) * w
        acc += tl.load(PartO + r * spo_r + hq * spo_h + sp * spo_s + dv, mask=live, other=0.0) * w
    merged = acc / tl.maximum(total, 1e-30)  # a row that sees nothing: 0
    tl.store(Out + r * so_r + hq * so_h + dv, merged.to(Out.dtype.element_ty))
    heads = tl.num_programs(1)
    tl.store(Lse + r * heads + hq, top + tl.log(tl.maximum(total, 1e-30)))
    tl.store(RowMax + r * heads + hq, top)


@triton.jit(do_not_specialize=["P_pad", "S", "first_block", "sbm_r", "sbm_h", "svn_p", "st_r", "st_h", "sat_r",
                               "sat_h", "observe_shift"],
            do_not_specialize_on_alignment=["PrefixLen", "RowColumns", "RowObserve"])  # per-row views (_partial_kernel)
def _observe_kernel(
    Logits, BlockMax, Lse, RowMax, RegV, VNorm, Table, Valid, Attention, PvNorm, Sparse, Seen, PrefixLen, RowColumns,
    RowObserve, P_pad, S, first_block, null_page, slg_r, slg_h, sbm_r, sbm_h, srv_p, srv_o, svn_p, sva_p, st_r, st_h,
    sat_r, sat_h, Hq, log_sparsity, observe_shift,
    G: tl.constexpr, G_PAD: tl.constexpr, DV: tl.constexpr, PAGE: tl.constexpr, BLOCK: tl.constexpr,
    BLOCKS_PER_PROGRAM: tl.constexpr,
    ATTENTION: tl.constexpr, PV_NORM: tl.constexpr, HAS_VNORM: tl.constexpr, SPARSITY: tl.constexpr,
    PER_ROW: tl.constexpr,
):
    """Grid (rows, kv heads, groups of key blocks from first_block):
    probabilities from the stored logits and the final log-sum-exp.
    PER_ROW: RowObserve [R] says, from bit observe_shift, which of the
    step's observations each row's own policy reads (OBSERVE_REGION,
    OBSERVE_SPARSITY, OBSERVE_PV); a row's blocks it reads nothing of are
    skipped (in a mixed batch `full` rows and rows of policies that read
    no observation, and every row's prefix but those reading sparsity), and
    only the rows that read |p*v| (LongFlow's) load their values' norms."""
    r = tl.program_id(0)
    h = tl.program_id(1)
    g = tl.arange(0, G_PAD)
    g_ok = g < G
    hq = h * G + g
    plen = tl.load(PrefixLen + r)
    row_end = _row_end(RowColumns, r, P_pad, S, PAGE)
    if PER_ROW:
        wants = (tl.load(RowObserve + r).to(tl.int32) >> observe_shift) & OBSERVE_ALL
        if wants == 0:
            return
        sparsity_row = (wants & OBSERVE_SPARSITY) != 0
        region_row = (wants & OBSERVE_REGION) != 0
        pv_row = (wants & OBSERVE_PV) != 0
    else:
        sparsity_row = row_end >= 0  # every row
        region_row = sparsity_row
        pv_row = sparsity_row
    skip_to = tl.where(sparsity_row, 0, P_pad)  # the prefix's logits serve sparsity only
    region_end = tl.where(region_row, row_end, 0)  # the region's written for attention / |p*v|
    # A program whose blocks hold none of the keys it would count returns
    # at once: in a batch with a long prefix (a `full` row), every other
    # row's blocks between its own prefix and the region.
    lo = (first_block + tl.program_id(2) * BLOCKS_PER_PROGRAM) * BLOCK
    hi = lo + BLOCKS_PER_PROGRAM * BLOCK
    live = (lo < row_end) & (hi > tl.maximum(P_pad, skip_to))  # region keys
    if SPARSITY:  # and the row's own prefix keys
        live = live | ((lo < tl.minimum(plen, P_pad)) & (hi > skip_to))
    if live == 0:
        return
    if SPARSITY:
        top = tl.load(RowMax + r * Hq + hq, mask=g_ok, other=0.0)
        sparse_count = tl.zeros([G_PAD], tl.float32)
        seen_count = tl.zeros([G_PAD], tl.float32)
    if ATTENTION or PV_NORM:
        lse = tl.load(Lse + r * Hq + hq, mask=g_ok, other=0.0)
    for i in tl.static_range(BLOCKS_PER_PROGRAM):
        block = first_block + tl.program_id(2) * BLOCKS_PER_PROGRAM + i
        # Each row's work stops at its own end (a narrow row beside a wide
        # one: the step's blocks past it hold nothing of the row's), and a
        # row computes only what its policy reads: in a mixed batch the
        # sparsity counts are ThinKV's rows' and the mass the others'.
        if block * BLOCK < row_end:
            n = block * BLOCK + tl.arange(0, BLOCK)
            in_range = (n < row_end) & (n >= skip_to)  # past row_end the partial kernel wrote nothing (no mass)
            region = in_range & (n >= P_pad) & (n < region_end)
            # Prefix keys past the row's own prefix were never scored (nor stored).
            counted = in_range & ((n >= P_pad) | (n < plen))
            if not SPARSITY:
                counted = region
            rel = tl.load(Logits + r * slg_r + hq[:, None] * slg_h + n[None, :],
                          mask=g_ok[:, None] & counted[None, :], other=float("-inf")).to(tl.float32)
            logits = rel + tl.load(BlockMax + r * sbm_r + hq * sbm_h + block, mask=g_ok, other=0.0)[:, None]
            if SPARSITY:
                if sparsity_row:
                    seen = logits > float("-inf")
                    sparse_count += tl.sum((seen & (logits < top[:, None] + log_sparsity)).to(tl.float32), 1)
                    seen_count += tl.sum(seen.to(tl.float32), 1)
            if ATTENTION or PV_NORM:
                if region_row:
                    s = tl.where(region, n - P_pad, 0)
                    mass = tl.sum(tl.exp(logits - lse[:, None]), 0)  # -inf (unseen keys, padding heads): 0
                    if ATTENTION:
                        tl.store(Attention + r * sat_r + h * sat_h + s, mass, mask=region)
                    if PV_NORM:
                        pv = region & pv_row
                        page = tl.load(Table + r * st_r + h * st_h + s // PAGE, mask=pv, other=null_page)
                        off = s % PAGE
                        if HAS_VNORM:
                            norm = tl.load(VNorm + page * svn_p + off, mask=pv, other=0.0)
                        else:
                            dv = tl.arange(0, DV)
                            v = tl.load(RegV + page[:, None] * srv_p + off[:, None] * srv_o + dv[None, :],
                                        mask=pv[:, None], other=0.0)
                            norm = tl.sum(tl.abs(v.to(tl.float32)), 1)
                        tl.store(PvNorm + r * sat_r + h * sat_h + s, mass * norm, mask=pv)
    if SPARSITY:
        if sparsity_row:
            tl.atomic_add(Sparse + r * Hq + hq, sparse_count, mask=g_ok)
            tl.atomic_add(Seen + r * Hq + hq, seen_count, mask=g_ok)


def default_splits(keys: int) -> int:
    """The split count of the layout before row_splits (splits of a batch's
    own keys: about 512 each, at most 16, from a sweep of 1-32 on an H100):
    what `num_splits` reproduces it with, for A/B timings and the batch-
    invariance test. decode_attention's default is row_splits."""
    return int(max(1, min(MAX_DEFAULT_SPLITS, triton.cdiv(max(keys, 1), KEYS_PER_SPLIT))))


def row_splits(prefix: int, slots: int, block: int) -> tuple[int, int]:
    """The default split layout (keys per split, padded prefix): splits of
    KEYS_PER_SPLIT keys, the prefix padded to whole splits so the region
    starts on a split boundary. A row's prefix keys then fall in splits
    0, 1, ... and its region keys in the region's first splits on, the same
    for the row alone and beside longer rows: its outputs are the same bits
    in any batch (the merge adds the empty splits as exact zeros). Past
    MAX_DEFAULT_SPLITS splits the split doubles (a batch of over 8K keys:
    there a row's sums follow the batch's longest row)."""
    per_split = max(KEYS_PER_SPLIT, block)
    while triton.cdiv(prefix, per_split) + triton.cdiv(slots, per_split) > MAX_DEFAULT_SPLITS:
        per_split *= 2
    return per_split, triton.cdiv(prefix, per_split) * per_split


def decode_attention(q, pool_k, pool_v, prefix_slots, prefix_len, region_k, region_v, region_valid, table, scale,
                     needs: Need = Need.NONE, region_vnorm=None, num_splits: int | None = None,
                     block: int = BLOCK_N, num_warps: int = 4, num_stages: int = 2, quant=None, formats=None,
                     variant: str = SERVING_TBQ_VARIANT, fused: bool | None = None, row_columns=None,
                     row_observe=None, observe_shift: int = 0):
    """Attention output [R, Hq, Dv] and the observations `needs` asks for.

    q [R, Hq, D]; pool_k/v [pool slots, Hkv, D] (SGLang's buffers of the
    layer); prefix_slots [R, P] int64 with prefix_len [R] (slots past a
    row's length are ignored); region_k/v [pages, page_size, D];
    region_valid [pages, page_size] bool; table [R, Hkv, M] the layer's page
    table rows (the null page has no valid slot); region_vnorm [pages,
    page_size] fp32 ||v||_1 per slot if the region keeps it (else PV_NORM
    reads V). With quantized pages (`quant`, a tbq_store.QuantPool, and
    `formats` [pages] the page formats), page ids past the null page are
    read from `quant` at their format; region_vnorm is then required.
    `variant` picks the quantized path: "new" (blocks of `block` slots, a
    multiple of the page size, pages of any formats mixed) or "old" (one
    page per block, a branch on its format; kept for A/B timings in
    bench/tbq_kernel.py). Observations as
    attention_ref.attend_rows gives them:
    attention, pv_norm [R, Hkv, M * page_size], sparsity [R, Hq].

    `row_columns` [R] int: the page-table columns each row holds (its
    pages; the columns past them are null pages): a row's keys and
    observations stop there (None: every row reads all M columns). The
    observations past a row's columns are 0, as for null pages.

    `row_observe` [R] int: which observations each row's policy reads, as
    OBSERVE_BITS bits from `observe_shift` (OBSERVE_REGION: attention,
    OBSERVE_PV: pv_norm too, OBSERVE_SPARSITY: sparsity; a step passes its
    first layer's and its later layers' bits in one tensor). The
    observation pass skips what a row does not read (a mixed batch observes
    for the union of its policies' needs: its `full` rows' whole KV and its
    other rows' prefixes are read for sparsity only where a row wants it);
    what it skips is 0 (sparsity: unspecified).
    None: every row reads everything `needs` asks for.

    `num_splits` None: the batch-invariant layout (row_splits: a row's
    output bits do not depend on the other rows of the batch up to 8K keys);
    a number: that many splits of the batch's own keys (the layout before,
    for A/B timings in bench/kernel_check.py).

    `fused`: a step with Need.PV_NORM (LongFlow's rows) and no other need
    than Need.ATTENTION goes by default (None, without num_splits) through
    kernels/longflow_fused.py: the same results from one kernel with no
    logits scratch and no observation kernel (longflow_fused.applies says
    when it serves). False keeps this split-KV path; True requires it."""
    if fused and quant is not None:
        raise ValueError("the fused pass reads full-precision pages only")
    if fused or (fused is None and num_splits is None
                 and longflow_fused.applies(needs, quant, table.shape[2] * region_k.shape[1])):
        return longflow_fused.decode_attention_observed(q, pool_k, pool_v, prefix_slots, prefix_len, region_k,
                                                        region_v, region_valid, table, scale, needs,
                                                        region_vnorm=region_vnorm)
    R, Hq, D = q.shape
    Hkv = table.shape[1]
    G = Hq // Hkv
    DV = region_v.shape[-1]
    P = prefix_slots.shape[1]
    PAGE = region_k.shape[1]
    S = table.shape[2] * PAGE
    dev = q.device
    if quant is not None and variant == "old":
        block = PAGE  # one page per block: one format per block, decoded alone
    elif quant is not None:
        if variant != "new":
            raise ValueError(f"unknown variant {variant!r}")
        pages = max(1, block // PAGE)
        block = PAGE * (1 << (pages.bit_length() - 1))  # whole pages, a power of two of them
    if num_splits is None:  # batch-invariant: a row's splits do not depend on the other rows (row_splits)
        per_split, P_pad = row_splits(P, S, block)
        keys = P_pad + S
    else:
        P_pad = triton.cdiv(P, block) * block  # the prefix in whole blocks: a block is prefix or region
        keys = P_pad + S
        per_split = triton.cdiv(triton.cdiv(max(keys, 1), num_splits), block) * block
    splits = triton.cdiv(max(keys, 1), per_split)  # no split past the keys
    part_o = torch.empty((R, Hq, splits, DV), dtype=torch.float32, device=dev)
    part_m = torch.empty((R, Hq, splits), dtype=torch.float32, device=dev)
    part_l = torch.empty_like(part_m)
    sparsity = bool(needs & Need.SPARSITY)
    region_obs = bool(needs & (Need.ATTENTION | Need.PV_NORM))
    observing = sparsity or region_obs
    blocks = triton.cdiv(max(keys, 1), block)
    logits = torch.empty((R, Hq, keys) if observing else (1, 1, 1), dtype=torch.float16, device=dev)
    block_max = torch.empty((R, Hq, blocks) if observing else (1, 1, 1), dtype=torch.float32, device=dev)
    prefix_len = prefix_len.to(torch.int64)
    if P == 0:  # Triton wants a real buffer even where every load is masked
        prefix_slots = torch.zeros((R, 1), dtype=torch.int64, device=dev)
    valid = region_valid.view(torch.uint8) if region_valid.dtype == torch.bool else region_valid
    null_page = region_k.shape[0] - 1
    if row_columns is None:
        row_columns = torch.full((R,), table.shape[2], dtype=torch.int32, device=dev)
    G_PAD = max(16, triton.next_power_of_2(G))
    if quant is None:  # placeholders: QUANT=0 never reads them
        qk = qv = qks = qvs = qps = fmt = qkw = qvw = qkh = qvh = valid
        sq = (0,) * 9
    else:
        if region_obs and region_vnorm is None:
            raise ValueError("quantized pages need region_vnorm for PV_NORM")
        qk, qv, qks, qvs, qps, fmt = quant.k_codes, quant.v_codes, quant.k_scale, quant.v_scale, quant.page_scale, formats
        # The same bytes as words of eight elements: int32 (NVFP4) and int16 (ternary).
        qkw, qvw, qkh, qvh = qk.view(torch.int32), qv.view(torch.int32), qk.view(torch.int16), qv.view(torch.int16)
        sq = (qk.stride(0), qk.stride(1), qks.stride(0), qvs.stride(0), qvs.stride(1), qkw.stride(0), qkw.stride(1),
              qkh.stride(0), qkh.stride(1))
    _partial_kernel[(R, Hkv, splits)](
        q, pool_k, pool_v, prefix_slots, prefix_len, region_k, region_v, valid, table, row_columns,
        part_o, part_m, part_l, logits, block_max,
        fmt, qk, qv, qks, qvs, qps, qkw, qvw, qkh, qvh,
        scale, P_pad, S, per_split, null_page,
        *sq,
        q.stride(0), q.stride(1),
        pool_k.stride(0), pool_k.stride(1), pool_v.stride(0), pool_v.stride(1),
        prefix_slots.stride(0), region_k.stride(0), region_k.stride(1), region_v.stride(0), region_v.stride(1),
        valid.stride(0), table.stride(0), table.stride(1),
        part_o.stride(0), part_o.stride(1), part_o.stride(2), part_m.stride(0), part_m.stride(1),
        logits.stride(0), logits.stride(1), block_max.stride(0), block_max.stride(1),
        G=G, G_PAD=G_PAD, D=D, DV=DV, PAGE=PAGE, BLOCK=block,
        STORE_REGION_LOGITS=observing, STORE_PREFIX_LOGITS=sparsity,
        QUANT=0 if quant is None else (1 if variant == "old" else 2),
        HAS_FP8=quant is not None and qk.shape[-1] >= D,  # rows as wide as head_dim: the 8-bit class
        num_warps=num_warps, num_stages=num_stages,
    )
    out = torch.empty((R, Hq, DV), dtype=q.dtype, device=dev)
    lse = torch.empty((R, Hq), dtype=torch.float32, device=dev)
    row_max = torch.empty_like(lse)
    _merge_kernel[(R, Hq)](
        part_o, part_m, part_l, out, lse, row_max, prefix_len, row_columns,
        splits, per_split, P_pad, S, part_o.stride(0), part_o.stride(1), part_o.stride(2), part_m.stride(0),
        part_m.stride(1),
        out.stride(0), out.stride(1), DV=DV, PAGE=PAGE,
    )
    obs = Observations()
    if not observing:
        return out, obs
    want_attention = bool(needs & Need.ATTENTION)
    want_pv = bool(needs & Need.PV_NORM)
    # The pass's outputs in one zeroed allocation: one fill a layer, not four
    # (at serving's shapes a fill costs its launch more than its bytes).
    region_cells, head_cells = R * Hkv * S, R * Hq
    scratch = torch.zeros(((1 + want_pv) * region_cells if region_obs else 0) + (2 * head_cells if sparsity else 0),
                          dtype=torch.float32, device=dev)
    attention = pv_norm = sparse = seen = block_max  # placeholders where the kernel reads nothing
    if region_obs:
        attention = scratch[:region_cells].view(R, Hkv, S)
        pv_norm = scratch[region_cells:2 * region_cells].view(R, Hkv, S) if want_pv else attention
    if sparsity:
        sparse, seen = scratch[scratch.numel() - 2 * head_cells:].view(2, R, Hq).unbind(0)
    first_block = 0 if sparsity else P_pad // block  # without SPARSITY only the region's keys are read
    vnorm = region_vnorm if region_vnorm is not None else block_max
    if blocks > first_block:
        _observe_kernel[(R, Hkv, triton.cdiv(blocks - first_block, OBSERVE_BLOCKS_PER_PROGRAM))](
            logits, block_max, lse, row_max, region_v, vnorm, table, valid, attention, pv_norm, sparse, seen,
            prefix_len, row_columns, row_columns if row_observe is None else row_observe, P_pad, S, first_block,
            null_page, logits.stride(0), logits.stride(1),
            block_max.stride(0), block_max.stride(1), region_v.stride(0), region_v.stride(1), vnorm.stride(0), valid.stride(0),
            table.stride(0), table.stride(1), attention.stride(0), attention.stride(1), Hq, LOG_SPARSITY, observe_shift,
            G=G, G_PAD=G_PAD, DV=DV, PAGE=PAGE, BLOCK=block, BLOCKS_PER_PROGRAM=OBSERVE_BLOCKS_PER_PROGRAM,
            ATTENTION=region_obs, PV_NORM=want_pv, HAS_VNORM=region_vnorm is not None, SPARSITY=sparsity,
            PER_ROW=row_observe is not None,
        )
    if want_attention:
        obs.attention = attention
    if want_pv:
        obs.pv_norm = pv_norm
    if sparsity:
        obs.sparsity = sparse / seen.clamp(min=1)
    return out, obs
