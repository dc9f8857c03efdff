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

from . import interpreter_compat
from .attention_ref import SPARSITY_THRESHOLD

interpreter_compat.apply()

#: Keys per inner-loop block.
BLOCK_N = 32
#: Key blocks one program of the observation kernel reads (fewer, larger programs).
OBSERVE_BLOCKS_PER_PROGRAM = 8
#: ln(SPARSITY_THRESHOLD): a probability below threshold x the row max has a
#: logit below the row's max logit + this.
LOG_SPARSITY = math.log(SPARSITY_THRESHOLD)


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
def _scores(q, k, seen, scale):
    qk = tl.dot(q, tl.trans(k)).to(tl.float32) * scale  # [G_PAD, BLOCK]
    return tl.where(seen[None, :], qk, float("-inf"))


@triton.jit
def _accumulate(qk, v, m, l, acc, n, hq, g_ok, keep, Logits, BlockMax, r, slg_r, slg_h, sbm_r, sbm_h,
                BLOCK: tl.constexpr, STORE: tl.constexpr):
    """Online softmax over one block; with STORE, the block's fp16 logits
    relative to its running max (<= 0: fp16 keeps them to ~1e-3 where the
    probability matters) and that max, for the observations."""
    m_new = tl.maximum(m, tl.max(qk, 1))
    if STORE:
        tl.store(Logits + r * slg_r + hq[:, None] * slg_h + n[None, :], (qk - m_new[:, None]).to(tl.float16),
                 mask=g_ok[:, None] & keep[None, :])
        tl.store(BlockMax + r * sbm_r + hq * sbm_h + tl.min(n, 0) // BLOCK, m_new, mask=g_ok)
    alpha = tl.exp(m - m_new)
    p = tl.exp(qk - m_new[:, None])
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
    return m_new, l, acc


@triton.jit
def _partial_kernel(
    Q, PoolK, PoolV, PrefixSlots, PrefixLen, RegK, RegV, Valid, Table,
    PartO, PartM, PartL, Logits, BlockMax,
    Format, QK, QV, QKScale, QVScale, QPageScale,
    scale, P_pad, S, keys_per_split, null_page,
    sq_c, sq_o, sqks_r, sqvs_r, sqvs_o,
    sq_r, sq_h,
    spk_n, spk_h, spv_n, spv_h,
    sps_r, srk_p, srk_o, srv_p, srv_o, sva_p,
    st_r, st_h,
    spo_r, spo_h, spo_s, spm_r, spm_h,
    slg_r, slg_h, sbm_r, sbm_h,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, PAGE: tl.constexpr,
    BLOCK: tl.constexpr, STORE_REGION_LOGITS: tl.constexpr, STORE_PREFIX_LOGITS: tl.constexpr,
    QUANT: tl.constexpr,
):
    """Grid (rows, kv heads, splits): one split of one row's keys for the G
    query heads of one kv head; partial output, max and sum per query head.
    Keys: [0, P_pad) the prefix (padded to whole blocks), then [P_pad,
    P_pad + S) the region; a block is all prefix or all region, so each part
    has a loop of its own with only its loads."""
    r = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    g = tl.arange(0, G_PAD)
    g_ok = g < G
    hq = h * G + g
    d = tl.arange(0, D)
    dv = tl.arange(0, DV)
    q = tl.load(Q + r * sq_r + hq[:, None] * sq_h + d[None, :], mask=g_ok[:, None], other=0.0)
    plen = tl.load(PrefixLen + r)
    start = split * keys_per_split  # a multiple of BLOCK, as P_pad is
    end = tl.minimum(start + keys_per_split, P_pad + S)
    m = tl.full([G_PAD], -1e30, tl.float32)
    l = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, DV], tl.float32)
    for n0 in range(start, tl.minimum(end, P_pad), BLOCK):  # the shared prefix, in SGLang's token pool
        n = n0 + tl.arange(0, BLOCK)
        seen = n < plen
        slot = tl.load(PrefixSlots + r * sps_r + n, mask=seen, other=0)
        k = tl.load(PoolK + slot[:, None] * spk_n + h * spk_h + d[None, :], mask=seen[:, None], other=0.0)
        v = tl.load(PoolV + slot[:, None] * spv_n + h * spv_h + dv[None, :], mask=seen[:, None], other=0.0)
        m, l, acc = _accumulate(_scores(q, k, seen, scale), v, m, l, acc, n, hq, g_ok, n < P_pad, Logits, BlockMax,
                                r, slg_r, slg_h, sbm_r, sbm_h, BLOCK, STORE_PREFIX_LOGITS)
    for n0 in range(tl.maximum(start, P_pad), end, BLOCK):  # the private slots, in region pages
        n = n0 + tl.arange(0, BLOCK)
        in_region = n < end
        s = n - P_pad
        page = tl.load(Table + r * st_r + h * st_h + s // PAGE, mask=in_region, other=null_page)
        off = s % PAGE
        seen = in_region & (tl.load(Valid + page * sva_p + off, mask=in_region, other=0) != 0)
        if QUANT:  # a block is one page; pages past the null page are quantized (radix_ext/tbq_store.py)
            pid = tl.max(page, 0)
            if pid > null_page:
                row = pid - null_page - 1
                fmt = tl.load(Format + pid).to(tl.int32)
                k = _quantized_page(QK, QKScale, QPageScale, row, off, fmt, d, sq_c, sq_o, sqks_r, 0, seen,
                                    True).to(q.dtype)
                v = _quantized_page(QV, QVScale, QPageScale + 1, row, off, fmt, dv, sq_c, sq_o, sqvs_r, sqvs_o, seen,
                                    False).to(RegV.dtype.element_ty)
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
        m, l, acc = _accumulate(_scores(q, k, seen, scale), v, m, l, acc, n, hq, g_ok, in_region, Logits, BlockMax,
                                r, slg_r, slg_h, sbm_r, sbm_h, BLOCK, STORE_REGION_LOGITS)
    tl.store(PartO + r * spo_r + hq[:, None] * spo_h + split * spo_s + dv[None, :], acc, mask=g_ok[:, None])
    tl.store(PartM + r * spm_r + hq * spm_h + split, m, mask=g_ok)
    tl.store(PartL + r * spm_r + hq * spm_h + split, l, mask=g_ok)


@triton.jit
def _merge_kernel(
    PartO, PartM, PartL, Out, Lse, RowMax,
    num_splits, spo_r, spo_h, spo_s, spm_r, spm_h, so_r, so_h,
    DV: tl.constexpr, SPLITS: tl.constexpr,
):
    """Grid (rows, query heads): the splits merged by their log-sum-exp."""
    r = tl.program_id(0)
    hq = tl.program_id(1)
    sp = tl.arange(0, SPLITS)
    ok = sp < num_splits
    dv = tl.arange(0, DV)
    m = tl.load(PartM + r * spm_r + hq * spm_h + sp, mask=ok, other=-1e30)
    l = tl.load(PartL + r * spm_r + hq * spm_h + sp, mask=ok, other=0.0)
    top = tl.max(m, 0)
    w = tl.exp(m - top) * ok
    total = tl.sum(l * w, 0)
    o = tl.load(PartO + r * spo_r + hq * spo_h + sp[:, None] * spo_s + dv[None, :], mask=ok[:, None], other=0.0)
    merged = tl.sum(o * w[:, None], 0) / tl.maximum(total, 1e-30)  # a row that sees nothing: 0
    tl.store(Out + r * so_r + hq * so_h + dv, merged.to(Out.dtype.element_ty))
    heads = tl.num_programs(1)
    tl.store(Lse + r * heads + hq, top + tl.log(tl.maximum(total, 1e-30)))
    tl.store(RowMax + r * heads + hq, top)


@triton.jit
def _observe_kernel(
    Logits, BlockMax, Lse, RowMax, RegV, VNorm, Table, Valid, Attention, PvNorm, Sparse, Seen,
    P_pad, S, first_block, null_page, slg_r, slg_h, sbm_r, sbm_h, srv_p, srv_o, svn_p, sva_p, st_r, st_h,
    sat_r, sat_h, Hq, log_sparsity,
    G: tl.constexpr, G_PAD: tl.constexpr, DV: tl.constexpr, PAGE: tl.constexpr, BLOCK: tl.constexpr,
    BLOCKS_PER_PROGRAM: tl.constexpr,
    ATTENTION: tl.constexpr, PV_NORM: tl.constexpr, HAS_VNORM: tl.constexpr, SPARSITY: tl.constexpr,
):
    """Grid (rows, kv heads, groups of key blocks from first_block):
    probabilities from the stored logits and the final log-sum-exp."""
    r = tl.program_id(0)
    h = tl.program_id(1)
    g = tl.arange(0, G_PAD)
    g_ok = g < G
    hq = h * G + g
    if SPARSITY:
        top = tl.load(RowMax + r * Hq + hq, mask=g_ok, other=0.0)
        sparse_count = tl.zeros([G_PAD], tl.float32)
        seen_count = tl.zeros([G_PAD], tl.float32)
    if ATTENTION or PV_NORM:
        lse = tl.load(Lse + r * Hq + hq, mask=g_ok, other=0.0)
    for i in tl.static_range(BLOCKS_PER_PROGRAM):
        block = first_block + tl.program_id(2) * BLOCKS_PER_PROGRAM + i
        n = block * BLOCK + tl.arange(0, BLOCK)
        in_range = n < P_pad + S
        region = in_range & (n >= P_pad)
        counted = in_range
        if not SPARSITY:
            counted = region
        rel = tl.load(Logits + r * slg_r + hq[:, None] * slg_h + n[None, :],
                      mask=g_ok[:, None] & counted[None, :], other=float("-inf")).to(tl.float32)
        logits = rel + tl.load(BlockMax + r * sbm_r + hq * sbm_h + block,
                               mask=g_ok & (block * BLOCK < P_pad + S), other=0.0)[:, None]
        if SPARSITY:
            seen = logits > float("-inf")
            sparse_count += tl.sum((seen & (logits < top[:, None] + log_sparsity)).to(tl.float32), 1)
            seen_count += tl.sum(seen.to(tl.float32), 1)
        if ATTENTION or PV_NORM:
            s = tl.where(region, n - P_pad, 0)
            mass = tl.sum(tl.exp(logits - lse[:, None]), 0)  # -inf (unseen keys, padding heads): 0
            if ATTENTION:
                tl.store(Attention + r * sat_r + h * sat_h + s, mass, mask=region)
            if PV_NORM:
                page = tl.load(Table + r * st_r + h * st_h + s // PAGE, mask=region, other=null_page)
                off = s % PAGE
                if HAS_VNORM:
                    norm = tl.load(VNorm + page * svn_p + off, mask=region, other=0.0)
                else:
                    dv = tl.arange(0, DV)
                    v = tl.load(RegV + page[:, None] * srv_p + off[:, None] * srv_o + dv[None, :],
                                mask=region[:, None], other=0.0)
                    norm = tl.sum(tl.abs(v.to(tl.float32)), 1)
                tl.store(PvNorm + r * sat_r + h * sat_h + s, mass * norm, mask=region)
    if SPARSITY:
        tl.atomic_add(Sparse + r * Hq + hq, sparse_count, mask=g_ok)
        tl.atomic_add(Seen + r * Hq + hq, seen_count, mask=g_ok)


def default_splits(keys: int) -> int:
    """Chunks per (row, kv head): about 512 keys each, at most 16 (chosen
    from a sweep of 1-32 splits on an H100; bench/kernel_check.py compares
    this default with 8 and 16 splits)."""
    return int(max(1, min(16, triton.cdiv(max(keys, 1), 512))))


def decode_attention(q, pool_k, pool_v, prefix_slots, prefix_len, region_k, region_v, region_valid, table, scale,
                     needs: Need = Need.NONE, region_vnorm=None, num_splits: int | None = None,
                     block: int = BLOCK_N, num_warps: int = 4, num_stages: int = 2, quant=None, formats=None):
    """Attention output [R, Hq, Dv] and the observations `needs` asks for.

    q [R, Hq, D]; pool_k/v [pool slots, Hkv, D] (SGLang's buffers of the
    layer); prefix_slots [R, P] int64 with prefix_len [R] (slots past a
    row's length are ignored); region_k/v [pages, page_size, D];
    region_valid [pages, page_size] bool; table [R, Hkv, M] the layer's page
    table rows (the null page has no valid slot); region_vnorm [pages,
    page_size] fp32 ||v||_1 per slot if the region keeps it (else PV_NORM
    reads V). With quantized pages (`quant`, a tbq_store.QuantPool, and
    `formats` [pages] the page formats), page ids past the null page are
    read from `quant` at their format, one page per key block (`block` is
    the page size); region_vnorm is then required. Observations as
    attention_ref.attend_rows gives them:
    attention, pv_norm [R, Hkv, M * page_size], sparsity [R, Hq]."""
    R, Hq, D = q.shape
    Hkv = table.shape[1]
    G = Hq // Hkv
    DV = region_v.shape[-1]
    P = prefix_slots.shape[1]
    PAGE = region_k.shape[1]
    S = table.shape[2] * PAGE
    dev = q.device
    if quant is not None:
        block = PAGE  # one page per block: one format per block, decoded alone
    P_pad = triton.cdiv(P, block) * block  # the prefix in whole blocks: a block is prefix or region
    keys = P_pad + S
    splits = num_splits or default_splits(keys)
    per_split = triton.cdiv(triton.cdiv(max(keys, 1), splits), block) * block
    splits = triton.cdiv(max(keys, 1), per_split)  # no empty split
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
    G_PAD = max(16, triton.next_power_of_2(G))
    if quant is None:  # placeholders: QUANT=False never reads them
        qk = qv = qks = qvs = qps = fmt = valid
        sq = (0, 0, 0, 0, 0)
    else:
        if region_obs and region_vnorm is None:
            raise ValueError("quantized pages need region_vnorm for PV_NORM")
        qk, qv, qks, qvs, qps, fmt = quant.k_codes, quant.v_codes, quant.k_scale, quant.v_scale, quant.page_scale, formats
        sq = (qk.stride(0), qk.stride(1), qks.stride(0), qvs.stride(0), qvs.stride(1))
    _partial_kernel[(R, Hkv, splits)](
        q, pool_k, pool_v, prefix_slots, prefix_len, region_k, region_v, valid, table,
        part_o, part_m, part_l, logits, block_max,
        fmt, qk, qv, qks, qvs, qps,
        scale, P_pad, S, per_split, null_page,
        *sq,
        q.stride(0), q.stride(1),
        pool_k.stride(0), pool_k.stride(1), pool_v.stride(0), pool_v.stride(1),
        prefix_slots.stride(0), region_k.stride(0), region_k.stride(1), region_v.stride(0), region_v.stride(1),
        valid.stride(0), table.stride(0), table.stride(1),
        part_o.stride(0), part_o.stride(1), part_o.stride(2), part_m.stride(0), part_m.stride(1),
        logits.stride(0), logits.stride(1), block_max.stride(0), block_max.stride(1),
        G=G, G_PAD=G_PAD, D=D, DV=DV, PAGE=PAGE, BLOCK=block,
        STORE_REGION_LOGITS=region_obs, STORE_PREFIX_LOGITS=sparsity, QUANT=quant is not None,
        num_warps=num_warps, num_stages=num_stages,
    )
    out = torch.empty((R, Hq, DV), dtype=q.dtype, device=dev)
    lse = torch.empty((R, Hq), dtype=torch.float32, device=dev)
    row_max = torch.empty_like(lse)
    _merge_kernel[(R, Hq)](
        part_o, part_m, part_l, out, lse, row_max,
        splits, part_o.stride(0), part_o.stride(1), part_o.stride(2), part_m.stride(0), part_m.stride(1),
        out.stride(0), out.stride(1), DV=DV, SPLITS=max(2, triton.next_power_of_2(splits)),
    )
    obs = Observations()
    if not observing:
        return out, obs
    want_attention = bool(needs & Need.ATTENTION)
    want_pv = bool(needs & Need.PV_NORM)
    attention = torch.zeros((R, Hkv, S), dtype=torch.float32, device=dev) if region_obs else block_max
    pv_norm = torch.zeros_like(attention) if want_pv else attention
    sparse = torch.zeros((R, Hq), dtype=torch.float32, device=dev)
    seen = torch.zeros_like(sparse)
    first_block = 0 if sparsity else P_pad // block  # without SPARSITY only the region's keys are read
    vnorm = region_vnorm if region_vnorm is not None else block_max
    if blocks > first_block:
        _observe_kernel[(R, Hkv, triton.cdiv(blocks - first_block, OBSERVE_BLOCKS_PER_PROGRAM))](
            logits, block_max, lse, row_max, region_v, vnorm, table, valid, attention, pv_norm, sparse, seen,
            P_pad, S, first_block, null_page, logits.stride(0), logits.stride(1), block_max.stride(0),
            block_max.stride(1), region_v.stride(0), region_v.stride(1), vnorm.stride(0), valid.stride(0),
            table.stride(0), table.stride(1), attention.stride(0), attention.stride(1), Hq, LOG_SPARSITY,
            G=G, G_PAD=G_PAD, DV=DV, PAGE=PAGE, BLOCK=block, BLOCKS_PER_PROGRAM=OBSERVE_BLOCKS_PER_PROGRAM,
            ATTENTION=region_obs, PV_NORM=want_pv, HAS_VNORM=region_vnorm is not None, SPARSITY=sparsity,
        )
    if want_attention:
        obs.attention = attention
    if want_pv:
        obs.pv_norm = pv_norm
    if sparsity:
        obs.sparsity = sparse / seen.clamp(min=1)
    return out, obs
