"""Per-scheduler-process state of compressed requests: which rids compress,
their policy and parameters, budgets, and the page manager they live in.

SGLang's scheduler, its model runner and the attention backend share one
process, so the scheduler hooks (plugin.py, admission.py) and the backend
(backend.py, step_meta.py) meet here, keyed by request id. Host counters are
plain ints; what the forward counts (evictions, overflow) stays in device
tensors indexed by req_pool row, read on the host only after a step, at
most once a second, and when a request ends.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Optional

import torch

from kvsieve.policies.base import ModelInfo
from kvsieve.policies.observations import to_device
from kvsieve.policies import KVPolicyError, KVPolicySpec, Need, Policy, PolicyParams, RequestState, get_policy, \
    parse_kv_policy

from . import faults, head_parallel, memory_split, metrics
from .pages import PAGE_STATE_BYTES, SLOT_STATE_BYTES, PageManager, RegionConfig
from .tbq_store import QuantPool

logger = logging.getLogger(__name__)

#: Budget of a compressing request that names none (tokens per layer and kv head).
from kvsieve.policies.spec import DEFAULT_BUDGET  # noqa: E402  (budget of a request that names none)
#: Floor of a budget given as budget_ratio.
from kvsieve.policies.spec import MIN_RATIO_BUDGET  # noqa: E402  (floor of a budget_ratio budget)
#: Seconds between two refreshes of the region gauges and overflow checks.
REFRESH_INTERVAL_S = 1.0

_POLICY_INSTANCES: dict[type, Policy] = {}


def policy_instance(name: str) -> Policy:
    """Policies are stateless functions over a batch: one instance per class,
    bound to the served model (RUNTIME.model_info) when it is made."""
    cls = get_policy(name)
    if cls not in _POLICY_INSTANCES:
        policy = cls()
        if RUNTIME.model_info is not None:
            policy.bind_model(RUNTIME.model_info)
        _POLICY_INSTANCES[cls] = policy
    return _POLICY_INSTANCES[cls]


@dataclass
class CompressedRequest:
    rid: str
    spec: KVPolicySpec
    policy: Policy
    params: PolicyParams
    prompt_len: int
    state: Optional[RequestState] = None  # the policy's per-request host state
    prefix_len: int = -1  # tokens read from the token pool (shared prefix); -1 until its first forward
    radix_hit: int = -1  # prompt tokens matched in the radix tree at its first forward
    private_seen: int = 0  # private tokens stored so far (per layer and head)
    reported_tokens: int = 0  # what the retained gauges hold for this request
    reported_bytes: int = 0
    reported_held: int = 0  # valid slots over (layer, head) behind reported_bytes
    #: SGLang's Req, to end it cleanly if the region cannot take its tokens.
    sgl_req: object = None
    #: Region pages allocated at admission for the request's compressed
    #: ceiling; 0 while it waits.
    reserved_pages: int = 0
    #: Tokens it may still generate, as of its admission.
    max_new_tokens: int = 0
    #: Set when the region ran out for this request: it is being aborted and
    #: the backend gives its rows zeros until it ends. Admission allocates the
    #: ceiling, so this is a guard against policy bugs only.
    overflowed: bool = False
    #: Its generated tokens are stored quantized (TBQ: tbq_store.py).
    tbq: bool = False

    @property
    def private_prompt_in_region(self) -> bool:
        return self.spec.prompt_compressed

    def budget_tokens(self, private_tokens: int) -> int:
        """Budget per (layer, head) once `private_tokens` are seen."""
        if self.spec.budget is not None:
            return self.spec.budget
        if self.spec.budget_ratio is not None:
            return max(MIN_RATIO_BUDGET, math.ceil(self.spec.budget_ratio * max(private_tokens, 1)))
        return DEFAULT_BUDGET

    def ceiling_tokens(self, private_prompt: int, max_new_tokens: int) -> int:
        """Most private tokens one (layer, head) can hold."""
        if not self.private_prompt_in_region:
            private_prompt = 0
        final_budget = self.budget_tokens(private_prompt + max_new_tokens)  # budgets only grow
        return self.policy.max_private_tokens(self.params, private_prompt, max_new_tokens, final_budget)

    def pages_per_head(self, private_prompt: int, max_new_tokens: int, page_size: int) -> int:
        """The ceiling in whole pages per (layer, head)."""
        return -(-max(self.ceiling_tokens(private_prompt, max_new_tokens), 1) // page_size)

    def page_need(self, private_prompt: int, max_new_tokens: int, page_size: int) -> tuple[int, int]:
        """(full-precision, quantized) pages per (layer, head): with TBQ one
        full page (the group being filled) and the ceiling in quantized pages."""
        pages = self.pages_per_head(private_prompt, max_new_tokens, page_size)
        return (1, pages) if self.tbq else (pages, 0)


class KVRuntime:
    def __init__(self):
        self.region: Optional[PageManager] = None
        #: The served model as policies see it (set by the attention backend).
        self.model_info: Optional[ModelInfo] = None
        self.requests: dict[str, CompressedRequest] = {}
        self.finished: dict[str, dict] = {}  # rid -> final usage, until reported
        #: rids whose policy needs token ids or hidden states (on_tokens).
        self.token_observers: set[str] = set()
        #: Set when a prefill's end returned pool slots (decode_slots.py), so
        #: the scheduler retries its waiting queue before a request finishes.
        self.pool_slots_freed = False
        #: Per req_pool row, counted by the forward: [evicted slots, eviction events].
        self.counters: Optional[torch.Tensor] = None
        self.overflow_flags: Optional[torch.Tensor] = None
        self._last_refresh = 0.0
        #: after_step's counts in flight: (requests, [2, n] held/overflow, copy event or None).
        self._snapshot: Optional[tuple] = None

    @property
    def reserved_pages(self) -> int:
        return sum(r.reserved_pages for r in self.requests.values())

    # ----- set-up, by the attention backend once the model is known ---------
    def ensure_region(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype, device,
                      pool_tokens: int, max_rows: int = 64, context_len: Optional[int] = None) -> PageManager:
        """Create the region once, sized by memory_split (the pool/region split)."""
        if self.region is None:
            page_size = int(os.environ.get("KVSIEVE_REGION_PAGE_SIZE", "16"))
            element = torch.empty((), dtype=dtype).element_size()
            # A page's K and V and the state of its slots (pages.SLOT_STATE_BYTES):
            # the carve holds all of it.
            state_bytes = page_size * SLOT_STATE_BYTES + PAGE_STATE_BYTES
            bytes_per_page = 2 * page_size * head_dim * element + state_bytes
            pages = memory_split.region_pages(pool_tokens, num_layers, num_kv_heads, page_size, bytes_per_page,
                                              context_len)
            bits = memory_split.quant_bits()
            # Values are scaled per 16 channels: other head sizes get no quantized pages (no TBQ).
            quant_page_bytes = QuantPool.bytes_per_page(head_dim, page_size, bits) + state_bytes
            quant_pages = 0
            if head_dim % 16 == 0:
                pages, quant_pages = memory_split.split_quantized(pages, num_layers * num_kv_heads, bytes_per_page,
                                                                  quant_page_bytes)
            self.region = PageManager(RegionConfig(
                num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                num_pages=pages, page_size=page_size, dtype=dtype, device=str(device), max_rows=max_rows,
                quant_pages=quant_pages, quant_bits=bits))
            self.counters = torch.zeros((max_rows, 2), dtype=torch.int64, device=device)
            self.overflow_flags = torch.zeros(max_rows, dtype=torch.bool, device=device)
            metrics.record_region(0, pages)
            metrics.record_quantized_pages(0, quant_pages)
            if head_parallel.reports_usage():
                from kvsieve.policies import policy_names

                metrics.init_request_errors([n for n in policy_names() if get_policy(n).compresses], faults.STAGES)
            pool_mib = pool_tokens * num_layers * num_kv_heads * 2 * head_dim * element / 2**20
            work = memory_split.workspace
            if work is not None:
                metrics.record_planned_bytes(work.parts())
                self._check_workspace_fits(work)
            # Warning level: SGLang's scheduler logs only warnings by default,
            # and operators need this split at start-up.
            logger.warning(
                "kvsieve KV memory split: SGLang token pool %.1f MiB (%d tokens), compressed region "
                "%.1f MiB (%d pages x %d slots per (layer, kv head), slot state included) + %.1f MiB of %d-bit "
                "quantized pages (%d); %s",
                pool_mib, pool_tokens, pages * bytes_per_page / 2**20, pages, page_size,
                quant_pages * quant_page_bytes / 2**20, bits, quant_pages,
                work.describe() if work is not None else "no GPU workspace (CPU)")
        return self.region

    @staticmethod
    def _check_workspace_fits(work) -> None:
        """With a fixed region (KVSIEVE_REGION_PAGES) nothing was carved for
        the workspace: what is free once the region is allocated must hold
        it, or the start fails here rather than a step mid-run."""
        if memory_split.carved_bytes is not None or not torch.cuda.is_available():
            return
        free, _ = torch.cuda.mem_get_info()
        if free < work.total:
            raise ValueError(
                f"KVSIEVE_REGION_PAGES: the region leaves {free / 2**20:.0f} MiB of GPU memory free, less than "
                f"kvsieve's {work.describe()}; lower KVSIEVE_REGION_PAGES or --max-running-requests")

    # ----- request lifecycle (scheduler hooks) ------------------------------
    def admit(self, rid: str, custom_params: Optional[dict], prompt_len: int, sgl_req=None) -> None:
        """Remember a request whose kv_policy compresses."""
        value = (custom_params or {}).get("kv_policy")
        if value is None:
            return
        spec = parse_kv_policy(value)  # the front end validated it; this guards direct engine use
        if not spec.compresses:
            return
        if self.region is None:
            raise KVPolicyError("kv_policy", f"{spec.name!r} compresses, and this engine does not run "
                                             "kvsieve's attention backend")
        policy = policy_instance(spec.name)
        params = type(policy).Params.model_validate(spec.params)
        cfg = self.region.config
        req = CompressedRequest(rid=rid, spec=spec, policy=policy, params=params, prompt_len=prompt_len,
                                sgl_req=sgl_req)
        try:
            with faults.guard("admit", spec.name, [], passes=(KVPolicyError,)):
                req.state = policy.begin_request(params, cfg.num_layers, cfg.num_kv_heads)
                # Groups of generated tokens only: a prompt in the region stays in full precision.
                req.tbq = policy.quantizes(params) and self.region.quant is not None and not spec.prompt_compressed
                observes = policy.observes_tokens(req.state)
        except faults.PolicyFault as fault:
            # Never admitted: it holds nothing; it ends at its first step with a 500.
            message = f"kvsieve: policy {spec.name!r} failed in admit: {fault.__cause__!r}"
            if sgl_req is not None:
                from http import HTTPStatus

                from sglang.srt.managers.schedule_batch import FINISH_ABORT

                sgl_req.set_finish_with_abort(message)
                sgl_req.to_finish = FINISH_ABORT(message, HTTPStatus.INTERNAL_SERVER_ERROR, "InternalServerError")
            if head_parallel.reports_usage():
                metrics.REQUEST_ERRORS.labels(spec.name, "admit").inc()
            return
        self.requests[rid] = req
        if observes:
            self.token_observers.add(rid)

    def exceeds_region(self, req: CompressedRequest, max_new_tokens: int) -> Optional[str]:
        """Why the request can never run (its ceiling with nothing shared
        exceeds the whole region), or None."""
        cfg = self.region.config
        full, quant = req.page_need(req.prompt_len, max_new_tokens, cfg.page_size)
        need, have = (quant * cfg.heads, cfg.quant_pages) if req.tbq else (full * cfg.heads, cfg.num_pages)
        if need <= have and full * cfg.heads <= cfg.num_pages:
            return None
        # Starts with the field, which the API reports as the error's param.
        return (f"kv_policy: this request may hold {need} {'quantized ' if req.tbq else ''}pages of the "
                f"compressed region (prompt {req.prompt_len} + max_tokens {max_new_tokens} tokens, budget "
                f"{req.budget_tokens(req.prompt_len + max_new_tokens)} per layer and kv head), but the region "
                f"has {have}; lower max_tokens or the budget")

    def fits(self, req: CompressedRequest, private_prompt: int, max_new_tokens: int) -> bool:
        """Whether the request's ceiling pages are free (always, once allocated)."""
        if req.reserved_pages:
            return True
        return self.region.can_allocate(*req.page_need(private_prompt, max_new_tokens, self.region.config.page_size))

    def reserve(self, req: CompressedRequest, private_prompt: int, max_new_tokens: int) -> None:
        """The request was admitted: allocate its ceiling pages until it ends."""
        if req.reserved_pages:
            return
        cfg = self.region.config
        self.region.allocate(req.rid, *req.page_need(private_prompt, max_new_tokens, cfg.page_size))
        req.reserved_pages = self.region.pages_of(req.rid)
        req.max_new_tokens = max_new_tokens
        self._record_pages()

    def begin(self, req: CompressedRequest, prefix_len: int) -> None:
        """Its first forward (step_meta): `prefix_len` tokens are read from
        the token pool, the rest of its private tokens from the region."""
        req.prefix_len = prefix_len

    def after_prefill(self, req: CompressedRequest) -> None:
        """Its prompt was selected and compacted in the forward: from here a
        head holds at most the decode-phase ceiling; give the rest back."""
        if not req.reserved_pages or not req.private_prompt_in_region:
            return
        private = req.prompt_len - req.prefix_len
        budget = req.budget_tokens(private + req.max_new_tokens)
        kept = req.policy.kept_after_prefill(req.params, private, req.budget_tokens(private))
        peak = req.policy.max_private_tokens(req.params, kept, req.max_new_tokens, budget)
        self.region.shrink(req.rid, -(-max(peak, kept + 1, 1) // self.region.config.page_size))
        req.reserved_pages = self.region.pages_of(req.rid)
        self._record_pages()

    def forget_unadmitted(self, rids) -> None:
        """Drop requests aborted before admission: they hold nothing."""
        for rid in rids:
            req = self.requests.get(rid)
            if req is not None and not req.reserved_pages and req.prefix_len < 0:
                del self.requests[rid]
                self.token_observers.discard(rid)

    def overflow(self, req: CompressedRequest) -> None:
        """A head ran out of slots: end this request with a 503 (retry later).
        Other requests keep running untouched. Cannot happen while every
        policy stays within its own ceiling."""
        from http import HTTPStatus

        self.fail(req, "kvsieve compressed region is full; retry later", HTTPStatus.SERVICE_UNAVAILABLE,
                  "ServiceUnavailable")

    def fail(self, req: CompressedRequest, message: str, status=None, err_type: str = "InternalServerError") -> None:
        """End one request with an error (logged); its rows get zeros until
        SGLang ends it, and every other request keeps running."""
        from http import HTTPStatus

        from sglang.srt.managers.schedule_batch import FINISH_ABORT

        req.overflowed = True
        logger.error("kvsieve: request %s (%s): %s", req.rid, req.spec.name, message)
        if req.sgl_req is not None:
            req.sgl_req.to_finish = FINISH_ABORT(message, status or HTTPStatus.INTERNAL_SERVER_ERROR, err_type)

    def end(self, rid: str) -> None:
        """Scheduler hook (release_kv_cache): return the request's pages, keep its usage."""
        req = self.requests.pop(rid, None)
        self.token_observers.discard(rid)
        if req is None:
            return
        if self.region is not None and req.prefix_len >= 0:
            cfg = self.region.config
            usage = self._usage(req)
            if req.state is not None and not req.overflowed:
                try:  # policy code: a fault here must not keep the pages below from coming back
                    with faults.guard("usage", req.spec.name, [req]):
                        usage.update(req.policy.usage(req.state))
                except faults.PolicyFault:
                    pass
            self.finished[rid] = usage
            if head_parallel.reports_usage():  # token counts once, not once per TP rank
                metrics.EVICTED_TOKENS.labels(req.spec.name).inc(usage["evicted_tokens"])
                metrics.EVICTION_EVENTS.labels(req.spec.name).inc(usage["eviction_events"])
                metrics.RETAINED_TOKENS.labels(req.spec.name).dec(req.reported_tokens)
            # each rank its own bytes
            metrics.add_retained(req.spec.name, -req.reported_bytes, -2 * cfg.head_dim * req.reported_held)
            metrics.record_bits_per_element()
        if self.region is not None:
            self.region.free(rid)
            self._record_pages()
        if req.state is not None:
            try:
                req.policy.end_request(req.state)
            except Exception:  # noqa: BLE001 - the request is over; its pages are back
                logger.exception("kvsieve: policy %r failed in end_request of %s", req.spec.name, rid)

    def pop_usage(self, rid: str) -> Optional[dict]:
        return self.finished.pop(rid, None)

    # ----- what the forward counts (device) ----------------------------------
    def reset_counters(self, row: int) -> None:
        self.counters[row].zero_()  # (a Python scalar assigned here would block the host on CUDA)
        self.overflow_flags[row].zero_()

    def count_evictions(self, rows: torch.Tensor, evicted: torch.Tensor) -> None:
        """Inside the forward: add a layer's evicted slots per row. A row may
        come more than once (a pass over several layers: layer_blocks.py),
        so the adds accumulate rather than assign."""
        evicted = evicted.long()
        self.counters.index_add_(0, rows, torch.stack([evicted, (evicted > 0).long()], dim=1))

    def flag_overflow(self, rows: torch.Tensor, no_room: torch.Tensor) -> None:
        """Inside the forward: rows that found no free slot for their new token."""
        self.overflow_flags[rows] |= no_room

    def _usage(self, req: CompressedRequest) -> dict:
        cfg = self.region.config
        row = self.region.row_of(req.rid)
        # A request that never reached a decode step (max_tokens 1, prompt in
        # the radix cache) was never bound: its pages were never cleared
        # (bind clears them) and hold the previous owner's slots, not its own.
        held = self.region.held_tokens([req.rid])[0] if self.region.owns(req.rid) and row >= 0 else 0
        evicted, events = self.counters[row].tolist() if row >= 0 else (0, 0)
        size = int(self.region.retained_bytes_of_rows(to_device([row], torch.int64, self.counters.device))[0]) \
            if row >= 0 else 0
        # Heads differ in what they hold (per-head eviction, TBQ pages and
        # their scales), so every rank's share is summed, not scaled from
        # this rank's. end() runs on every rank in the same order.
        held, evicted, size = head_parallel.sum_over_ranks([held, evicted, size], self.counters.device)
        heads = cfg.heads * head_parallel.SHARDS.size
        # A prompt kept in the radix cache is retained whole.
        kept_prompt = 0 if req.private_prompt_in_region else req.prompt_len - max(req.radix_hit, 0)
        return {
            "retained_tokens": held // heads + kept_prompt,
            "evicted_tokens": evicted // heads,
            "eviction_events": events,
            "retained_kv_bytes": size,
            # Of the region's tokens: codes and scales over K and V elements.
            "kv_bits_per_element": round(8 * size / (held * 2 * cfg.head_dim), 3) if held else None,
            "tbq": req.tbq,
        }

    def after_step(self, force: bool = False) -> None:
        """Host side, before a step's metadata: at most once a second, end
        requests that overflowed and refresh the retained-KV gauges.

        The counts are taken on the device and copied back asynchronously; a
        later step applies them once they have arrived, so the host never
        waits for the GPU here (a wait would stall the overlap scheduler).
        `force` waits for them (tests, shutdown)."""
        if self.region is None:
            return
        self._apply_snapshot(wait=force)
        now = time.monotonic()
        if self._snapshot is not None or (not force and now - self._last_refresh < REFRESH_INTERVAL_S):
            return
        self._last_refresh = now
        metrics.record_gpu_memory()
        live = [r for r in self.requests.values() if self.region.row_of(r.rid) >= 0 and not r.overflowed]
        if not live:
            return
        device = self.overflow_flags.device
        rows = to_device([self.region.row_of(r.rid) for r in live], torch.int64, device)
        counts = torch.stack([self.region.held_tokens_of_rows(rows), self.overflow_flags[rows].long(),
                              self.region.retained_bytes_of_rows(rows)])
        event = None
        if counts.is_cuda:
            host = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=True)
            host.copy_(counts, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            counts = host
        self._snapshot = (live, counts, event)
        if force or event is None:
            self._apply_snapshot(wait=True)

    def _apply_snapshot(self, wait: bool) -> None:
        """Apply the counts after_step took, once the copy has landed."""
        if self._snapshot is None:
            return
        live, counts, event = self._snapshot
        if event is not None:
            if not wait and not event.query():
                return
            event.synchronize()
        self._snapshot = None
        cfg = self.region.config
        # A host tensor by now (pinned, its copy landed): reading it waits for nothing.
        held_per_request, flags, bytes_per_request = counts.tolist()
        for req, held, overflowed, size in zip(live, held_per_request, flags, bytes_per_request):
            if self.requests.get(req.rid) is not req or req.overflowed:
                continue  # ended or failed since the counts were taken: end() settled its gauges
            if overflowed:
                self.overflow(req)
            tokens = held // cfg.heads
            if head_parallel.reports_usage():
                metrics.RETAINED_TOKENS.labels(req.spec.name).inc(tokens - req.reported_tokens)
            metrics.add_retained(req.spec.name, size - req.reported_bytes, 2 * cfg.head_dim * (held - req.reported_held))
            req.reported_tokens, req.reported_bytes, req.reported_held = tokens, size, held
        metrics.record_bits_per_element()

    def _record_pages(self) -> None:
        metrics.record_region(self.region.pages_used, self.region.pages_free)
        free = self.region.quant_pages_free
        metrics.record_quantized_pages(self.region.config.quant_pages - free, free)
        metrics.record_region_reserved(self.region.pages_used)

    # ----- token observations (host, once per forward) -------------------------
    def observe_tokens(self, forward_batch, input_ids: torch.Tensor, hidden: torch.Tensor) -> None:
        """Hand policies that asked for them the token ids and last-layer
        hidden states of their private tokens in this forward."""
        rids = forward_batch.rids
        if not rids:
            # A forward SGLang replayed from its own graphs (its static batch
            # names no requests): it has no compressed rows
            # (plugin.graphs_skip_compressed_batches), so nothing to observe.
            return
        extend = forward_batch.forward_mode.is_extend()
        lengths = forward_batch.extend_seq_lens_cpu if extend else [1] * len(rids)
        by_policy: dict = {}  # one call per policy, not per request
        owners: dict = {}  # policy -> its CompressedRequests here (a fault ends them)
        start = 0
        for rid, n in zip(rids, lengths):
            req = self.requests.get(rid)
            if rid in self.token_observers and req is not None and not req.overflowed:
                by_policy.setdefault(req.policy, []).append((req.state, start, n))
                owners.setdefault(req.policy, []).append(req)
            start += n
        for policy, requests in by_policy.items():
            wants_hidden = bool(policy.needs & Need.HIDDEN_STATES)
            try:
                with faults.guard("tokens", policy.name, owners[policy]):
                    policy.on_forward_tokens(requests, forward_batch.positions, input_ids,
                                             hidden if wants_hidden else None)
            except faults.PolicyFault:
                continue


RUNTIME = KVRuntime()
