"""Per-scheduler-process state of compressed requests: which rids compress,
their policy instance, budgets, counters, and the region they live in.

SGLang's scheduler, its model runner and the attention backend share one
process, so the scheduler hooks (plugin.py) and the backend (backend.py)
meet here, keyed by request id.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field
from typing import Optional

import torch

from kvsieve.policies import KVPolicyError, KVPolicySpec, LayerObservations, Policy, get_policy, parse_kv_policy

from . import metrics
from .region import CompressedRegion, RegionConfig

logger = logging.getLogger(__name__)

#: Budget of a compressing request that names none (tokens per layer and kv head).
DEFAULT_BUDGET = 1024
#: Floor of a budget given as budget_ratio.
MIN_RATIO_BUDGET = 16


def _pad_slots(values: torch.Tensor, num_slots: int) -> torch.Tensor:
    """[H, S] padded with zeros to [H, num_slots]."""
    return torch.nn.functional.pad(values, (0, num_slots - values.shape[1]))


@dataclass
class CompressedRequest:
    rid: str
    spec: KVPolicySpec
    policy: Policy
    prompt_len: int
    prefix_len: int = -1  # radix-shared prompt tokens; -1 until the first extend
    private_seen: int = 0  # private tokens stored so far (per layer)
    evicted: int = 0  # slot evictions summed over layers and heads
    eviction_events: int = 0  # (step, layer) pairs that evicted something
    reported_tokens: int = 0  # what the retained gauges hold for this request
    reported_bytes: int = 0
    #: SGLang's Req, to end it cleanly if the region cannot take its tokens.
    sgl_req: object = None
    #: Region pages reserved at admission for the request's compressed
    #: ceiling; 0 while it waits.
    reserved_pages: int = 0
    #: Tokens it may still generate, as of its admission.
    max_new_tokens: int = 0
    #: Set when the region ran out for this request: it is being aborted and
    #: the backend leaves its rows to SGLang's path until it ends. Admission
    #: reserves the ceiling, so this is a guard against accounting bugs only.
    overflowed: bool = False

    #: Per layer, observations of the prompt's last queries gathered over
    #: its prefill chunks, until on_prefill_end.
    prefill_obs: dict = field(default_factory=dict)

    def add_prefill_observations(self, layer: int, obs: LayerObservations) -> None:
        """Sum a chunk's observations into the layer's; slots only append
        during prefill, so a later chunk's [H, S] extends an earlier one's."""
        kept = self.prefill_obs.setdefault(layer, LayerObservations())
        for name in ("attention", "pv_norm"):
            new = getattr(obs, name)
            if new is not None:
                old = getattr(kept, name)
                setattr(kept, name, new if old is None else new + _pad_slots(old, new.shape[1]))

    def take_prefill_observations(self, layer: int, num_slots: int) -> LayerObservations:
        obs = self.prefill_obs.pop(layer, LayerObservations())
        for name in ("attention", "pv_norm"):
            value = getattr(obs, name)
            if value is not None:
                setattr(obs, name, _pad_slots(value, num_slots))
        return obs

    def budget_tokens(self, private_tokens: int) -> int:
        """Budget per (layer, head) once `private_tokens` are seen."""
        if self.spec.budget is not None:
            return self.spec.budget
        if self.spec.budget_ratio is not None:
            return max(MIN_RATIO_BUDGET, math.ceil(self.spec.budget_ratio * max(private_tokens, 1)))
        return DEFAULT_BUDGET

    def budget(self, num_kv_heads: int, device="cpu") -> torch.Tensor:
        """[H] tokens per kv head, on the region's device (policies compare it with slot tensors)."""
        return torch.full((num_kv_heads,), self.budget_tokens(self.private_seen), dtype=torch.int64, device=device)

    def ceiling_pages(self, private_prompt: int, max_new_tokens: int, config: RegionConfig) -> int:
        """Region pages the request can hold at most: its policy's peak per
        (layer, head), in whole pages (a head takes a new page only when all
        of its pages are full, so it never holds more than this)."""
        final_budget = self.budget_tokens(private_prompt + max_new_tokens)  # budgets only grow
        peak = self.policy.max_private_tokens(private_prompt, max_new_tokens, final_budget)
        per_head = -(-max(peak, 1) // config.page_size)
        return per_head * config.num_layers * config.num_kv_heads


class KVRuntime:
    def __init__(self):
        self.region: Optional[CompressedRegion] = None
        self.requests: dict[str, CompressedRequest] = {}
        self.finished: dict[str, dict] = {}  # rid -> final usage, until reported
        self.reserved_pages = 0  # sum of the running requests' ceilings
        #: Set when a prefill's end returned pool slots (decode_slots.py), so
        #: the scheduler retries its waiting queue before a request finishes.
        self.pool_slots_freed = False

    # ----- set-up, by the attention backend once the model is known ---------
    def ensure_region(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype, device,
                      pool_tokens: int) -> CompressedRegion:
        """Create the region once: KVSIEVE_REGION_SHARE (default 1.0) times the
        bytes of SGLang's token pool (`pool_tokens` tokens), or exactly
        KVSIEVE_REGION_PAGES pages."""
        if self.region is None:
            page_size = int(os.environ.get("KVSIEVE_REGION_PAGE_SIZE", "16"))
            share = float(os.environ.get("KVSIEVE_REGION_SHARE", "1.0"))
            pages = int(os.environ.get("KVSIEVE_REGION_PAGES", "0")) or max(
                1, int(share * pool_tokens * num_layers * num_kv_heads / page_size))
            self.region = CompressedRegion(RegionConfig(
                num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                num_pages=pages, page_size=page_size, dtype=dtype, device=str(device)))
            metrics.record_region(0, pages)
            pool_mib = pool_tokens * num_layers * num_kv_heads * 2 * head_dim * self.region.k.element_size() / 2**20
            # Warning level: SGLang's scheduler logs only warnings by default,
            # and operators need this split at start-up.
            logger.warning(
                "kvsieve KV memory split: SGLang token pool %.1f MiB (%d tokens), compressed region "
                "%.1f MiB (%d pages x %d slots per (layer, kv head))",
                pool_mib, pool_tokens, pages * self.region.config.bytes_per_page / 2**20, pages, page_size)
        return self.region

    # ----- request lifecycle -------------------------------------------------
    def admit(self, rid: str, custom_params: Optional[dict], prompt_len: int, sgl_req=None) -> None:
        """Scheduler hook: remember a request whose kv_policy compresses."""
        value = (custom_params or {}).get("kv_policy")
        if value is None:
            return
        spec = parse_kv_policy(value)  # the front end validated it; this guards direct engine use
        if not spec.compresses:
            return
        if self.region is None:
            raise KVPolicyError("kv_policy", f"{spec.name!r} compresses, and this engine does not run "
                                             "kvsieve's attention backend")
        policy = get_policy(spec.name)(get_policy(spec.name).Params.model_validate(spec.params))
        self.requests[rid] = CompressedRequest(rid=rid, spec=spec, policy=policy, prompt_len=prompt_len,
                                               sgl_req=sgl_req)

    # ----- region admission ---------------------------------------------------
    def exceeds_region(self, req: CompressedRequest, max_new_tokens: int) -> Optional[str]:
        """Why the request can never run (its ceiling with nothing shared
        exceeds the whole region), or None."""
        cfg = self.region.config
        need = req.ceiling_pages(req.prompt_len, max_new_tokens, cfg)
        if need <= cfg.num_pages:
            return None
        # Starts with the field, which the API reports as the error's param.
        return (f"kv_policy: this request may hold {need} pages of the compressed region "
                f"(prompt {req.prompt_len} + max_tokens {max_new_tokens} tokens, budget "
                f"{req.budget_tokens(req.prompt_len + max_new_tokens)} per layer and kv head), but the region "
                f"has {cfg.num_pages}; lower max_tokens or the budget")

    def fits(self, req: CompressedRequest, private_prompt: int, max_new_tokens: int) -> bool:
        """Whether the request's ceiling fits next to the running requests'
        ceilings (always, once it is reserved)."""
        if req.reserved_pages:
            return True
        need = req.ceiling_pages(private_prompt, max_new_tokens, self.region.config)
        return self.reserved_pages + need <= self.region.config.num_pages

    def reserve(self, req: CompressedRequest, private_prompt: int, max_new_tokens: int) -> None:
        """The request was admitted: hold its ceiling until it ends."""
        if req.reserved_pages:
            return
        req.reserved_pages = req.ceiling_pages(private_prompt, max_new_tokens, self.region.config)
        req.max_new_tokens = max_new_tokens
        self.reserved_pages += req.reserved_pages
        metrics.record_region_reserved(self.reserved_pages)

    def shrink_reservation(self, req: CompressedRequest) -> None:
        """After prefill the policy has cut the prompt: from here a head holds
        at most the pages it holds now or its decode-phase peak in pages,
        whichever is more (a head takes a page only when all of its pages are
        full; pages are never compacted). Give the rest back to admission."""
        if not req.reserved_pages:
            return
        cfg = self.region.config
        held = int(self.region.held_tokens(req.rid).max())  # private tokens kept, per (layer, head)
        new = req.max_new_tokens
        peak = req.policy.max_private_tokens(held, new, req.budget_tokens(req.private_seen + new))
        per_head = self.region.pages_held(req.rid).clamp(min=-(-max(peak, 1) // cfg.page_size))
        need = min(int(per_head.sum()), req.reserved_pages)
        self.reserved_pages -= req.reserved_pages - need
        req.reserved_pages = need
        metrics.record_region_reserved(self.reserved_pages)

    def forget_unadmitted(self, rids) -> None:
        """Drop requests aborted before admission: they hold nothing."""
        for rid in rids:
            req = self.requests.get(rid)
            if req is not None and not req.reserved_pages and req.prefix_len < 0:
                del self.requests[rid]

    def overflow(self, req: CompressedRequest) -> None:
        """The region is full: free this request's pages now and end it with
        a 503 (retry later). Other requests keep running untouched.

        Cannot happen while every request stays within its reserved ceiling;
        it keeps the engine alive if a policy breaks its own ceiling."""
        from http import HTTPStatus

        from sglang.srt.managers.schedule_batch import FINISH_ABORT

        req.overflowed = True
        if req.sgl_req is not None:
            req.sgl_req.to_finish = FINISH_ABORT(
                "kvsieve compressed region is full; retry later", HTTPStatus.SERVICE_UNAVAILABLE, "ServiceUnavailable")
        self.region.end(req.rid)
        self.region.begin(req.rid)  # empty again, so end() stays uniform
        metrics.record_region(self.region.pages_used, self.region.pages_free)

    def begin(self, req: CompressedRequest, prefix_len: int) -> None:
        req.prefix_len = prefix_len
        cfg = self.region.config
        req.policy.on_request_begin(cfg.num_layers, cfg.num_kv_heads)
        self.region.begin(req.rid)

    def report(self, req: CompressedRequest) -> None:
        """Refresh the region gauges after a step of `req` (all layers done)."""
        held = int(self.region.held_tokens(req.rid).sum())
        heads = self.region.config.num_layers * self.region.config.num_kv_heads
        tokens, size = held // heads, held * self.region.config.bytes_per_page // self.region.config.page_size
        metrics.RETAINED_TOKENS.labels(req.spec.name).inc(tokens - req.reported_tokens)
        metrics.RETAINED_BYTES.labels(req.spec.name).inc(size - req.reported_bytes)
        req.reported_tokens, req.reported_bytes = tokens, size
        metrics.record_region(self.region.pages_used, self.region.pages_free)

    def end(self, rid: str) -> None:
        """Scheduler hook (release_kv_cache): return the request's pages, keep its usage."""
        req = self.requests.pop(rid, None)
        if req is None:
            return
        if req.reserved_pages:
            self.reserved_pages -= req.reserved_pages
            metrics.record_region_reserved(self.reserved_pages)
        if self.region is not None and req.prefix_len >= 0:
            cfg = self.region.config
            held = int(self.region.held_tokens(rid).sum())
            heads = cfg.num_layers * cfg.num_kv_heads
            self.finished[rid] = {
                "retained_tokens": held // heads,
                "evicted_tokens": req.evicted // heads,
                "eviction_events": req.eviction_events,
                "retained_kv_bytes": held * cfg.bytes_per_page // cfg.page_size,
            }
            self.region.end(rid)
            metrics.EVICTED_TOKENS.labels(req.spec.name).inc(req.evicted // heads)
            metrics.EVICTION_EVENTS.labels(req.spec.name).inc(req.eviction_events)
            metrics.RETAINED_TOKENS.labels(req.spec.name).dec(req.reported_tokens)
            metrics.RETAINED_BYTES.labels(req.spec.name).dec(req.reported_bytes)
            metrics.record_region(self.region.pages_used, self.region.pages_free)
        req.policy.on_request_end()

    def pop_usage(self, rid: str) -> Optional[dict]:
        return self.finished.pop(rid, None)


RUNTIME = KVRuntime()
