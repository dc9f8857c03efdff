"""The compressed KV region: pages per (request, layer, kv_head).

SGLang's token pool stores all layers and heads of a token in one slot, so a
per-head eviction there frees nothing. Here every (request, layer, kv_head)
has its own page list, so per-head and per-layer budgets move real memory.

* A page holds `page_size` slots of one (request, layer, head): K, V, a valid
  bit, the token position and per-slot policy state (score, last hit step).
* Eviction clears valid bits (soft); the next token stored in that
  (layer, head) reuses the first free slot in place. Nothing is compacted or
  gathered when tokens are evicted. A page that empties is returned to the
  pool at once, leaving a hole in the page table that the next page fills.
* Slot s of a (request, layer) is page_table[layer, head, s // page_size],
  offset s % page_size; holes point at a null page that is never valid, so
  every head of a layer presents the same [H, S] slot grid to attention and
  to the policy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvsieve.policies.observations import LayerView


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

    @property
    def bytes_per_page(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.page_size * self.head_dim * element


class _RequestPages:
    """Page table of one request: [layers, heads, pages per head], NULL for none."""

    def __init__(self, num_layers: int, num_heads: int, null_page: int, device: str):
        self.null_page = null_page
        self.table = torch.full((num_layers, num_heads, 0), null_page, dtype=torch.int64, device=device)

    def grow(self) -> None:
        L, H, _ = self.table.shape
        pad = torch.full((L, H, 1), self.null_page, dtype=self.table.dtype, device=self.table.device)
        self.table = torch.cat([self.table, pad], dim=2)


class CompressedRegion:
    def __init__(self, config: RegionConfig):
        c = self.config = config
        n = c.num_pages + 1  # the last page is the null page: never valid
        self.null_page = c.num_pages
        self.k = torch.zeros(n, c.page_size, c.head_dim, dtype=c.dtype, device=c.device)
        self.v = torch.zeros_like(self.k)
        self.valid = torch.zeros(n, c.page_size, dtype=torch.bool, device=c.device)
        self.position = torch.full((n, c.page_size), -1, dtype=torch.int64, device=c.device)
        self.score = torch.zeros(n, c.page_size, dtype=torch.float32, device=c.device)
        self.last_hit = torch.zeros(n, c.page_size, dtype=torch.int32, device=c.device)
        self._free_pages: list[int] = list(range(c.num_pages - 1, -1, -1))
        self._requests: dict[str, _RequestPages] = {}

    # ----- accounting ------------------------------------------------------
    @property
    def pages_free(self) -> int:
        return len(self._free_pages)

    @property
    def pages_used(self) -> int:
        return self.config.num_pages - len(self._free_pages)

    def pages_held(self, rid: str) -> torch.Tensor:
        """Pages held per (layer, head) of a request, [L, H]."""
        return (self._requests[rid].table != self.null_page).sum(dim=-1)

    def held_tokens(self, rid: str) -> torch.Tensor:
        """Retained tokens per (layer, head) of a request, [L, H]."""
        table = self._requests[rid].table
        return self.valid[table].sum(dim=-1).sum(dim=-1)

    # ----- lifecycle -------------------------------------------------------
    def begin(self, rid: str) -> None:
        if rid in self._requests:
            raise KeyError(f"request {rid} already holds region pages")
        c = self.config
        self._requests[rid] = _RequestPages(c.num_layers, c.num_kv_heads, self.null_page, c.device)

    def end(self, rid: str) -> int:
        """Return every page of a request to the pool; the number returned."""
        pages = self._requests.pop(rid).table
        owned = pages[pages != self.null_page].tolist()
        self._release(owned)
        return len(owned)

    def _release(self, pages: list[int]) -> None:
        if not pages:
            return
        idx = torch.tensor(pages, dtype=torch.int64, device=self.config.device)
        self.valid[idx] = False
        self.position[idx] = -1
        self._free_pages.extend(pages)

    def _take_page(self) -> int:
        if not self._free_pages:
            raise RegionFull(f"compressed region exhausted ({self.config.num_pages} pages)")
        return self._free_pages.pop()

    # ----- writes ----------------------------------------------------------
    def store(self, rid: str, layer: int, k: torch.Tensor, v: torch.Tensor, position: int) -> torch.Tensor:
        """Store one token's K/V ([H, D] each) in the first free slot of each
        head of `layer`, taking a page only where a head has no free slot.
        Returns the slot index per head, [H]."""
        req = self._requests[rid]
        P = self.config.page_size
        # A page per head only where the head has no free slot: amortized
        # over page_size tokens, so the loop runs rarely.
        for head in (~self._free_slots(req.table[layer]).any(dim=1)).nonzero().flatten().tolist():
            self._add_page(req, layer, head)
        table = req.table[layer]  # [H, pages]
        slot = self._free_slots(table).int().argmax(dim=1)  # first free slot per head
        heads = torch.arange(table.shape[0], device=table.device)
        page = table[heads, slot // P]
        offset = slot % P
        self.k[page, offset] = k.to(self.k.dtype)
        self.v[page, offset] = v.to(self.v.dtype)
        self.valid[page, offset] = True
        self.position[page, offset] = position
        self.score[page, offset] = 0.0
        self.last_hit[page, offset] = 0
        return slot

    def _free_slots(self, table: torch.Tensor) -> torch.Tensor:
        """[H, S] True where a slot of a real page holds no token."""
        real = (table != self.null_page).repeat_interleave(self.config.page_size, dim=1)
        return ~self.valid[table].flatten(1) & real

    def _add_page(self, req: _RequestPages, layer: int, head: int) -> None:
        page = self._take_page()
        holes = (req.table[layer, head] == self.null_page).nonzero().flatten()
        if holes.numel() == 0:
            req.grow()
            column = req.table.shape[2] - 1
        else:
            column = int(holes[0])
        req.table[layer, head, column] = page

    def evict(self, rid: str, layer: int, mask: torch.Tensor) -> int:
        """Clear the slots marked in `mask` ([H, S]); pages left empty return
        to the pool. The number of tokens evicted."""
        req = self._requests[rid]
        P = self.config.page_size
        table = req.table[layer]
        mask = mask & self.valid[table].flatten(1)
        evicted = int(mask.sum())
        if evicted == 0:
            return 0
        heads, slots = mask.nonzero(as_tuple=True)
        pages = table[heads, slots // P]
        self.valid[pages, slots % P] = False
        self.position[pages, slots % P] = -1
        emptied = (~self.valid[table].any(dim=-1)) & (table != self.null_page)
        if emptied.any():
            self._release(table[emptied].tolist())
            req.table[layer][emptied] = self.null_page
        return evicted

    # ----- reads -----------------------------------------------------------
    def layer_slots(self, rid: str, layer: int):
        """K [H, S, D], V [H, S, D] and the LayerView of a request's layer.

        Indexing by the page table reads the pages in place order; S is the
        page table width times page_size, the same for every head."""
        table = self._requests[rid].table[layer]
        H = table.shape[0]
        k = self.k[table].reshape(H, -1, self.config.head_dim)
        v = self.v[table].reshape(H, -1, self.config.head_dim)
        view = LayerView(
            valid=self.valid[table].reshape(H, -1),
            position=self.position[table].reshape(H, -1),
            score=self.score[table].reshape(H, -1),
            last_hit=self.last_hit[table].reshape(H, -1),
        )
        return k, v, view

    def write_policy_state(self, rid: str, layer: int, view: LayerView) -> None:
        """Persist a policy's in-place updates of score / last_hit."""
        table = self._requests[rid].table[layer]
        shape = (*table.shape, self.config.page_size)
        real = table != self.null_page
        self.score[table[real]] = view.score.reshape(shape)[real]
        self.last_hit[table[real]] = view.last_hit.reshape(shape)[real]
