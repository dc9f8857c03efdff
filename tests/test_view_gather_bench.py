"""bench/view_gather.py on CPU: every form reads the same slots as the
engine's `buffer[table]`, and the report names each form's time and bytes."""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))

import view_gather as bench  # noqa: E402


def test_every_form_reads_the_engines_slots():
    buffers = bench.region(60, "cpu")
    table = torch.randperm(60)[:24].view(2, bench.HEADS, 3)
    engine = [b[table] for b in buffers.values()]
    for name, fn in bench.forms(buffers, table).items():
        if name == "fused":
            continue  # the kernel's own test: tests/interpreted/test_slot_view.py
        got = fn()
        assert len(got) == (2 if name == "valid+pos" else 4), name
        for mine, theirs in zip(got, engine):
            assert torch.equal(mine.reshape(theirs.shape).to(theirs.dtype), theirs), name


def test_the_report_names_each_forms_time_and_bytes(tmp_path):
    bench.main([str(tmp_path / "view.json"), "--rows", "4", "--columns", "3", "--layers", "2", "--repeats", "2",
                "--device", "cpu"])
    report = json.loads((tmp_path / "view.json").read_text())
    assert set(report["forms"]) == {"index", "select", "int32", "valid+pos"}
    assert report["slots_per_layer"] == 4 * bench.HEADS * 3 * bench.PAGE
    # valid 1 + position 8 + score 4 + last_hit 4 bytes a slot; int32 positions save 4.
    assert report["forms"]["index"]["bytes_out"] == 17 * report["slots_per_layer"]
    assert report["forms"]["int32"]["bytes_out"] == 13 * report["slots_per_layer"]
    assert all(f["ms_per_layer"] > 0 for f in report["forms"].values())
    assert report["command"].startswith("python bench/view_gather.py") and report["date"]
