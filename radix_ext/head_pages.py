"""Per-head page targets of one request (Crystal-KV's adaptive budgets):
pages move between any (layer, head) pairs of the request, its total stays.

Two steps, both between forwards (never inside one):

* `compact_request` packs every head's valid slots into its first slots
  (slot order kept), so the pages past a head's kept tokens are empty and
  can be given away. One gather/scatter over the request's real slots of
  every per-slot array of the region; it runs on the device, in stream order
  after the forward that evicted.
* `retarget_pages` re-deals the request's real pages so (layer, head) owns
  `targets[l, h]` of them: shrinking heads give their last pages, growing
  heads append them. The device table is rewritten at the next flush;
  tokens stay where they are (no clearing: the pages moved are empty).

Kept out of pages.py (the manager's allocation and table) because only a
policy with adaptive budgets needs it; it works on the manager's own
records of a request's pages.
"""

from __future__ import annotations

import torch

from kvsieve.policies.observations import to_device

#: Per-slot arrays of the region a compaction must move with the slot.
_SLOT_ARRAYS = ("k", "v", "valid", "position", "score", "last_hit", "vnorm", "prefill_attention")


def _real_slots(pm, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat slot ids [L, H, C*P] of a request's page grid and which are real."""
    size = pm.config.page_size
    offsets = torch.arange(size, dtype=torch.int64)
    slots = (pages.unsqueeze(-1) * size + offsets).flatten(-2)
    real = (pages != pm.null_page).unsqueeze(-1).expand(*pages.shape, size).flatten(-2)
    return slots, real


def compact_request(pm, rid: str) -> None:
    """Move each head's valid slots to its first real slots, in slot order."""
    pages = pm._owned[rid].pages
    slots, real = _real_slots(pm, pages)
    device = pm.valid.device
    flat_slots = to_device(slots, torch.int64, device)
    real_dev = to_device(real, torch.bool, device)
    valid = pm.valid.view(-1)[flat_slots] & real_dev
    # Sort key: valid real slots first, then empty real slots, then null ones;
    # a stable sort keeps slot order, so the permutation maps real to real.
    key = torch.where(valid, 0, torch.where(real_dev, 1, 2)).to(torch.int8)
    order = torch.sort(key, dim=-1, stable=True).indices
    source = torch.gather(flat_slots, -1, order)[real_dev]
    target = flat_slots[real_dev]
    for name in _SLOT_ARRAYS:
        array = getattr(pm, name)
        flat = array.view(-1, *array.shape[2:])
        flat[target] = flat[source].clone()


def page_counts(pm, rid: str) -> torch.Tensor:
    """Real pages per (layer, head) of a request [L, H] (host)."""
    return (pm._owned[rid].pages != pm.null_page).sum(dim=-1)


def retarget_pages(pm, rid: str, targets: torch.Tensor) -> None:
    """Give (layer, head) `targets[l, h]` pages (host [L, H] ints summing to
    the request's real pages). Call compact_request first: a shrinking head's
    pages past its target must hold no token."""
    owned = pm._owned[rid]
    counts = page_counts(pm, rid)
    targets = targets.to(torch.int64)
    if int(targets.sum()) != int(counts.sum()) or bool((targets < 0).any()):
        raise ValueError(f"page targets sum to {int(targets.sum())}, the request owns {int(counts.sum())}")
    width = int(targets.max())
    new = torch.full((*targets.shape, max(width, 1)), pm.null_page, dtype=torch.int64)
    keep = torch.minimum(counts, targets)
    columns = torch.arange(owned.pages.shape[-1])
    kept_mask = columns < keep.unsqueeze(-1)
    new_columns = torch.arange(new.shape[-1])
    new[new_columns < keep.unsqueeze(-1)] = owned.pages[kept_mask]  # row-major: same order both sides
    spare = owned.pages[(columns < counts.unsqueeze(-1)) & ~kept_mask]
    needed = (new_columns >= keep.unsqueeze(-1)) & (new_columns < targets.unsqueeze(-1))
    new[needed] = spare
    owned.pages = new
    if owned.row >= 0:
        pm._pending.bind.append((owned.row, new, False))  # tokens stay where they are


def fit_budgets_to_pages(budgets: torch.Tensor, extra: int, page_size: int,
                         total_pages: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Page targets [L, H] for new per-head budgets, and the budgets capped to
    them. Every head needs budget + `extra` slots (the overflow room the
    policy's admission ceiling counts); the request's pages are dealt in
    proportion to that need (first the pages of a budget of 1 to every head,
    then largest remainder, so the total stays), and a head whose pages fall
    short has its budget cut to what they hold. The capped budgets never sum
    above the given ones."""
    need = budgets.to(torch.float64) + extra
    n = need.numel()
    base = (1 + extra + page_size - 1) // page_size  # pages of a budget of 1
    if total_pages < n * base:
        raise ValueError(f"{total_pages} pages cannot give each of {n} heads {base}")
    share = (total_pages - n * base) * need / need.sum()
    whole = share.floor()
    order = torch.sort((share - whole).flatten(), descending=True, stable=True).indices
    bonus = torch.zeros(n, dtype=torch.float64)
    bonus[order[:total_pages - n * base - int(whole.sum())]] = 1.0
    pages = (whole + bonus.view_as(whole)).to(torch.int64) + base
    capped = torch.minimum(budgets.to(torch.int64).clamp(min=1), pages * page_size - extra)
    return pages, capped


def plan_head_pages(pm, req, step: int, pool_row: int, budget: int) -> None:
    """Between steps, before the page table is flushed, for a policy with
    per-head budgets (the optional hooks `realloc_head_budgets`,
    `head_room`, `accept_head_budgets`):

    1. page targets planned at the previous step are applied now, after that
       step's forward evicted the shrinking heads down to their new budgets:
       compaction, then the pages move;
    2. the policy may ask for new budgets (rare: every realloc interval); the
       pages are fitted to them here (budgets capped to what the pages hold)
       and the targets wait for the next step, so this step's decision first
       evicts down to the capped budgets.
    """
    realloc = getattr(req.policy, "realloc_head_budgets", None)
    state = req.state
    if realloc is None or state is None or not pm.owns(req.rid):
        return
    pending = getattr(state, "pending_head_pages", None)
    if pending is not None:
        compact_request(pm, req.rid)
        retarget_pages(pm, req.rid, pending)
        state.pending_head_pages = None
    wanted = realloc(state, step, pool_row, budget)
    if wanted is None:
        return
    try:
        pages, capped = fit_budgets_to_pages(wanted, req.policy.head_room(req.params), pm.config.page_size,
                                             pm.pages_of(req.rid))
    except ValueError:
        return  # too few pages to re-deal: the head budgets stay as they are
    state.pending_head_pages = pages
    req.policy.accept_head_budgets(state, capped)
