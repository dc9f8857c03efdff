"""bench/mixed_kernel_parts.py splits committed kernel traces of a mixed
batch and its members into parts; its weighted harmonic mean is the one
step_profile.py computed for the same run, and a mix whose members were not
run alone, or a run without a trace, is refused by name."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import mixed_kernel_parts  # noqa: E402

LOGS = REPO / "bench/results/logs/h200-2026-12-02c"
MEMBERS = LOGS / "call3-members-and-mixed-kernels-2125d55.json"
WITHOUT_FULL = LOGS / "call4-mixed-without-full-kernels-2125d55.json"


def test_kernels_fall_into_their_parts():
    assert mixed_kernel_parts.part("nvjet_sm90_tst_144x128_64x6_2x1_v_bz_TNN") == "gemm"
    assert mixed_kernel_parts.part("_partial_kernel") == "attention"
    assert mixed_kernel_parts.part("_fwd_grouped_kernel_stage1") == "attention"
    assert mixed_kernel_parts.part("void flashinfer::norm::FusedAddRMSNormKernel<8u>") == "model other"
    assert mixed_kernel_parts.part("Memset (Device)") == "copies"
    assert mixed_kernel_parts.part("void at::native::vectorized_gather_kernel<16, long>") == "torch ops"


def test_the_parts_cover_the_trace_and_the_yardstick_is_step_profiles():
    members = json.loads(MEMBERS.read_text())
    result = mixed_kernel_parts.compare(members, members, str(MEMBERS))
    mixed = next(r for label, r in members["runs"].items() if label.startswith("mixed:"))
    listed = sum(k["per_step_ms"] for k in mixed["profile"]["kernels"])
    assert sum(p["mixed_ms"] for p in result["parts"].values()) == pytest.approx(listed, abs=0.01)
    assert result["members_harmonic_mean"] == pytest.approx(
        members["comparison"]["members_harmonic_mean_tokens_per_s"], rel=1e-3)
    assert result["ratio"] == pytest.approx(members["comparison"]["ratio"], abs=1e-3)
    # GPU busy time alone: the same ratio step_profile's comparison gives for the run.
    import step_profile

    names = list(result["rows"])
    busy = step_profile.gpu_busy_comparison(members["runs"], names, step_profile.deal(names, sum(result["rows"].values())))
    assert result["gpu_busy_ratio"] == pytest.approx(busy["ratio"], abs=1e-3)
    assert result["members_gpu_busy_ms_per_step"] == pytest.approx(busy["members_harmonic_mean_ms_per_step"], abs=1e-3)
    # Another mix of the same members is compared with the members' runs.
    other = mixed_kernel_parts.compare(members, json.loads(WITHOUT_FULL.read_text()), str(WITHOUT_FULL))
    assert "full" not in other["rows"] and other["ratio"] > result["ratio"]


def test_the_command_writes_its_table_and_plot(tmp_path):
    out, png = tmp_path / "parts.json", tmp_path / "parts.png"
    proc = subprocess.run([sys.executable, str(REPO / "bench/mixed_kernel_parts.py"), str(MEMBERS), str(MEMBERS),
                           str(WITHOUT_FULL), "--out", str(out), "--plot", str(png)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert [len(r["rows"]) for r in doc["results"]] == [10, 9]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_mix_of_members_not_run_alone_is_refused(tmp_path):
    members = json.loads(WITHOUT_FULL.read_text())  # a mixed-only run: no member ran alone
    with pytest.raises(SystemExit, match="were not run alone"):
        mixed_kernel_parts.compare(members, json.loads(MEMBERS.read_text()), str(MEMBERS))


def test_a_run_without_a_kernel_trace_is_refused():
    members = json.loads(MEMBERS.read_text())
    run = dict(members["runs"]["h2o"], profile={"kernels": [], "steps": 16})
    with pytest.raises(SystemExit, match="no kernel trace"):
        mixed_kernel_parts.parts_of(run)
