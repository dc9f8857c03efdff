"""Per-cell numbers from a results file: accuracy, KV kept, output length,
and fidelity against two references:
- `ref`: the same policy's compressed path at a budget that evicts nothing,
  run solo (the fidelity reference: it separates eviction from the numerics
  of a second attention implementation);
- `full`: SGLang's own uncompressed path.
Fidelity of one item: greedy tokens until the first divergence (the common
prefix of the two token id lists), whether the outputs are identical, and
whether the final answers agree.
"""

from __future__ import annotations

from statistics import mean, median
from typing import Optional

from .runner import cell_key


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _ok(records: dict) -> dict:
    return {k: r for k, r in records.items() if "error" not in r}


def fidelity(records: dict, reference: dict) -> Optional[dict]:
    """Fidelity of `records` against `reference` over the items both answered."""
    ids = sorted(set(_ok(records)) & set(_ok(reference)))
    if not ids:
        return None
    prefix, identical, agree = [], [], []
    for i in ids:
        a, b = records[i]["token_ids"], reference[i]["token_ids"]
        prefix.append(common_prefix(a, b))
        identical.append(a == b)
        agree.append(records[i].get("answer") == reference[i].get("answer"))
    return {"n": len(ids), "first_divergence": mean(prefix), "identical": mean(identical),
            "answer_agreement": mean(agree)}


def kv_fraction(record: dict, full_record: Optional[dict]) -> Optional[float]:
    """KV held at the end of the request (radix prefix + retained private
    tokens) over the full run's KV of the same item (prompt + output)."""
    if full_record is None or "usage" not in full_record or "kv_usage" not in record:
        return None
    kv = record["kv_usage"]
    held = kv.get("prefix_cache_hit_tokens", 0) + kv.get("retained_tokens", 0)
    full_u = full_record["usage"]
    total = full_u["prompt_tokens"] + full_u["completion_tokens"]
    return held / total if total else None


def speed(records) -> dict:
    """Speed as the client saw it, from each answered request's latency
    (request sent to response read: queueing and prefill included) and
    output tokens: `decode_tok_s` = output tokens / latency summed over the
    requests (one request's stream; the server's aggregate is about this
    times the requests in flight), `tpot_ms` = the median of latency per
    output token."""
    rows = [(r["latency_s"], r["usage"]["completion_tokens"]) for r in records
            if "error" not in r and r["usage"]["completion_tokens"] > 0]
    if not rows:
        return {}
    return {"decode_tok_s": sum(n for _, n in rows) / sum(t for t, _ in rows),
            "tpot_ms": 1000 * median(t / n for t, n in rows)}


def summarize_cell(data: dict, key: str) -> dict:
    cell = data["cells"][key]
    task, policy, budget = cell["task"], cell["policy"], cell["budget"]
    records = cell["records"]
    ok = _ok(records)
    full = data["cells"].get(cell_key(task, "full", "-"), {}).get("records", {})
    out = {"task": task, "policy": policy, "budget": budget, "n": len(records), "errors": len(records) - len(ok),
           "done": bool(cell.get("done"))}
    if records and not ok:
        first = next(iter(records.values()))
        out["error"] = first["error"].get("message") if isinstance(first["error"], dict) else str(first["error"])
    if not ok:
        return out
    out["accuracy"] = mean(r["correct"] for r in ok.values())
    # `full` on the same items: a cell cut short holds the items that ended
    # first (the short generations), so its accuracy compares with this.
    same = [full[i]["correct"] for i in ok if i in full and "error" not in full[i]]
    out["full_accuracy_same_items"] = mean(same) if same else None
    out["completion_tokens"] = mean(r["usage"]["completion_tokens"] for r in ok.values())
    out["prompt_tokens"] = mean(r["usage"]["prompt_tokens"] for r in ok.values())
    out["evicted_tokens"] = mean(r["kv_usage"].get("evicted_tokens", 0) for r in ok.values())
    fracs = [f for f in (kv_fraction(r, full.get(i)) for i, r in ok.items()) if f is not None]
    out["kv_fraction"] = mean(fracs) if fracs else None
    budgets = [r["kv_policy"].get("budget") for r in ok.values() if r["kv_policy"].get("budget") is not None]
    out["budget_tokens"] = mean(budgets) if budgets else None
    out["latency_s"] = mean(r["latency_s"] for r in ok.values())
    out.update(speed(ok.values()))
    # Share of the prompt served from SGLang's radix cache (kept whole,
    # never under the budget): beyond the chat template's shared head, a
    # hit means an earlier request on the same server had the same prompt.
    out["prompt_cached"] = mean(r["kv_usage"].get("prefix_cache_hit_tokens", 0) / max(r["usage"]["prompt_tokens"], 1)
                                for r in ok.values())
    if policy != "full":
        out["vs_full"] = fidelity(records, full)
        if budget != "ref":
            ref = data["cells"].get(cell_key(task, policy, "ref"), {}).get("records", {})
            out["vs_ref"] = fidelity(records, ref)
    return out


def summarize(data: dict) -> list[dict]:
    return [summarize_cell(data, key) for key in data["cells"]]
