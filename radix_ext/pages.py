"""The compressed region's page manager: pages per (request, layer, kv_head).

SGLang's token pool stores all layers and heads of a token in one slot, so a
per-head eviction there frees nothing. Here every (request, layer, kv_head)
owns its own pages, so per-head and per-layer budgets move real memory.

Two sides, as in vLLM v1's KV-cache manager and nano-vllm's block manager:

* Host (scheduler side, plain ints): the free list. A compressed request's
  ceiling pages are taken at admission (`allocate`), returned at finish,
  abort and retraction (`free`), trimmed once its prefill selection ran
  (`shrink`), and may move between heads of one request (`move_pages`).
  Nothing here waits for the device.
* Device (read by the forward): K/V and per-slot state of every page, and the
  page table `table[req_pool_idx, layer, head, column]` (the null page where
  a head has no page). Host decisions reach the table through `flush()`, which
  the attention backend calls once per step before the forward (on the
  forward's stream, so it is ordered after every earlier forward). The
  forward never allocates: a new token goes to the first free slot of the
  pages its head already owns.

Slot s of a (request, layer, head) is page table[..., s // page_size], offset
s % page_size; the null page is never valid, so every row presents an
[H, columns x page_size] slot grid to attention and to the policies.

Quantized pages (ThinKV's TBQ, docs/design/tbq.md) are a second pool with a
free list of their own: page ids [0, num_pages) hold full precision, id
num_pages is the null page, ids past it are quantized pages, whose K/V live
in `quant` (radix_ext.tbq_store.QuantPool) and whose format is `format[page]`.
The per-slot arrays (valid, position, ...) span every id, so policies and
attention see one slot grid whatever a page's precision.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvsieve.kernels import kv_formats as kvf
from kvsieve.policies.observations import to_device

from .tbq_store import QuantPool


#: Table rows counted per gather in held_tokens_of_rows (bounds its temporary:
#: rows x layers x heads x columns x page_size bools).
ROWS_PER_COUNT = 128


class RegionFull(RuntimeError):
    """No free page: admission should have prevented this."""


@dataclass(frozen=True)
class RegionConfig:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_pages: int
    page_size: int = 16
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    #: Rows of the page table: SGLang's req_to_token rows (max running requests).
    max_rows: int = 64
    #: Quantized pages (TBQ) and the bits their code rows hold (4: NVFP4 and
    #: ternary; 8: FP8 too).
    quant_pages: int = 0
    quant_bits: int = 4

    @property
    def bytes_per_page(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.page_size * self.head_dim * element

    @property
    def heads(self) -> int:
        """(layer, kv head) pairs of one request."""
        return self.num_layers * self.num_kv_heads


#: Bytes of state each slot carries beside its K and V, in the buffers
#: PageManager allocates per slot: valid (bool), position (int64), score
#: (float32), last_hit (int32), vnorm (float32), prefill_attention (float32);
#: and per page: format (int8). The region's size counts them
#: (memory_plan.slot_bytes): at 4.7 M pages they are 1.9 GB.
SLOT_STATE_BYTES = 1 + 8 + 4 + 4 + 4 + 4
PAGE_STATE_BYTES = 1


@dataclass
class _Owned:
    """The pages one request owns: [layers, heads, columns] on the host."""

    pages: torch.Tensor  # int64, CPU; the null page where a head has fewer pages
    row: int = -1  # req_pool_idx once bound; -1 before its first forward
    count: int = 0  # real pages


@dataclass
class _Pending:
    """Host decisions not yet written to the device (flush())."""

    clear_rows: list = field(default_factory=list)  # table rows to reset to null
    bind: list = field(default_factory=list)  # (row, pages [L, H, C], clear) to write (and clear)
    null_entries: list = field(default_factory=list)  # (row, column_start): trimmed columns


class PageManager:
    def __init__(self, config: RegionConfig):
        c = self.config = config
        full = c.num_pages + 1  # page num_pages is the null page: never valid
        n = full + c.quant_pages  # quantized pages follow the null page
        self.null_page = c.num_pages
        self.k = torch.zeros(full, c.page_size, c.head_dim, dtype=c.dtype, device=c.device)
        self.v = torch.zeros_like(self.k)
        #: Storage format of each page (kv_formats ids; 0 for full-precision
        #: pages and for quantized pages that hold nothing yet).
        self.format = torch.zeros(n, dtype=torch.int8, device=c.device)
        self.quant = QuantPool(c) if c.quant_pages else None
        element = torch.empty((), dtype=c.dtype).element_size()
        #: Bytes of a slot and of a page's own scales, by format id (retained_bytes_of_rows).
        self._format_bytes = (
            torch.tensor([kvf.slot_bytes(f, c.head_dim, element) for f in range(4)]).to(c.device),
            torch.tensor([kvf.page_bytes(f, c.head_dim) for f in range(4)]).to(c.device))
        self.valid = torch.zeros(n, c.page_size, dtype=torch.bool, device=c.device)
        self.position = torch.full((n, c.page_size), -1, dtype=torch.int64, device=c.device)
        self.score = torch.zeros(n, c.page_size, dtype=torch.float32, device=c.device)
        self.last_hit = torch.zeros(n, c.page_size, dtype=torch.int32, device=c.device)
        #: ||v||_1 of each slot's value, written with it: ||p v||_1 observations
        #: (LongFlow) then read 4 bytes per slot instead of the value.
        self.vnorm = torch.zeros(n, c.page_size, dtype=torch.float32, device=c.device)
        #: Attention each slot received from the observed prompt queries,
        #: summed over prefill chunks until the prefill selection reads it.
        self.prefill_attention = torch.zeros(n, c.page_size, dtype=torch.float32, device=c.device)
        self.table = torch.full((c.max_rows, c.num_layers, c.num_kv_heads, 1), self.null_page,
                                dtype=torch.int64, device=c.device)
        # Values written through index tensors: device scalars, since a Python
        # scalar there is copied from the host and blocks it on CUDA.
        self.const_true = torch.ones((), dtype=torch.bool, device=c.device)
        self.const_false = torch.zeros((), dtype=torch.bool, device=c.device)
        self.const_zero = torch.zeros((), dtype=torch.float32, device=c.device)
        self.const_zero_int = torch.zeros((), dtype=torch.int32, device=c.device)
        self.const_no_position = torch.full((), -1, dtype=torch.int64, device=c.device)
        self._free: list[int] = list(range(c.num_pages - 1, -1, -1))
        self._qfree: list[int] = list(range(n - 1, full - 1, -1))
        self._owned: dict[str, _Owned] = {}
        self._pending = _Pending()

    # ----- accounting (host) ----------------------------------------------
    @property
    def pages_free(self) -> int:
        return len(self._free)

    @property
    def pages_used(self) -> int:
        return self.config.num_pages - len(self._free)

    def pages_of(self, rid: str) -> int:
        owned = self._owned.get(rid)
        return 0 if owned is None else owned.count

    def columns_of(self, rid: str) -> int:
        """Pages per (layer, head) the request owns (the widest head)."""
        return self._owned[rid].pages.shape[2]

    def columns_of_each(self, rids) -> list[int]:
        """columns_of per request, 0 for one that owns no pages (host)."""
        owned = self._owned
        return [owned[r].pages.shape[2] if r in owned else 0 for r in rids]

    def owns(self, rid: str) -> bool:
        return rid in self._owned

    def held_tokens(self, rids: list[str]) -> list[int]:
        """Valid slots of each request, summed over (layer, head): reads the
        device (one sync), so only after steps and at request end."""
        counts = []
        for rid in rids:
            pages = self._owned[rid].pages
            real = to_device(pages[pages != self.null_page], torch.int64, self.valid.device)
            counts.append(self.valid[real].sum())
        return torch.stack(counts).tolist() if counts else []

    def held_tokens_of_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Valid slots of each page-table row in `rows` (a device tensor),
        summed over (layer, head), as a device tensor: no sync, so the caller
        can copy it back asynchronously. Flushes first, so the table holds
        every host decision (the backend flushes at this point of a step anyway)."""
        self.flush()
        counts = [self.valid[self.table[chunk]].sum(dim=(1, 2, 3, 4)) for chunk in rows.split(ROWS_PER_COUNT)]
        return torch.cat(counts) if counts else torch.zeros(0, dtype=torch.int64, device=self.valid.device)

    @property
    def quant_pages_free(self) -> int:
        return len(self._qfree)

    def retained_bytes_of_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Exact bytes of K/V each page-table row in `rows` retains, summed
        over (layer, head): every valid slot's codes (or full-precision K/V)
        and the scales of every page that holds a valid slot. A device
        tensor (no sync); flushes first, like held_tokens_of_rows."""
        self.flush()
        per_slot, per_page = self._format_bytes
        out = []
        for chunk in rows.split(ROWS_PER_COUNT):
            table = self.table[chunk]
            held = self.valid[table].sum(-1)  # [n, L, H, M]
            fmt = self.format[table].long()
            out.append((held * per_slot[fmt] + (held > 0) * per_page[fmt]).flatten(1).sum(-1))
        return torch.cat(out) if out else torch.zeros(0, dtype=torch.int64, device=self.valid.device)

    def can_allocate(self, pages_per_head: int, quant_per_head: int = 0) -> bool:
        heads = self.config.heads
        return pages_per_head * heads <= len(self._free) and quant_per_head * heads <= len(self._qfree)

    # ----- lifecycle (host) -----------------------------------------------
    def allocate(self, rid: str, pages_per_head: int, quant_per_head: int = 0) -> None:
        """Take `pages_per_head` full-precision pages (the first columns)
        and `quant_per_head` quantized pages for every (layer, head) of a request."""
        if rid in self._owned:
            raise KeyError(f"request {rid} already owns region pages")
        c = self.config
        need, qneed = pages_per_head * c.heads, quant_per_head * c.heads
        if need > len(self._free) or qneed > len(self._qfree):
            raise RegionFull(f"compressed region has {len(self._free)} free pages and {len(self._qfree)} free "
                             f"quantized pages, {need} and {qneed} needed")
        taken = self._free[len(self._free) - need:]
        del self._free[len(self._free) - need:]
        pages = torch.tensor(taken, dtype=torch.int64).view(c.num_layers, c.num_kv_heads, pages_per_head)
        if qneed:
            qtaken = self._qfree[len(self._qfree) - qneed:]
            del self._qfree[len(self._qfree) - qneed:]
            quant = torch.tensor(qtaken, dtype=torch.int64).view(c.num_layers, c.num_kv_heads, quant_per_head)
            pages = torch.cat([pages, quant], dim=2)
        self._owned[rid] = _Owned(pages, count=need + qneed)

    def bind(self, rid: str, row: int) -> None:
        """The request got its req_pool row: its pages enter the device table
        (and are cleared) at the next flush."""
        owned = self._owned[rid]
        if owned.row == row:
            return
        if owned.row >= 0:
            self._pending.clear_rows.append(owned.row)
        owned.row = row
        self._pending.bind.append((row, owned.pages, True))

    def row_of(self, rid: str) -> int:
        owned = self._owned.get(rid)
        return -1 if owned is None else owned.row

    def free(self, rid: str) -> int:
        """Return every page of a request; the number returned."""
        owned = self._owned.pop(rid, None)
        if owned is None:
            return 0
        if owned.row >= 0:
            self._pending.clear_rows.append(owned.row)
            # An earlier bind of this row must not resurrect the freed pages.
            self._pending.bind = [b for b in self._pending.bind if b[0] != owned.row]
            self._pending.null_entries = [e for e in self._pending.null_entries if e[0] != owned.row]
        real = owned.pages[owned.pages != self.null_page]
        self._free.extend(real[real < self.null_page].tolist())
        self._qfree.extend(real[real > self.null_page].tolist())
        return owned.count

    def shrink(self, rid: str, pages_per_head: int) -> int:
        """Keep only the first `pages_per_head` columns of every head (the
        caller guarantees the rest hold no token); the pages freed."""
        owned = self._owned[rid]
        if pages_per_head >= owned.pages.shape[2]:
            return 0
        dropped = owned.pages[:, :, pages_per_head:]
        freed = dropped[dropped != self.null_page].tolist()
        owned.pages = owned.pages[:, :, :pages_per_head].clone()
        if owned.row >= 0:
            self._pending.null_entries.append((owned.row, pages_per_head))
        self._free.extend(p for p in freed if p < self.null_page)
        self._qfree.extend(p for p in freed if p > self.null_page)
        owned.count -= len(freed)
        return len(freed)

    def move_pages(self, rid: str, layer: int, src_head: int, dst_head: int, count: int) -> None:
        """Give `count` of src_head's last pages to dst_head (adaptive budgets:
        a policy shifts memory between heads of one request between steps).
        The caller guarantees those pages hold no token of src_head."""
        owned = self._owned[rid]
        pages = owned.pages
        src = pages[layer, src_head]
        real = int((src != self.null_page).sum())
        if count > real:
            raise ValueError(f"head {src_head} of layer {layer} owns {real} pages, cannot give {count}")
        moving = src[real - count:real].clone()
        dst_real = int((pages[layer, dst_head] != self.null_page).sum())
        width = max(pages.shape[2], dst_real + count)
        if width > pages.shape[2]:
            pad = torch.full((*pages.shape[:2], width - pages.shape[2]), self.null_page, dtype=pages.dtype)
            pages = torch.cat([pages, pad], dim=2)
        pages[layer, src_head, real - count:real] = self.null_page
        pages[layer, dst_head, dst_real:dst_real + count] = moving
        owned.pages = pages
        if owned.row >= 0:
            self._pending.bind.append((owned.row, pages, False))  # tokens stay where they are

    # ----- device side ----------------------------------------------------
    def flush(self) -> None:
        """Write pending host decisions to the device table. Called once per
        step by the attention backend, before the forward."""
        p = self._pending
        if not (p.clear_rows or p.bind or p.null_entries):
            return
        if p.clear_rows:
            self.table.index_fill_(0, to_device(p.clear_rows, torch.int64, self.table.device), self.null_page)
        for row, start in p.null_entries:
            self.table[row, :, :, start:].fill_(self.null_page)
        for row, pages, clear in p.bind:
            self.ensure_width(pages.shape[2])
            self.table[row].fill_(self.null_page)
            self.table[row, :, :, :pages.shape[2]] = to_device(pages, torch.int64, self.table.device)
            if clear:
                real = pages[pages != self.null_page]  # on the host: no sync
                self._clear_pages(to_device(real, torch.int64, self.table.device))
        self._pending = _Pending()

    def ensure_width(self, columns: int) -> None:
        """Widen the table (rare: a request wider than any before, or a
        decode step's width rounded up: step_meta.WIDTH_STEP)."""
        have = self.table.shape[3]
        if columns > have:
            pad = torch.full((*self.table.shape[:3], columns - have), self.null_page,
                             dtype=self.table.dtype, device=self.table.device)
            self.table = torch.cat([self.table, pad], dim=3)

    def _clear_pages(self, pages: torch.Tensor) -> None:
        self.valid[pages] = self.const_false
        self.format[pages] = 0  # a reused quantized page takes the format of its next group
        self.position[pages] = self.const_no_position
        self.score[pages] = self.const_zero
        self.last_hit[pages] = self.const_zero_int
        self.prefill_attention[pages] = self.const_zero

    # ----- K/V of slots, whatever their precision ----------------------------
    def kv_of(self, table: torch.Tensor, values: bool = True):
        """K (and V) [*table.shape, page_size, D] of the pages in `table`, in
        the region's dtype; quantized pages dequantized (tbq_store)."""
        if self.quant is None:
            return self.k[table], (self.v[table] if values else None)
        return self.quant.kv_of(self, table, values)

    def width_of(self, rids) -> int:
        """Columns that cover every head of these requests (host; 1 when none owns pages)."""
        return max(self.columns_of_each(rids), default=0) or 1
