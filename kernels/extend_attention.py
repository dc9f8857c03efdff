"""Triton extend (prefill) attention for compressed rows, with the attention
mass of the observation window per region slot.

A compressed row's chunk of private prompt tokens (T queries, padded to the
batch's longest chunk) attends to two parts of its KV, as in decode:

- the radix-shared prefix in SGLang's token pool, through `prefix_slots` (a
  row of req_to_token): visible to every query, since it precedes them;
- the row's private slots in the compressed region, through the layer's page
  table: slot s is visible to query t iff valid[s] and position[s] <= pos[t]
  (the chunk's own tokens were written to the region before the call, so
  this is causal attention over earlier chunks and the chunk itself).

Pass 1 (`_extend_kernel`), grid (rows, kv heads, query blocks): flash
attention with an online softmax over key blocks. One program takes
BLOCK_Q queries x the G query heads of one kv head as the rows of one tile
(GQA: each key and value is read once for the group), so no [T, S]
probability matrix is ever written. Region key blocks that no query of the
tile can see (all invalid, or all later than the tile's last position) are
skipped after reading only their valid bits and positions. Writes the output
and, when observations are asked, each query's log-sum-exp.

Pass 2 (`_observe_kernel`), only with `observe`, grid (rows, kv heads,
region key blocks): each program keeps one block of region keys and walks
the row's query blocks that hold observed queries, recomputing their logits
and summing exp(logit - lse) over the observed queries and the group: the
region's share of the joint softmax over prefix + region, per slot, as
`kernels.attention_ref.attend_rows` defines it. Each program owns its slots:
no atomics, deterministic.

`kernels.attention_ref.attend_rows` is the PyTorch reference (tests compare
the two; radix_ext/backend.py keeps it as the CPU path).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import interpreter_compat

interpreter_compat.apply()

#: Query-tile rows (queries x padded query group) and keys per block on a GPU,
#: as SGLang's extend kernel on Hopper at head_dim <= 128 (128 x 64, 8 warps).
#: Compiled for sm_90 on a CPU host (bench/kernel_compile_check.py): 209
#: registers, no spill, 96 KB shared (K/V double-buffered). Not yet timed.
BLOCK_M = 128
BLOCK_N = 64


@triton.jit
def _tile_rows(Pos, r, qb, T, spos_r, G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr):
    """The tile's rows: row m is query qb * BLOCK_Q + m // G_PAD, group head m % G_PAD."""
    m = tl.arange(0, BLOCK_Q * G_PAD)
    t = qb * BLOCK_Q + m // G_PAD
    g = m % G_PAD
    in_t = t < T
    qpos = tl.load(Pos + r * spos_r + t, mask=in_t, other=-1).to(tl.int32)  # positions < 2^31
    row_ok = (g < G) & in_t
    return t, g, row_ok, qpos


