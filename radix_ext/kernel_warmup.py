"""The decode kernels' variants compiled at start, not mid-serving.

Triton compiles a kernel variant the first time it is launched with new
constexprs. The decode attention's observation flags (kernels/
decode_attention.py: which of attention, |p*v| and sparsity the batch's
policies read) follow the union of the needs of the policies in a batch,
so a small batch whose policies lacked one kind asked for a variant no
earlier batch had: 0.7-1.0 s in which every request of the engine waited
(`bench/capture_churn.py` on an H200 traffic trace, 2026-11-29: the
compiles' keys differed in those flags only). The backend launches each
combination once here, on padded rows (the null pages only), before the
first request. The integer arguments the kernels specialize on are the
engine's (strides of its buffers) or always multiples of 16 (a step's
keys), so these launches compile the variants serving launches.

LongFlow's select kernel (kernels/longflow_fused.py `longflow_select`)
compiles once per tile, the group's slots rounded up to a power of two: a
group growing towards its budget met a new tile mid-serving (0.15-0.26 s
each in a traffic run, 2026-11-29). Every tile up to the widest it serves
is launched here too (warm_up_select).

KVSIEVE_KERNEL_WARMUP=0 turns it off (a start a few seconds shorter on a
cold Triton cache)."""

from __future__ import annotations

import itertools
import logging
import time

import torch

from kvsieve.env_flags import flag
from kvsieve.kernels import longflow_fused
from kvsieve.kernels.decode_attention import decode_attention
from kvsieve.policies import Need
from kvsieve.policies.longflow import FUSED_MAX_SLOTS

from .step_meta import PAD_POOL_ROW, observe_bits_of

logger = logging.getLogger(__name__)

ENV = "KVSIEVE_KERNEL_WARMUP"

#: The needs that choose a decode kernel variant.
OBSERVED = (Need.ATTENTION, Need.PV_NORM, Need.SPARSITY)


def enabled() -> bool:
    return flag(ENV)


def need_sets() -> list[Need]:
    """Every combination of the observations a batch may ask for."""
    out = []
    for chosen in itertools.product((False, True), repeat=len(OBSERVED)):
        needs = Need.NONE
        for on, need in zip(chosen, OBSERVED):
            if on:
                needs |= need
        out.append(needs)
    return out


def warm_up_decode(pages, pool_k: torch.Tensor, pool_v: torch.Tensor, q_heads: int, dtype: torch.dtype,
                   rows: int = 16, columns: int = 4, prefix: int = 128) -> int:
    """Launch the decode attention once per need set (and through the
    split-KV path too where LongFlow's fused pass would serve it: a batch
    with any other need takes the split path) on `rows` padded rows of
    at most `columns` null-page columns (the table's width at start) and a
    `prefix`-wide empty prefix, with the region's own buffers. Returns the
    launches made."""
    dev = pages.k.device
    head_dim = pages.config.head_dim
    q = torch.zeros((rows, q_heads, head_dim), dtype=dtype, device=dev)
    # As a step's table: the page-table rows of its padded rows, one layer's view.
    pad_rows = torch.full((rows,), PAD_POOL_ROW, dtype=torch.int64, device=dev)
    table = pages.table[pad_rows, :, :, :columns][:, 0]
    prefix_slots = torch.zeros((rows, prefix), dtype=torch.int64, device=dev)
    prefix_len = torch.zeros(rows, dtype=torch.int64, device=dev)
    row_columns = torch.zeros(rows, dtype=torch.int32, device=dev)
    launches = 0
    for needs in need_sets():
        row_observe = torch.full((rows,), observe_bits_of(needs), dtype=torch.int32, device=dev)
        fused = longflow_fused.applies(needs, pages.quant, table.shape[2] * pages.config.page_size)
        for route in ((None, False) if fused else (None,)):
            decode_attention(q, pool_k, pool_v, prefix_slots, prefix_len, pages.k, pages.v, pages.valid, table,
                             head_dim ** -0.5, needs, region_vnorm=pages.vnorm, quant=pages.quant,
                             formats=pages.format, row_columns=row_columns, row_observe=row_observe, fused=route)
            launches += 1
    return launches


def select_tiles(page_size: int, widest: int = FUSED_MAX_SLOTS) -> list[int]:
    """Slot counts whose select tiles serving may launch: each power of two
    from a page up to `widest` (its own tile)."""
    out, slots = [], page_size
    while slots <= widest:
        out.append(slots)
        slots *= 2
    return out


def warm_up_select(pages) -> int:
    """Launch LongFlow's select kernel once per tile (select_tiles) on one
    empty row with the region's per-slot dtypes, as fused_victim launches it
    (kv head 0's views of fresh per-group tensors). Returns the launches."""
    dev, heads = pages.k.device, pages.table.shape[2]
    launches = 0
    for slots in select_tiles(pages.config.page_size):
        pv_norm = torch.zeros((1, heads, slots), dtype=torch.float32, device=dev)
        valid = torch.zeros((1, heads, slots), dtype=pages.valid.dtype, device=dev)
        position = torch.full((1, heads, slots), -1, dtype=pages.position.dtype, device=dev)
        longflow_fused.longflow_select(pv_norm, valid[:, 0], position[:, 0],
                                       torch.ones(1, dtype=torch.int32, device=dev))
        launches += 1
    return launches


def warm_up_backend(backend, q_heads: int, dtype: torch.dtype) -> None:
    """The warm-up for a kvsieve backend whose compressed rows run the
    Triton kernels, logged with its time."""
    if not enabled():
        return
    started = time.perf_counter()
    pool = backend.token_to_kv_pool
    launches = warm_up_decode(backend.pages, pool.get_key_buffer(0), pool.get_value_buffer(0), q_heads, dtype)
    if longflow_fused.enabled():
        launches += warm_up_select(backend.pages)
    logger.warning("kvsieve: decode kernel variants compiled at start (%d launches, %.1f s; %s=0 skips it)",
                   launches, time.perf_counter() - started, ENV)
