"""The decode hooks' choices: compressed rows take no pool slot next step, so
SGLang's retraction check counts only the uncompressed rows, and they are the
last to be retracted (retracting them frees no pool slot)."""

import os
from types import SimpleNamespace

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

from kvsieve.radix_ext.decode_slots import decode_growth_without_compressed, retract_uncompressed_first  # noqa: E402
from kvsieve.radix_ext.pages import PageManager, RegionConfig  # noqa: E402
from kvsieve.radix_ext.runtime import RUNTIME  # noqa: E402


def fake_batch(rids):
    # Only what the hook reads of SGLang's ScheduleBatch.
    return SimpleNamespace(
        reqs=[SimpleNamespace(rid=r) for r in rids],
        spec_algorithm=SimpleNamespace(is_none=lambda: True),
        model_config=SimpleNamespace(is_encoder_decoder=False),
        tree_cache=SimpleNamespace(page_size=1),
    )


def test_only_uncompressed_rows_need_a_pool_slot():
    original_calls = []

    def original(batch, selected=None):
        original_calls.append(selected)
        return len(batch.reqs)

    # Compressing requests are admitted only where the backend made a region.
    RUNTIME.region = PageManager(RegionConfig(num_layers=1, num_kv_heads=1, head_dim=4, num_pages=4))
    RUNTIME.admit("c1", {"kv_policy": {"name": "h2o", "budget": 8}}, prompt_len=4)
    RUNTIME.admit("c2", {"kv_policy": {"name": "streaming", "budget": 8}}, prompt_len=4)
    try:
        batch = fake_batch(["f1", "c1", "f2", "c2"])
        assert decode_growth_without_compressed(original, batch) == 2
        assert decode_growth_without_compressed(original, batch, [1, 3]) == 0
        assert decode_growth_without_compressed(original, batch, [0, 1]) == 1
        assert original_calls == []
    finally:
        RUNTIME.requests.clear()
        RUNTIME.region = None
    # Without compressed requests SGLang's own count is used.
    assert decode_growth_without_compressed(original, fake_batch(["f1"])) == 1
    assert original_calls == [None]


def test_uncompressed_requests_are_retracted_first():
    RUNTIME.region = PageManager(RegionConfig(num_layers=1, num_kv_heads=1, head_dim=4, num_pages=4))
    RUNTIME.admit("c1", {"kv_policy": {"name": "h2o", "budget": 8}}, prompt_len=4)
    RUNTIME.admit("c2", {"kv_policy": {"name": "streaming", "budget": 8}}, prompt_len=4)
    try:
        reqs = [SimpleNamespace(rid=r) for r in ["f1", "c1", "f2", "c2", "f3"]]
        # SGLang's order (keep first .. retract first): 4 3 2 1 0.
        order = retract_uncompressed_first(lambda reqs, args: [4, 3, 2, 1, 0], reqs, None)
        # SGLang pops from the end: f1, then f2, then f3; c2 and c1 last, in SGLang's order.
        assert order == [3, 1, 4, 2, 0]
    finally:
        RUNTIME.requests.clear()
        RUNTIME.region = None
    assert retract_uncompressed_first(lambda reqs, args: [1, 0], [SimpleNamespace(rid="a")] * 2, None) == [1, 0]