@triton.jit
def _region_block(Table, Valid, Position, r, h, s, S, null_page, st_r, st_h, sva_p, spo_p, PAGE: tl.constexpr):
    """Page, offset, valid bit and position of region slots s of (row r, kv head h)."""
    in_s = s < S
    page = tl.load(Table + r * st_r + h * st_h + s // PAGE, mask=in_s, other=null_page)
    off = s % PAGE
    ok = in_s & (tl.load(Valid + page * sva_p + off, mask=in_s, other=0) != 0)
    kpos = tl.load(Position + page * spo_p + off, mask=ok, other=0).to(tl.int32)
    return page, off, ok, kpos


@triton.jit
def _online(qk, v, m, l, acc):
    """One key block of the online softmax (masked logits are -inf)."""
    m_new = tl.maximum(m, tl.max(qk, 1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(qk - m_new[:, None])
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
    return m_new, l, acc


@triton.jit(do_not_specialize=["T", "S", "spos_r", "sps_r", "st_r", "st_h", "sl_r"],  # the shapes' integers
            # views into a step's shipped bytes: alignment follows the row count (decode_attention._partial_kernel)
            do_not_specialize_on_alignment=["Pos", "PrefixLen"])
def _extend_kernel(
    Q, Pos, PoolK, PoolV, PrefixSlots, PrefixLen, RegK, RegV, Valid, Position, Table, Out, Lse,
    scale, T, S, null_page,
    sq_r, sq_t, sq_h, spos_r,
    spk_n, spk_h, spv_n, spv_h, sps_r,
    srk_p, srk_o, srv_p, srv_o, sva_p, spo_p, st_r, st_h,
    so_r, so_t, so_h, sl_r, sl_t,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, STORE_LSE: tl.constexpr,
):
    """Grid (rows, kv heads, query blocks): output (and log-sum-exp) of one
    tile of BLOCK_Q queries x G query heads."""
    r = tl.program_id(0).to(tl.int64)  # row offsets of padded [R, T, Hq, D] buffers can pass 2^31
    h = tl.program_id(1)
    qb = tl.program_id(2)
    t, g, row_ok, qpos = _tile_rows(Pos, r, qb, T, spos_r, G, G_PAD, BLOCK_Q)
    real = row_ok & (qpos >= 0)  # padding queries (pos -1) see nothing: output 0
    hq = h * G + g
    d = tl.arange(0, D)
    dv = tl.arange(0, DV)
    q = tl.load(Q + r * sq_r + t[:, None] * sq_t + hq[:, None] * sq_h + d[None, :], mask=real[:, None], other=0.0)
    any_query = tl.max(real.to(tl.int32), 0) > 0
    last_pos = tl.max(tl.where(real, qpos, -1), 0)
    plen = tl.load(PrefixLen + r)
    prefix_end = tl.where(any_query, plen, 0)  # a tile of padding only reads nothing
    region_end = tl.where(any_query, S, 0)
    m = tl.full([BLOCK_Q * G_PAD], -1e30, tl.float32)
    l = tl.zeros([BLOCK_Q * G_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * G_PAD, DV], tl.float32)
    for n0 in range(0, prefix_end, BLOCK_N):  # the shared prefix: every query sees all of it
        n = n0 + tl.arange(0, BLOCK_N)
        seen = n < plen
        slot = tl.load(PrefixSlots + r * sps_r + n, mask=seen, other=0)
        k = tl.load(PoolK + slot[:, None] * spk_n + h * spk_h + d[None, :], mask=seen[:, None], other=0.0)
        v = tl.load(PoolV + slot[:, None] * spv_n + h * spv_h + dv[None, :], mask=seen[:, None], other=0.0)
        qk = tl.dot(q, tl.trans(k)).to(tl.float32) * scale
        qk = tl.where(real[:, None] & seen[None, :], qk, float("-inf"))
        m, l, acc = _online(qk, v, m, l, acc)
    for n0 in range(0, region_end, BLOCK_N):  # the private slots: valid, and not later than the query
        s = n0 + tl.arange(0, BLOCK_N)
        page, off, ok, kpos = _region_block(Table, Valid, Position, r, h, s, S, null_page, st_r, st_h, sva_p, spo_p,
                                            PAGE)
        if tl.max((ok & (kpos <= last_pos)).to(tl.int32), 0) > 0:  # else no query of the tile sees the block
            k = tl.load(RegK + page[:, None] * srk_p + off[:, None] * srk_o + d[None, :], mask=ok[:, None], other=0.0)
            v = tl.load(RegV + page[:, None] * srv_p + off[:, None] * srv_o + dv[None, :], mask=ok[:, None],
                        other=0.0)
            qk = tl.dot(q, tl.trans(k)).to(tl.float32) * scale
            seen = real[:, None] & ok[None, :] & (kpos[None, :] <= qpos[:, None])
            qk = tl.where(seen, qk, float("-inf"))
            m, l, acc = _online(qk, v, m, l, acc)
    out = acc / tl.maximum(l, 1e-30)[:, None]  # a query that sees nothing: 0
    tl.store(Out + r * so_r + t[:, None] * so_t + hq[:, None] * so_h + dv[None, :], out.to(Out.dtype.element_ty),
             mask=row_ok[:, None])
    if STORE_LSE:
        tl.store(Lse + r * sl_r + t * sl_t + hq, m + tl.log(tl.maximum(l, 1e-30)), mask=row_ok)


@triton.jit(do_not_specialize=["T", "S", "spos_r", "sob_r", "sl_r", "st_r", "st_h", "sat_r", "sat_h"],
            do_not_specialize_on_alignment=["Pos", "Observe"])  # per-row views (_extend_kernel)
def _observe_kernel(
    Q, Pos, Observe, Lse, RegK, Valid, Position, Table, Attention,
    scale, T, S, null_page,
    sq_r, sq_t, sq_h, spos_r, sob_r, sl_r, sl_t,
    srk_p, srk_o, sva_p, spo_p, st_r, st_h, sat_r, sat_h,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Grid (rows, kv heads, region key blocks): attention mass per slot of
    one block, summed over the observed queries and the kv head's group."""
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    page, off, ok, kpos = _region_block(Table, Valid, Position, r, h, s, S, null_page, st_r, st_h, sva_p, spo_p, PAGE)
    d = tl.arange(0, D)
    k = tl.load(RegK + page[:, None] * srk_p + off[:, None] * srk_o + d[None, :], mask=ok[:, None], other=0.0)
    first_pos = tl.min(tl.where(ok, kpos, 2147483647), 0)
    query_end = tl.where(tl.max(ok.to(tl.int32), 0) > 0, T, 0)  # a block without valid slot reads no query
    mass = tl.zeros([BLOCK_N], tl.float32)
    for t0 in range(0, query_end, BLOCK_Q):
        t, g, row_ok, qpos = _tile_rows(Pos, r, t0 // BLOCK_Q, T, spos_r, G, G_PAD, BLOCK_Q)
        observed = row_ok & (qpos >= 0) & (tl.load(Observe + r * sob_r + t, mask=t < T, other=0) != 0)
        if tl.max((observed & (qpos >= first_pos)).to(tl.int32), 0) > 0:  # else nothing observed sees the block
            hq = h * G + g
            q = tl.load(Q + r * sq_r + t[:, None] * sq_t + hq[:, None] * sq_h + d[None, :], mask=observed[:, None],
                        other=0.0)
            lse = tl.load(Lse + r * sl_r + t * sl_t + hq, mask=observed, other=0.0)
            qk = tl.dot(q, tl.trans(k)).to(tl.float32) * scale
            seen = observed[:, None] & ok[None, :] & (kpos[None, :] <= qpos[:, None])
            mass += tl.sum(tl.where(seen, tl.exp(qk - lse[:, None]), 0.0), 0)
    tl.store(Attention + r * sat_r + h * sat_h + s, mass, mask=s < S)


def extend_attention(q, query_pos, pool_k, pool_v, prefix_slots, prefix_len, region_k, region_v, region_valid,
                     region_position, table, scale, observe=None, block_m: int = BLOCK_M, block_n: int = BLOCK_N,
                     num_warps: int = 8, num_stages: int = 2):
    """Attention output [R, T, Hq, Dv] (q's dtype) and, with `observe`, the
    attention mass per region slot [R, Hkv, M * page_size] float32 (else None).

    q [R, T, Hq, D] each row's chunk, padded; query_pos [R, T] int64 the
    token position of each query (-1: padding, output 0); pool_k/v [pool
    slots, Hkv, D] SGLang's buffers of the layer; prefix_slots [R, P] int64
    with prefix_len [R] (slots past a row's length are ignored);
    region_k/v [pages, page_size, D]; region_valid [pages, page_size] bool;
    region_position [pages, page_size] int64; table [R, Hkv, M] the layer's
    page-table rows (the null page has no valid slot); observe [R, T] bool,
    the queries whose attention is summed (attend_rows' `observe` with
    Need.ATTENTION).

    block_m is the tile's rows: block_m // G_pad queries x the query group
    padded to a power of two (G_pad); block_n keys per block."""
    R, T, Hq, D = q.shape
    Hkv = table.shape[1]
    G = Hq // Hkv
    DV = region_v.shape[-1]
    PAGE = region_k.shape[1]
    S = table.shape[2] * PAGE
    dev = q.device
    G_PAD = triton.next_power_of_2(G)
    BLOCK_Q = max(1, block_m // G_PAD)
    if BLOCK_Q * G_PAD < 16:  # tl.dot wants 16 rows at least
        BLOCK_Q = 16 // G_PAD
    q = q if q.stride(-1) == 1 else q.contiguous()
    query_pos = query_pos.to(torch.int64).contiguous()
    prefix_len = prefix_len.to(torch.int64)
    if prefix_slots.shape[1] == 0:  # Triton wants a real buffer even where every load is masked
        prefix_slots = torch.zeros((R, 1), dtype=torch.int64, device=dev)
    valid = region_valid.view(torch.uint8) if region_valid.dtype == torch.bool else region_valid
    null_page = region_k.shape[0] - 1
    observing = observe is not None
    out = torch.empty((R, T, Hq, DV), dtype=q.dtype, device=dev)
    lse = torch.empty((R, T, Hq) if observing else (1, 1, 1), dtype=torch.float32, device=dev)
    if R == 0 or T == 0:
        return out, (torch.zeros((R, Hkv, S), dtype=torch.float32, device=dev) if observing else None)
    _extend_kernel[(R, Hkv, triton.cdiv(T, BLOCK_Q))](
        q, query_pos, pool_k, pool_v, prefix_slots, prefix_len, region_k, region_v, valid, region_position, table,
        out, lse,
        scale, T, S, null_page,
        q.stride(0), q.stride(1), q.stride(2), query_pos.stride(0),
        pool_k.stride(0), pool_k.stride(1), pool_v.stride(0), pool_v.stride(1), prefix_slots.stride(0),
        region_k.stride(0), region_k.stride(1), region_v.stride(0), region_v.stride(1), valid.stride(0),
        region_position.stride(0), table.stride(0), table.stride(1),
        out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
        G=G, G_PAD=G_PAD, D=D, DV=DV, PAGE=PAGE, BLOCK_Q=BLOCK_Q, BLOCK_N=block_n, STORE_LSE=observing,
        num_warps=num_warps, num_stages=num_stages,
    )
    if not observing:
        return out, None
    observe = observe.contiguous()
    observe = observe.view(torch.uint8) if observe.dtype == torch.bool else observe
    attention = torch.empty((R, Hkv, S), dtype=torch.float32, device=dev)
    if S:
        _observe_kernel[(R, Hkv, triton.cdiv(S, block_n))](
            q, query_pos, observe, lse, region_k, valid, region_position, table, attention,
            scale, T, S, null_page,
            q.stride(0), q.stride(1), q.stride(2), query_pos.stride(0), observe.stride(0), lse.stride(0),
            lse.stride(1),
            region_k.stride(0), region_k.stride(1), valid.stride(0), region_position.stride(0), table.stride(0),
            table.stride(1), attention.stride(0), attention.stride(1),
            G=G, G_PAD=G_PAD, D=D, PAGE=PAGE, BLOCK_Q=BLOCK_Q, BLOCK_N=block_n,
            num_warps=num_warps, num_stages=num_stages,
        )
    return out, attention
