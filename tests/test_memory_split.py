"""The pool/region split: the carve on CUDA and the errors that name the setting."""

from types import SimpleNamespace

import logging

import pytest
import torch

from kvsieve.radix_ext import memory_plan, memory_split
from kvsieve.radix_ext.pages import PAGE_STATE_BYTES, SLOT_STATE_BYTES, PageManager, RegionConfig


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    for name in ("KVSIEVE_REGION_FRACTION", "KVSIEVE_REGION_PAGES", "KVSIEVE_REGION_SHARE",
                 "KVSIEVE_WORKSPACE_SHARE", "KVSIEVE_DECISION_SCRATCH_MB", "KVSIEVE_PLANNED_HEAD_TOKENS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(memory_split, "carved_bytes", None)
    monkeypatch.setattr(memory_split, "workspace", None)


def configurator(backend="kvsieve", device="cuda", rows=None):
    """A KVCacheConfigurator as carve_region reads it: R1-Distill-Qwen-7B's shape (the headline's)."""
    text = SimpleNamespace(hidden_size=3584, intermediate_size=18944)
    model = SimpleNamespace(num_hidden_layers=28, head_dim=128, context_len=131072, hf_text_config=text,
                            get_num_kv_heads=lambda tp: 4 // tp, get_num_attention_heads=lambda tp: 28 // tp)
    return SimpleNamespace(server_args=SimpleNamespace(attention_backend=backend, device=device, tp_size=1,
                                                       max_running_requests=rows),
                           model_config=model, kv_cache_dtype=torch.bfloat16)


def test_the_region_takes_its_fraction_of_what_the_workspace_leaves(monkeypatch):
    monkeypatch.setenv("KVSIEVE_REGION_FRACTION", "0.25")
    budget = 40 * 2**30
    pool_bytes = memory_split.carve_region(lambda c, pre: budget, configurator(rows=640), 0)
    work = memory_split.workspace
    assert work.rows == 640 and work.total > 0
    assert pool_bytes + memory_split.carved_bytes + work.total == budget
    assert memory_split.carved_bytes == int((budget - work.total) * 0.25)
    assert memory_split.region_pages(pool_tokens=8192, num_layers=2, num_kv_heads=2, page_size=16,
                                     bytes_per_page=10) == memory_split.carved_bytes // 10


@pytest.mark.parametrize("backend, device", [("triton", "cuda"), ("kvsieve", "cpu")])
def test_other_backends_and_the_cpu_keep_sglangs_budget(backend, device):
    assert memory_split.carve_region(lambda c, pre: 1000, configurator(backend, device), 0) == 1000
    assert memory_split.carved_bytes is None


@pytest.mark.parametrize("value", ["0", "1", "1.5", "-0.1", "half"])
def test_a_fraction_outside_0_1_fails_naming_the_setting(monkeypatch, value):
    monkeypatch.setenv("KVSIEVE_REGION_FRACTION", value)
    with pytest.raises(ValueError, match="KVSIEVE_REGION_FRACTION"):
        memory_split.carve_region(lambda c, pre: 10**11, configurator(), 0)


def test_a_split_that_cannot_serve_fails_at_start_up_naming_the_setting(monkeypatch):
    monkeypatch.setenv("KVSIEVE_REGION_FRACTION", "0.99")
    memory_split.carve_region(lambda c, pre: 10**11, configurator(), 0)
    with pytest.raises(ValueError, match="KVSIEVE_REGION_FRACTION.*token pool 100 tokens"):
        memory_split.region_pages(pool_tokens=100, num_layers=2, num_kv_heads=2, page_size=16,
                                  bytes_per_page=64, context_len=32768)
    monkeypatch.setenv("KVSIEVE_REGION_PAGES", "3")
    with pytest.raises(ValueError, match="KVSIEVE_REGION_PAGES.*3 pages"):
        memory_split.region_pages(pool_tokens=100, num_layers=2, num_kv_heads=2, page_size=16, bytes_per_page=64)


def test_on_cpu_the_region_is_a_share_of_the_pool(monkeypatch):
    monkeypatch.setenv("KVSIEVE_REGION_SHARE", "0.5")
    assert memory_split.region_pages(pool_tokens=256, num_layers=2, num_kv_heads=2, page_size=16,
                                     bytes_per_page=64) == 32


def test_the_headline_workspace_is_planned_part_by_part():
    # H100, 640 rows, R1-Distill-Qwen-7B, 45.1 GB of KV: every part bounded and named.
    shape = memory_split.model_shape(configurator(rows=640))
    work = memory_plan.plan(shape, 640, int(45.1e9), 0.5)
    assert work.columns == 4096 // 16 + 2
    assert work.page_table == 640 * 28 * 4 * work.columns * 8
    assert work.decision_scratch == 4 * 128 * 2**20  # independent of the rows
    assert work.forward_graph == 640 * (4 * 3584 + 3 * 18944) * 2
    # Each layer's attention and |p*v| (4 bytes each) of 640 rows over 80 columns of 16 slots.
    assert work.deferred_obs == 640 * 28 * 4 * 80 * 16 * 8
    # Prefix tables (slot and mask) 4,096 tokens wide, live and in each of the 8 graph entries.
    assert work.fold_tokens == 4096 and work.prefix_tables == 9 * 640 * 4096 * 9
    # The decode kernel over that width, eager and captured: 28 query heads' fp16
    # logits a token, and a float partial output of 128 per 512 keys.
    assert work.prefix_attention == 2 * 640 * 4096 * 28 * (2 + 1)
    assert 0 < work.total < 3 * 2**30  # 7% of the KV budget
    assert memory_plan.plan(shape, 1280, int(45.1e9), 0.5).decision_scratch == work.decision_scratch


def test_rows_beyond_the_plan_are_lowered_at_start_with_a_reason(monkeypatch, caplog):
    # A workspace share too small for 640 rows: the plan takes fewer, and
    # SGLang's own choice is capped to them with a log line saying why.
    monkeypatch.setenv("KVSIEVE_WORKSPACE_SHARE", "0.03")
    memory_split.carve_region(lambda c, pre: 40 * 2**30, configurator(rows=640), 0)
    rows = memory_split.workspace.rows
    assert 1 <= rows < 640
    assert memory_split.workspace.total <= 0.03 * 40 * 2**30 < memory_plan.plan(
        memory_split.model_shape(configurator()), rows + 1, 40 * 2**30, 0.5).total
    with caplog.at_level(logging.WARNING):
        assert memory_split.cap_running_requests(lambda c, capacity: 640, None, 10**6) == rows
    assert f"max_running_requests lowered from 640 to {rows}" in caplog.text
    assert memory_split.cap_running_requests(lambda c, capacity: 8, None, 10**6) == 8  # fewer: untouched


def test_a_workspace_that_cannot_fit_one_row_fails_naming_the_setting(monkeypatch):
    monkeypatch.setenv("KVSIEVE_WORKSPACE_SHARE", "0.001")
    with pytest.raises(ValueError, match="KVSIEVE_WORKSPACE_SHARE"):
        memory_split.carve_region(lambda c, pre: 40 * 2**30, configurator(rows=640), 0)
    monkeypatch.setenv("KVSIEVE_WORKSPACE_SHARE", "2")
    with pytest.raises(ValueError, match="KVSIEVE_WORKSPACE_SHARE"):
        memory_split.carve_region(lambda c, pre: 40 * 2**30, configurator(rows=640), 0)


def test_the_slot_state_the_region_counts_is_what_the_page_manager_allocates():
    cfg = RegionConfig(num_layers=1, num_kv_heads=1, head_dim=16, num_pages=4, page_size=16)
    pm = PageManager(cfg)
    per_slot = sum(t.element_size() for t in (pm.valid, pm.position, pm.score, pm.last_hit, pm.vnorm,
                                              pm.prefill_attention))
    assert per_slot == SLOT_STATE_BYTES and pm.format.element_size() == PAGE_STATE_BYTES
