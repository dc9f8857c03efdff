"""The accuracy harness (bench/eval) at a tiny size, so that it
cannot rot: two math problems, one needle and two delayed associations on
the tiny Llama, `full` and one compressing policy at one budget plus its
no-eviction reference, through the session's real `kvsieve serve`; then
the resume (nothing is sent again) and the report (tables and PNG plots)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _harness(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bench.eval", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_the_grid_runs_through_the_engine_resumes_and_reports(llama_server, tiny_llama, tmp_path):
    out = tmp_path / "eval-tiny.json"
    run = ["run", "--out", str(out), "--url", llama_server.url, "--model", str(tiny_llama),
           "--tasks", "math,needle,da", "--math", "2", "--math-max-tokens", "24",
           "--needle-lengths", "96", "--needle-depths", "0.5", "--da-distances", "96", "--da-samples", "1",
           "--policies", "full,h2o", "--budgets", "16,ref"]
    first = _harness(*run)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "eval grid" in first.stderr  # the progress bar
    # 5 items (2 math, 1 needle, 2 DA) x (full, h2o@16, h2o@ref)
    assert "15 requests run, 0 already done, 0 answered with an error" in first.stderr

    data = json.loads(out.read_text())
    assert data["meta"]["model"] == "tiny-llama" and data["meta"]["concurrency"] == 1
    assert [i["answer"] for i in data["items"]["math"]] == [str(int(i["answer"])) for i in data["items"]["math"]]
    assert set(data["cells"]) == {f"{t}|{p}" for t in ("math", "needle", "da") for p in ("full|-", "h2o|16", "h2o|ref")}
    for key, cell in data["cells"].items():
        assert cell["done"] and len(cell["records"]) == len(data["items"][cell["task"]])
        for rec in cell["records"].values():
            assert rec["token_ids"] and rec["kv_usage"]["policy"] == cell["policy"]
            assert isinstance(rec["correct"], bool)
    # What each request sent: the needle/DA prompt is compressed for every
    # policy, math follows h2o's default; ref's budget evicts nothing.
    needle_rec = next(iter(data["cells"]["needle|h2o|16"]["records"].values()))
    assert needle_rec["kv_policy"] == {"name": "h2o", "compress_prompt": True, "budget": 16}
    assert needle_rec["kv_usage"]["evicted_tokens"] > 0
    math_rec = next(iter(data["cells"]["math|h2o|16"]["records"].values()))
    assert math_rec["kv_policy"] == {"name": "h2o", "budget": 16}
    for rec in data["cells"]["needle|h2o|ref"]["records"].values():
        assert rec["kv_usage"]["evicted_tokens"] == 0
        assert rec["kv_policy"]["budget"] == rec["usage"]["prompt_tokens"] + 32 + 64

    # Resume: the same command sends nothing.
    again = _harness(*run)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "0 requests run, 15 already done" in again.stderr

    # Several cells in one batch, from an items file built by the first run
    # of it and read back by the next (a host without reasoning-gym).
    items = tmp_path / "items.json"
    batched = tmp_path / "eval-batched.json"
    run_batched = [*run[:2], str(batched), *run[3:], "--concurrency", "4", "--items-file", str(items)]
    third = _harness(*run_batched)
    assert third.returncode == 0, third.stderr[-3000:]
    assert "15 requests run, 0 already done, 0 answered with an error" in third.stderr
    saved = json.loads(items.read_text())
    assert saved["items"] == data["items"]
    data2 = json.loads(batched.read_text())
    assert data2["meta"]["concurrency"] == 4 and "(server on CPU)" in data2["meta"]["machine"]
    assert set(data2["cells"]) == set(data["cells"])
    for key, cell in data2["cells"].items():
        assert cell["done"] and set(cell["records"]) == set(data["cells"][key]["records"])
        assert all("error" not in rec for rec in cell["records"].values())
    items_before = items.read_text()
    other = _harness(*[a if a != "2" else "3" for a in run_batched])  # --math 3: another config
    assert other.returncode == 2 and "another config" in other.stderr, other.stderr[-2000:]
    assert items.read_text() == items_before

    # Report: tables with fidelity against ref and full, and the plots.
    plots = tmp_path / "plots"
    md = tmp_path / "tables.md"
    rep = _harness("report", str(out), "--plots", str(plots), "--markdown", str(md))
    assert rep.returncode == 0, rep.stderr[-3000:]
    text = md.read_text()
    assert "| h2o | `16` |" in text and "vs ref: first divergence" in text
    assert {p.name for p in plots.iterdir()} == {"eval-accuracy-tiny.png", "eval-fidelity-tiny.png"}


def test_bad_budgets_and_policies_are_refused_before_anything_runs(tmp_path, tiny_llama):
    bad = _harness("run", "--out", str(tmp_path / "x.json"), "--model", str(tiny_llama), "--budgets", "f2")
    assert bad.returncode == 2 and "the fraction must be in (0, 1]" in bad.stderr
    bad = _harness("run", "--out", str(tmp_path / "x.json"), "--model", str(tiny_llama), "--policies", "nope")
    assert bad.returncode == 2 and "unknown policies: nope" in bad.stderr
    assert not (tmp_path / "x.json").exists()


def test_a_batched_grid_finishes_full_before_the_cells_that_read_it(tmp_path):
    """With several cells in flight, `f` and `ref` budgets are computed from
    `full`'s records: every `full` request ends before any of them starts.
    The server is a stand-in here (slow `full` answers); the grid's order is
    what is tested."""
    import threading
    import time

    from bench.eval.runner import Cell, Results, run_grid
    from bench.eval.tasks import Item

    class SlowFullServer:
        def __init__(self):
            self.lock = threading.Lock()
            self.full_done = 0
            self.seen_before_full_ended = []

        def chat(self, messages, max_tokens, kv_policy):
            if kv_policy["name"] == "full":
                time.sleep(0.3)
                with self.lock:
                    self.full_done += 1
            else:
                with self.lock:
                    if self.full_done < 3:
                        self.seen_before_full_ended.append(kv_policy)
            return {"choices": [{"message": {"content": "The answer is 4."}, "finish_reason": "stop",
                                 "token_ids": [1, 2, 3]}],
                    "usage": {"prompt_tokens": 10, "completion_tokens": 40},
                    "kv_usage": {"policy": kv_policy["name"]}, "latency_s": 0.0}

    items = {"math": [Item(task="math", id=f"m{i}", messages=[{"role": "user", "content": "2+2?"}], answer="4",
                           max_tokens=64) for i in range(3)]}
    cells = [Cell("math", "full", "-"), Cell("math", "h2o", "f0.5"), Cell("math", "h2o", "ref")]
    server = SlowFullServer()
    results = Results(tmp_path / "grid.json", {"model": "m", "tasks_config": {}, "command": "", "concurrency": 8})
    counts = run_grid(server, results, items, cells, concurrency=8)
    assert counts == {"ran": 9, "skipped": 0, "errors": 0}
    assert server.seen_before_full_ended == []
    budgets = {r["kv_policy"]["budget"] for r in results.data["cells"]["math|h2o|f0.5"]["records"].values()}
    assert budgets == {20}  # half of full's 40 output tokens
    assert all(c["done"] for c in results.data["cells"].values())
