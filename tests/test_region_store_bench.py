"""bench/region_store.py on CPU: one step of stores into a 7B-shaped region
(the PyTorch form; the fused kernel's timing needs a GPU), and its report."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))

import region_store as bench  # noqa: E402


def test_the_bench_times_a_step_of_stores_and_writes_its_report(tmp_path):
    calls = bench.step_case(3, "cpu")
    assert len(calls) == bench.LAYERS and calls[0]["table"].shape == (3, bench.HEADS, bench.COLUMNS)
    before = calls[0]["valid"].sum()
    bench.main([str(tmp_path / "store.json"), "--rows", "3,5", "--device", "cpu"])
    report = json.loads((tmp_path / "store.json").read_text())
    assert [(r["form"], r["rows"]) for r in report["results"]] == [("pytorch", 3), ("pytorch", 5)]
    assert all(r["step_ms"] > 0 for r in report["results"])
    assert report["command"].startswith("python bench/region_store.py") and report["date"]
    # The stores took free slots of the case's own region.
    bench.time_form(bench.region_store.store_new_tokens_reference, calls, "cpu", repeats=3)
    assert calls[0]["valid"].sum() > before


def test_a_mixed_batchs_narrow_rows_hold_null_pages_past_their_columns():
    calls = bench.step_case(9, "cpu", wide_columns=36)
    table, columns, null = calls[0]["table"], calls[0]["row_columns"], calls[0]["null_page"]
    assert table.shape == (9, bench.HEADS, 36) and columns.tolist() == [36] + [20] * 7 + [36]
    assert (table[1:8, :, 20:] == null).all() and (table[[0, 8]] < null).all()
    before = calls[0]["valid"].sum()
    bench.time_form(bench.region_store.store_new_tokens_reference, calls, "cpu", repeats=3)
    assert calls[0]["valid"].sum() > before
