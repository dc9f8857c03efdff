"""The eval grid runs a built-in preset wherever it runs a policy (issue #30
item 7): a preset cell sends {"preset": NAME} plus the cell's budget and
compress_prompt, its base policy decides what an `fX` budget counts, and the
`preset` budget leaves the preset's own. No server: what a request would
send, checked against the server's own parser."""

import math

import pytest

from bench.eval.__main__ import main
from bench.eval.runner import Cell, base_policy, kv_policy_for, plan, preset_of
from bench.eval.tasks import Item
from kvsieve.policies import parse_kv_policy
from kvsieve.service.presets import builtin_presets

FULL = {"usage": {"prompt_tokens": 150, "completion_tokens": 300}}


def item(task: str = "math") -> Item:
    return Item(task=task, id=f"{task}-0", messages=[{"role": "user", "content": "2+2?"}], answer="4", max_tokens=512)


def sent(policy: str, budget: str, task: str = "math", mode: str = "task"):
    kv = kv_policy_for(Cell(task, policy, budget), item(task), FULL, mode)
    return kv, parse_kv_policy(kv, builtin_presets())


def test_a_preset_cell_sends_the_preset_at_the_cells_budget():
    kv, spec = sent("rkv-paper", "f0.4")
    # rkv keeps the prompt in the radix cache: f0.4 counts the output only, as for rkv
    assert kv == {"preset": "rkv-paper", "budget": math.ceil(0.4 * 300)}
    assert kv["budget"] == sent("rkv", "f0.4")[0]["budget"]
    assert spec.name == "rkv" and spec.preset == "rkv-paper" and spec.budget == 120
    assert spec.params["buffer"] == 128 and spec.params["scoring"] == "paper"  # the preset's, not rkv's defaults
    assert sent("rkv", "f0.4")[1].params["scoring"] == "fast"


def test_the_base_policy_decides_what_a_fraction_counts():
    # longflow compresses the prompt: f0.4 counts prompt + output; the
    # preset's own 3200 is replaced by the cell's budget
    kv, spec = sent("longflow-paper", "f0.4")
    assert kv == {"preset": "longflow-paper", "budget": math.ceil(0.4 * 450)} and spec.budget == 180
    assert base_policy("longflow-paper") == "longflow" and base_policy("rkv") == "rkv"


def test_compress_prompt_and_other_budgets_as_for_the_base_policy():
    kv, spec = sent("thinkv-paper", "64", task="needle")
    assert kv == {"preset": "thinkv-paper", "compress_prompt": True, "budget": 64} and spec.prompt_compressed
    kv, spec = sent("crystal_kv-paper", "r0.2", mode="always")
    assert kv == {"preset": "crystal_kv-paper", "compress_prompt": True, "budget_ratio": 0.2}
    assert spec.budget is None and spec.budget_ratio == 0.2 and spec.params["adaptive"] is True
    kv, _ = sent("skipkv-paper", "ref")
    assert kv["budget"] == 150 + 512 + 64


def test_the_preset_budget_keeps_the_presets_own():
    kv, spec = sent("crystalcache-paper-b30", "preset")
    assert kv == {"preset": "crystalcache-paper-b30"}
    assert spec.name == "crystalcache" and spec.budget is None and spec.budget_ratio == 0.3
    assert spec.params["decode"] is False
    with pytest.raises(ValueError, match="not a preset"):
        kv_policy_for(Cell("math", "rkv", "preset"), item(), FULL)
    cells = plan(["math"], ["rkv", "crystalcache-paper-b30"], ["f0.4", "preset"])
    assert [c.key for c in cells] == ["math|full|-", "math|rkv|f0.4", "math|crystalcache-paper-b30|f0.4",
                                      "math|crystalcache-paper-b30|preset"]


def test_every_builtin_is_a_grid_policy():
    for name, value in builtin_presets().items():
        assert preset_of(name) == value and base_policy(name) == value["name"]
    assert preset_of("rkv") is None and preset_of("full") is None and preset_of("nope") is None


def test_the_cli_refuses_unknown_names_and_a_preset_budget_without_a_preset(tmp_path, capsys):
    out = str(tmp_path / "x.json")
    assert main(["run", "--out", out, "--policies", "rkv-paper,nope-paper", "--budgets", "f0.4"]) == 2
    err = capsys.readouterr().err
    assert "unknown policies: nope-paper (" in err and "rkv-paper" in err.split("built-in presets:")[1]
    assert main(["run", "--out", out, "--policies", "rkv", "--budgets", "preset"]) == 2
    assert "name a built-in preset" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def _record(i: int, correct: bool, latency: float, out: int = 100, retained: int = 60, error: bool = False) -> dict:
    if error:
        return {"id": f"m{i}", "kv_policy": {}, "latency_s": 0.1, "status": 400, "error": "budget"}
    return {"id": f"m{i}", "kv_policy": {"budget": 40}, "latency_s": latency, "token_ids": [1, 2], "answer": "4",
            "correct": correct, "usage": {"prompt_tokens": 50, "completion_tokens": out},
            "kv_usage": {"prefix_cache_hit_tokens": 0, "retained_tokens": retained, "evicted_tokens": 10}}


