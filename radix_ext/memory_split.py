"""The split of SGLang's KV memory between its token pool and the compressed
region.

On CUDA the region is carved out of SGLang's own KV budget (what
--mem-fraction-static leaves after the weights): KVSIEVE_REGION_FRACTION
(default 0.5) of it goes to the region, the rest to the token pool. On CPU,
where the pool is sized by --max-total-tokens, the region is
KVSIEVE_REGION_SHARE (default 1.0) times the pool's bytes, or exactly
KVSIEVE_REGION_PAGES pages on either device. A split that cannot serve fails
at start-up with a message naming the setting.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

import torch

logger = logging.getLogger(__name__)

FRACTION_ENV = "KVSIEVE_REGION_FRACTION"
DEFAULT_FRACTION = 0.5

#: Bytes reserved for the region by the carve, set in the scheduler process
#: before the token pool is allocated; None where nothing was carved.
carved_bytes: Optional[int] = None
#: kvsieve's workspace planned at start (memory_plan.py), and the rows it
#: was planned for (max_running_requests is lowered to them); None on CPU.
workspace = None


def fraction_from_env(name: str, default: float, meaning: str) -> float:
    """A setting that must be a number in (0, 1); the error names it and says what it is."""
    raw = os.environ.get(name, str(default))
    try:
        fraction = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: must be a number in (0, 1)") from None
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"{name}={raw}: must be in (0, 1): {meaning}")
    return fraction


def region_fraction() -> float:
    return fraction_from_env(FRACTION_ENV, DEFAULT_FRACTION, "the share of SGLang's KV memory "
                             "(--mem-fraction-static) given to the compressed region; the rest is the token pool")


def carve_region(original, configurator, *args, **kwargs) -> int:
    """AROUND KVCacheConfigurator._profile_available_bytes: the token pool
    gets (1 - fraction) of SGLang's KV budget; the region the rest."""
    global carved_bytes, workspace
    available = original(configurator, *args, **kwargs)
    server_args = configurator.server_args
    if server_args.attention_backend != "kvsieve" or str(server_args.device) != "cuda":
        return available
    from . import memory_plan

    shape = model_shape(configurator)
    rows = server_args.max_running_requests or memory_plan.DEFAULT_ROWS
    fixed = int(os.environ.get("KVSIEVE_REGION_PAGES", "0"))
    if fixed:
        # A fixed region is allocated after SGLang's pools, outside this
        # budget; the workspace is planned for it and checked at start-up
        # (runtime.ensure_region).
        fraction = min(0.99, fixed * memory_plan.slot_bytes(shape) * shape.page_size / max(available, 1))
        _, workspace = memory_plan.fit_rows(shape, rows, available, fraction)
        return available
    fraction = region_fraction()
    _, workspace = memory_plan.fit_rows(shape, rows, available, fraction)
    kv_budget = available - workspace.total
    carved_bytes = int(kv_budget * fraction)
    return kv_budget - carved_bytes


def model_shape(configurator):
    """The served model as the workspace plan needs it (this rank's kv heads)."""
    from . import memory_plan

    mc = configurator.model_config
    text = getattr(mc, "hf_text_config", None) or mc.hf_config
    hidden = int(getattr(text, "hidden_size", 0) or 0)
    return memory_plan.ModelShape(
        num_layers=int(mc.num_hidden_layers), kv_heads=int(mc.get_num_kv_heads(configurator.server_args.tp_size)),
        q_heads=int(mc.get_num_attention_heads(configurator.server_args.tp_size)),
        head_dim=int(mc.head_dim), element=int(torch.empty((), dtype=configurator.kv_cache_dtype).element_size()),
        hidden=hidden, intermediate=int(getattr(text, "intermediate_size", 0) or 4 * hidden),
        context_len=int(mc.context_len), page_size=int(os.environ.get("KVSIEVE_REGION_PAGE_SIZE", "16")))


