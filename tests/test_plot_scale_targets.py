"""bench/plot_scale_targets.py: a step profile's runs as multiples of
vanilla's 16K point, each policy's target judged by both methods, and a
profile without its mixed run refused."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench/plot_scale_targets.py"
sys.path.insert(0, str(REPO / "bench"))
import step_profile  # noqa: E402

NAMES = ["streaming", "crystalcache", "rkv"]


def profile(rates: dict) -> dict:
    runs = {name: {"tokens_per_s_unprofiled": w, "tokens_per_s_whole_run": h, "window_full": True, "requests": 6}
            for name, (w, h) in rates.items()}
    return {"device": "GPU X", "config": {"requests": 6, "budget": 1024, "kv_tokens": 786432}, "runs": runs,
            "comparison": step_profile.comparison(runs, NAMES, 6)}


def headline(rate: float) -> dict:
    return {"device": "GPU X", "vanilla": [{"generate": 8192, "tokens_per_s": 2 * rate},
                                           {"generate": 16384, "tokens_per_s": rate}]}


def run(tmp_path, prof: dict, head: dict):
    p, h, out = tmp_path / "p.json", tmp_path / "h.json", tmp_path / "t.png"
    p.write_text(json.dumps(prof))
    h.write_text(json.dumps(head))
    proc = subprocess.run([sys.executable, str(SCRIPT), str(p), str(h), str(out)],
                          capture_output=True, text=True, timeout=300)
    return proc, out


def test_targets_judged_by_both_methods(tmp_path):
    # vanilla 1,000: streaming 5.2x / 4.8x (window only), crystalcache 2.5x both,
    # rkv 2.9x / 3.1x (whole run only), the mix 3.3x / 2.9x.
    rates = {"streaming": (5200, 4800), "crystalcache": (2500, 2600), "rkv": (2900, 3100),
             "mixed:streaming+crystalcache+rkv": (3300, 2900)}
    proc, out = run(tmp_path, profile(rates), headline(1000.0))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 15_000
    lines = {line.split("|")[1].strip(): line for line in proc.stdout.splitlines() if line.startswith("| ")}
    assert "5.20 / 4.80" in lines["streaming"] and lines["streaming"].rstrip().endswith("| window only |")
    assert "2.50 / 2.60" in lines["crystalcache"] and lines["crystalcache"].rstrip().endswith("| yes |")
    assert lines["rkv"].rstrip().endswith("| whole run only |")
    assert "3.30 / 2.90" in lines["mix of 3"] and "| 3x |" in lines["mix of 3"]
    assert "1,000 tok/s" in proc.stdout


def test_a_call_cut_short_shows_what_ran(tmp_path):
    # rkv not run; streaming's batch ended inside its window (one late row): its whole run is judged alone.
    prof = profile({"streaming": (170, 5100), "crystalcache": (2500, 2600),
                    "mixed:streaming+crystalcache+rkv": (3300, 2900)})
    prof["runs"]["streaming"]["window_full"] = False
    proc, out = run(tmp_path, prof, headline(1000.0))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = {line.split("|")[1].strip(): line for line in proc.stdout.splitlines() if line.startswith("| ")}
    assert "| no window | 5,100 | – / 5.10 | 5x | whole run (no window) |" in lines["streaming"]
    assert "| not run | not run |" in lines["rkv"]
    # Against the two measured members (2 rows each of 6): whole run 2,900 / (4 / (2/5100 + 2/2600))
    # = 0.842; 0.9 of all three holds while 2 / rkv's rate >= 0.9 * 6 / 2900 - (2/5100 + 2/2600),
    # i.e. rkv at most 2,854 tok/s. streaming had no steady window: no steady comparison.
    assert "steady: not known (streaming: no steady window)" in proc.stdout
    assert ("whole run: mix / the 2 measured members 0.842; 0.9 of all 3 met unless rkv run above "
            "2,854 tok/s (2.9x vanilla)") in proc.stdout


def test_a_profile_without_its_mix_or_vanilla_point_is_refused(tmp_path):
    rates = {"streaming": (5200, 4800), "crystalcache": (2500, 2600), "rkv": (2900, 3100)}
    proc, out = run(tmp_path, profile(rates), headline(1000.0))
    assert proc.returncode != 0 and "no mixed run" in proc.stderr and not out.exists()
    rates["mixed:streaming+crystalcache+rkv"] = (3300, 2900)
    proc, out = run(tmp_path, profile(rates), {"device": "GPU X", "vanilla": [{"generate": 8192, "tokens_per_s": 1}]})
    assert proc.returncode != 0 and "--generate 16384" in proc.stderr and not out.exists()


def test_a_mix_far_above_its_measured_members_meets_the_target_whatever_the_missing_one_runs_at():
    import plot_scale_targets

    prof = profile({"streaming": (1000, 1000), "crystalcache": (1000, 1000), "mixed:streaming+crystalcache+rkv": (3000, 900)})
    lines = plot_scale_targets.partial_mix(prof, 1000.0)
    # 0.9 * 6 / 3000 = 0.0018 < 2/1000 + 2/1000: met however fast rkv ran. Whole run: room
    # 0.9 * 6 / 900 - 0.004 = 0.002, so rkv's 2 rows at most 1,000 tok/s.
    assert lines == ["steady: mix / the 2 measured members 3.000; 0.9 of all 3 met at any rate of rkv",
                     "whole run: mix / the 2 measured members 0.900; 0.9 of all 3 met unless rkv run above "
                     "1,000 tok/s (1.0x vanilla)"]