def test_the_report_pairs_each_preset_with_its_default_on_the_same_problems(tmp_path):
    from bench.eval.report import plot_presets, preset_pairs, presets_table
    from bench.eval.summary import summarize

    def cell(task, policy, budget, records, done=True):
        return {"task": task, "policy": policy, "budget": budget, "done": done,
                "records": {r["id"]: r for r in records}}

    cells = {
        "math|full|-": cell("math", "full", "-", [_record(i, i < 2, 10.0, retained=150) for i in range(4)]),
        "math|rkv|f0.4": cell("math", "rkv", "f0.4", [_record(i, i == 0, 10.0) for i in range(4)]),
        # cut short: 3 of 4 problems; the default is compared on those 3
        "math|rkv-paper|f0.4": cell("math", "rkv-paper", "f0.4", [_record(i, i < 2, 20.0) for i in range(3)],
                                    done=False),
        "math|crystalcache|f0.4": cell("math", "crystalcache", "f0.4",
                                       [_record(i, False, 10.0, error=i == 3) for i in range(4)]),
        "math|crystalcache-paper-b30|preset": cell("math", "crystalcache-paper-b30", "preset",
                                                   [_record(i, i == 1, 5.0, retained=140) for i in range(4)]),
    }
    data = {"meta": {"model": "m", "concurrency": 16}, "items": {"math": [{"id": f"m{i}"} for i in range(4)]},
            "cells": cells}
    summary = summarize(data)
    pairs = {(p["policy"], d["budget"]): (p, d) for p, d in preset_pairs(data, summary)}
    assert set(pairs) == {("rkv-paper", "f0.4"), ("crystalcache-paper-b30", "f0.4")}
    p, d = pairs[("rkv-paper", "f0.4")]
    assert p["n_common"] == 3 and (p["correct"], d["correct"], p["full_correct"]) == (2, 1, 2)
    assert p["decode_tok_s"] == 5.0 and d["decode_tok_s"] == 10.0 and p["tpot_ms"] == 200.0
    p, d = pairs[("crystalcache-paper-b30", "f0.4")]
    assert p["n_common"] == 3 and d["errors_left_out"] == 1 and p["kv_fraction"] == 140 / 150
    table = presets_table(data, summary)
    assert "| rkv-paper | `f0.4` | buffer 128, lambda_mix 0.1, scoring \"paper\" | 3 | 2 (2) | 3 |" in table
    assert "budget_ratio 0.3, decode false" in table and "crystalcache `f0.4`: 1" in table
    plot_presets(data, summary, tmp_path / "presets.png")
    assert (tmp_path / "presets.png").stat().st_size > 0


def test_a_slice_of_the_items_runs_alone_and_its_cells_stay_not_done(tmp_path):
    """--item-slice: the file records every item; a cell that ran a slice is
    not done, and the rest of its items run when the whole list is given."""
    from bench.eval.runner import Results, run_grid

    class Server:
        def chat(self, messages, max_tokens, kv_policy):
            return {"choices": [{"message": {"content": "The answer is 4."}, "finish_reason": "stop",
                                 "token_ids": [1, 2, 3]}],
                    "usage": {"prompt_tokens": 10, "completion_tokens": 40},
                    "kv_usage": {"policy": kv_policy.get("name", "rkv")}, "latency_s": 1.0}

    items = {"math": [Item(task="math", id=f"m{i}", messages=[], answer="4", max_tokens=64) for i in range(4)]}
    results = Results(tmp_path / "grid.json", {"model": "m", "tasks_config": {}, "command": "", "concurrency": 2})
    cells = [Cell("math", "full", "-"), Cell("math", "rkv-paper", "f0.5")]
    run_grid(Server(), results, items, cells[:1], concurrency=2)
    counts = run_grid(Server(), results, {"math": items["math"][2:]}, cells, concurrency=2, all_items=items)
    assert counts == {"ran": 2, "skipped": 2, "errors": 0}
    cell = results.data["cells"]["math|rkv-paper|f0.5"]
    assert set(cell["records"]) == {"m2", "m3"} and not cell.get("done")
    assert cell["records"]["m2"]["kv_policy"] == {"preset": "rkv-paper", "budget": 20}
    assert [i["id"] for i in results.data["items"]["math"]] == ["m0", "m1", "m2", "m3"]
    run_grid(Server(), results, items, cells, concurrency=2)
    assert results.data["cells"]["math|rkv-paper|f0.5"]["done"]