def cap_running_requests(original, configurator, *args, **kwargs) -> int:
    """AROUND KVCacheConfigurator.resolve_max_num_reqs: no more rows than
    the workspace was planned for (carve_region), said at start-up."""
    rows = original(configurator, *args, **kwargs)
    if workspace is not None and rows > workspace.rows:
        logger.warning("kvsieve: max_running_requests lowered from %d to %d, the rows kvsieve's GPU workspace is "
                       "planned for (--max-running-requests, %d when unset, at most what fits in "
                       "KVSIEVE_WORKSPACE_SHARE of the KV budget): %s", rows, workspace.rows,
                       _default_rows(), workspace.describe())
        return workspace.rows
    return rows


def _default_rows() -> int:
    from . import memory_plan

    return memory_plan.DEFAULT_ROWS


def region_pages(pool_tokens: int, num_layers: int, num_kv_heads: int, page_size: int, bytes_per_page: int,
                 context_len: Optional[int] = None) -> int:
    """Pages of the region for this process; raises naming the setting when
    the split leaves either side unable to serve one request."""
    fixed = int(os.environ.get("KVSIEVE_REGION_PAGES", "0"))
    if fixed:
        pages, setting = fixed, "KVSIEVE_REGION_PAGES"
    elif carved_bytes is not None:
        pages, setting = carved_bytes // bytes_per_page, FRACTION_ENV
        if context_len is not None and pool_tokens < min(context_len, 4096):
            raise ValueError(f"{FRACTION_ENV}={region_fraction()}: leaves the token pool {pool_tokens} tokens, "
                             f"less than one {min(context_len, 4096)}-token request; lower it or raise "
                             "--mem-fraction-static")
    else:
        share = float(os.environ.get("KVSIEVE_REGION_SHARE", "1.0"))
        pages, setting = int(share * pool_tokens * num_layers * num_kv_heads / page_size), "KVSIEVE_REGION_SHARE"
    if pages < num_layers * num_kv_heads:
        raise ValueError(f"{setting}: the compressed region would have {pages} pages, fewer than one page per "
                         f"(layer, kv head) ({num_layers * num_kv_heads}); no compressed request could run")
    return pages


QUANT_SHARE_ENV = "KVSIEVE_REGION_QUANT_SHARE"
DEFAULT_QUANT_SHARE = 0.5
QUANT_BITS_ENV = "KVSIEVE_TBQ_BITS"


def quant_bits() -> int:
    """Bits per element a quantized page's code rows hold: 4 (NVFP4 and
    ternary; thinkv's params refuse R8E4T2 here, a 400 naming this setting)
    or 8 (FP8 too)."""
    raw = os.environ.get(QUANT_BITS_ENV, "4")
    if raw not in ("4", "8"):
        raise ValueError(f"{QUANT_BITS_ENV}={raw!r}: must be 4 or 8")
    return int(raw)


def split_quantized(pages: int, heads: int, bytes_per_page: int, quant_bytes_per_page: int) -> tuple[int, int]:
    """(full-precision pages, quantized pages) of the region.

    KVSIEVE_REGION_QUANT_SHARE (default 0.5) of the region's bytes go to
    quantized pages on CUDA (the carve is split); on CPU the quantized pages
    come on top of the full-precision ones (share x their bytes), so other
    policies keep the region they had. With KVSIEVE_REGION_PAGES the
    quantized pages are KVSIEVE_REGION_QUANT_PAGES (default 0: no TBQ)."""
    if os.environ.get("KVSIEVE_REGION_PAGES"):
        return pages, int(os.environ.get("KVSIEVE_REGION_QUANT_PAGES", "0"))
    raw = os.environ.get(QUANT_SHARE_ENV, str(DEFAULT_QUANT_SHARE))
    try:
        share = float(raw)
    except ValueError:
        raise ValueError(f"{QUANT_SHARE_ENV}={raw!r}: must be a number in [0, 1)") from None
    if not 0.0 <= share < 1.0:
        raise ValueError(f"{QUANT_SHARE_ENV}={raw}: must be in [0, 1): the share of the region's bytes in "
                         "quantized pages (TBQ)")
    quant = int(pages * share * bytes_per_page // quant_bytes_per_page)
    if carved_bytes is not None:
        pages = int(pages * (1.0 - share))
        if pages < heads:
            raise ValueError(f"{QUANT_SHARE_ENV}={raw}: leaves {pages} full-precision pages, fewer than one "
                             f"per (layer, kv head) ({heads})")
    return pages, quant
