"""The decode slot hook (radix_ext/decode_slots.py) makes no host sync on a
GPU. SGLang's overlap scheduler prepares step N+1, this hook included,
while step N's forward runs: a wait here puts every later piece of host
work after the GPU's, and a batch mixing `full` rows with compressed ones
lost ~40% of its time to one synchronous copy (2026-11-29)."""

import warnings
from types import SimpleNamespace

import torch

from kvsieve.radix_ext import decode_slots
from kvsieve.radix_ext.pages import PageManager, RegionConfig
from kvsieve.radix_ext.runtime import RUNTIME

ROWS = 128


def test_a_mixed_batch_gets_its_pool_slots_without_a_host_sync(monkeypatch):
    from sglang.srt.mem_cache import allocation
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    # SGLang's allocator is not what this is about: slots 1..n, on the device.
    monkeypatch.setattr(allocation, "_alloc_page_size", lambda batch: 1)
    monkeypatch.setattr(allocation, "alloc_token_slots",
                        lambda tree_cache, n: torch.arange(1, n + 1, dtype=torch.int64, device="cuda"))
    pool = ReqToTokenPool(size=ROWS, max_context_len=64, device="cuda", enable_memory_saver=False)
    rids = [f"c{i}" if i % 10 else f"f{i}" for i in range(ROWS)]  # every tenth row uncompressed
    RUNTIME.region = PageManager(RegionConfig(num_layers=1, num_kv_heads=1, head_dim=4, num_pages=4))
    for rid in rids:
        if rid.startswith("c"):
            RUNTIME.admit(rid, {"kv_policy": {"name": "h2o", "budget": 8}}, prompt_len=4)
    batch = SimpleNamespace(
        reqs=[SimpleNamespace(rid=r, kv=SimpleNamespace(kv_allocated_len=4)) for r in rids],
        seq_lens=torch.full((ROWS,), 4, device="cuda"), req_pool_indices=torch.arange(1, ROWS + 1, device="cuda"),
        req_to_token_pool=pool, tree_cache=None, model_config=SimpleNamespace(is_encoder_decoder=False))
    try:
        decode_slots.alloc_for_decode_skipping_compressed(None, batch, 1)  # first-call allocations
        torch.cuda.synchronize()
        syncs = []
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = lambda message, *a, **k: syncs.append(str(message))
            torch.cuda.set_sync_debug_mode("warn")
            try:
                torch.cuda._sleep(50_000_000)  # the GPU is busy with the "previous forward"
                out = decode_slots.alloc_for_decode_skipping_compressed(None, batch, 1)
            finally:
                torch.cuda.set_sync_debug_mode("default")
    finally:
        RUNTIME.requests.clear()
        RUNTIME.region = None
    assert [s for s in syncs if "synchroniz" in s] == []
    full = [i for i, r in enumerate(rids) if r.startswith("f")]
    expected = torch.zeros(ROWS, dtype=torch.int64)
    expected[full] = torch.arange(1, len(full) + 1)
    assert torch.equal(out.cpu(), expected)  # compressed rows get SGLang's dummy slot 0
    assert pool.req_to_token[torch.tensor(full) + 1, 4].cpu().tolist() == list(range(1, len(full) + 1))
