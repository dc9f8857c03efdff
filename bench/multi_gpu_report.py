"""Issue #31's results, from the device calls' files into the repo's record:

    python3 bench/multi_gpu_report.py --tp A/tp/gpu-tp.json --smoke-tp1 A/smoke-tp1.json \\
        --smoke-tp2 C/smoke-tp2.json --replicas B/gpu-replicas.json [--replicas B2/...] [--write]

Prints markdown tables for docs/gpu-kernels.md and docs/scale.md: the TP 2
vs TP 1 check per model; the headline's points (tokens/s, TPOT, rows) and the
gate's workloads (tokens/s, errors, peak GPU memory) at TP 2 against TP 1;
the replicas' goodput, TPOT, radix hit rates, scaling and the kill test.
With --write: bench/results/gpu-tp.json becomes the new check, with
`tp_points` (both gpu_smoke runs, whole) and `earlier` (the file it
replaces, whole); bench/results/gpu-replicas.json is the replicas' JSON.
Any input may be left out (its tables are then skipped). See
bench/MULTI_GPU_CALLS.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def load(path: str | None) -> dict | None:
    return json.loads(Path(path).read_text()) if path else None


def fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:,.1f}" if abs(x) >= 10 else f"{x:.3g}"
    return str(x)


def table(head: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    lines += ["| " + " | ".join(fmt(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def tp_check(tp: dict) -> str:
    rows = []
    for name, m in tp["models"].items():
        if "error" in m:
            rows.append([name, False, m["error"][:80], "-", "-", "-"])
            continue
        bad = [label for label, c in m["cases"].items() if not c["ok"]]
        rows.append([name, m["ok"], f"{len(m['cases']) - len(bad)}/{len(m['cases'])}" + (f" (not: {', '.join(bad)})" if bad else ""),
                     f"{m['tp1']['region_idle']}/{m['tp2']['region_idle']}",
                     f"{m['tp1']['evicted_counted_once']}/{m['tp2']['evicted_counted_once']}",
                     f"{m['tp1']['start_s']}/{m['tp2']['start_s']}"])
    head = ["model", "ok", "cases equal (solo and mixed)", "every page back TP1/TP2", "evictions counted once",
            "start s TP1/TP2"]
    return (f"TP check: {', '.join(tp.get('gpus', []))}; {tp.get('date_utc', '')[:16]}; parallel "
            f"{tp.get('parallel', False)}; {tp.get('total_s')} s\n\n" + table(head, rows))


def tp_points(one: dict | None, two: dict | None) -> str:
    runs = [(r["tp"] if "tp" in r else 1, r) for r in (one, two) if r]
    out = []
    head = ["TP", "device", "policy", "rows", "budget", "tokens/s", "TPOT p50 ms", "TPOT p99 ms", "note"]
    rows = []
    for tp, r in runs:
        for h in r.get("headline", []):
            rows.append([tp, r["device"], h["policy"], h["rows"], h["budget"], h.get("tokens_per_s"),
                         h.get("tpot_p50_ms"), h.get("tpot_p99_ms"),
                         h.get("error", "") + (f" ({h.get('tokens_per_s_until_timeout')} tok/s until then)"
                                               if h.get("timed_out") else "")])
    if rows:
        out.append("Headline points (steady window, budget reached by every row):\n\n" + table(head, rows))
    names = []
    for _, r in runs:
        names += [w["name"] for w in r["workloads"] if w["name"] not in names]
    if names:
        by = {tp: {w["name"]: w for w in r["workloads"]} for tp, r in runs}
        tps = [tp for tp, _ in runs]
        head = ["workload"] + [f"TP {tp} tok/s" for tp in tps] + [f"TP {tp} errors" for tp in tps] + \
            [f"TP {tp} peak MiB" for tp in tps]
        rows = [[n] + [by[tp].get(n, {}).get("tokens_per_s") for tp in tps] +
                [by[tp].get(n, {}).get("errors") for tp in tps] +
                [by[tp].get(n, {}).get("peak_gpu_memory_used_mib") for tp in tps] for n in names]
        summary = "; ".join(f"TP {tp}: rows {r['rows'].get('used')}, start {r.get('engine_start_s')} s, ok {r['ok']}, "
                            f"failed {r.get('failed_workloads')}" for tp, r in runs)
        out.append(f"Gate (bench/gpu_smoke.py): {summary}\n\n" + table(head, rows))
    return "\n\n".join(out)


def replicas(rep: dict) -> str:
    head = ["set-up", "start s", "offered", "completed", "unfinished", "errors", "goodput tok/s", "TTFT p99 s",
            "TPOT p50 ms", "TPOT p99 ms", "radix hit rate", "shared", "requests per replica", "GPUs"]
    rows = []
    for name, s in rep["setups"].items():
        load = s.get("load") or {}
        rows.append([name, s.get("start_s"), load.get("offered"), load.get("completed"), load.get("unfinished"),
                     load.get("errors"), load.get("goodput_tok_s"), load.get("ttft_p99_s"), load.get("tpot_p50_ms"),
                     load.get("tpot_p99_ms"), load.get("radix_hit_rate"), load.get("shared_fraction"),
                     ", ".join(str(v) for v in (load.get("requests_per_replica") or {}).values()) or s.get("status"),
                     json.dumps((s.get("placement") or {}).get("replica_gpus"))])
    kill = rep.get("kill") or {}
    lines = [f"Replicas: {rep['device']}; {rep['date'][:16]}; commit {rep.get('commit', '')[:10]}; "
             f"scaling {json.dumps(rep.get('scaling'))}", "", table(head, rows), "",
             f"Kill test ({kill.get('setup')}): {kill.get('streams')} streams, {kill.get('finished')} finished, "
             f"{kill.get('failed')} failed ({kill.get('failed_cleanly')} with replica_failed then [DONE], the last "
             f"{kill.get('failed_stream_end_after_kill_s')} s after the kill); new requests meanwhile "
             f"{kill.get('new_requests_during_outage')}; replica back in {kill.get('recovered_s')} s; ok {kill.get('ok')}"
             + (f"; {kill['error']}" if kill.get("error") else "")]
    return "\n".join(lines)


def merge_replicas(runs: list[dict]) -> dict:
    """One record from gpu_replicas runs on one host (a call's --deadline may
    skip a set-up that a later call then runs): a set-up's first run that
    loaded wins, the kill test likewise; scaling, hit rates and ok are
    recomputed over the merged set-ups."""
    if len(runs) == 1:
        return runs[0]
    merged = json.loads(json.dumps(runs[0]))
    merged["commands"] = [r["command"] for r in runs]
    for later in runs[1:]:
        for name, setup in later["setups"].items():
            if (merged["setups"].get(name) or {}).get("load") is None and setup.get("load") is not None:
                merged["setups"][name] = setup
        if not (merged.get("kill") or {}).get("ok") and later.get("kill") and "error" not in later["kill"]:
            merged["kill"] = later["kill"]
    setups = merged["setups"]
    base = next((s["load"] for s in setups.values() if s.get("replicas") == 1 and s.get("load")), None)
    merged["scaling"] = {}
    for s in setups.values():
        if base and s.get("load") and base.get("goodput_tok_s"):
            merged["scaling"].setdefault(str(s["replicas"]), {})[s["routing"]] = round(
                s["load"]["goodput_tok_s"] / base["goodput_tok_s"], 3)
    merged["radix_hit_rate"] = {name: (s.get("load") or {}).get("radix_hit_rate") for name, s in setups.items()}
    loaded = all(s.get("load") and s["load"].get("errors") == 0 for s in setups.values())
    merged["ok"] = bool(loaded and (merged.get("kill") or {}).get("ok"))
    merged["elapsed_s"] = round(sum(r.get("elapsed_s") or 0 for r in runs), 1)
    return merged


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp")
    ap.add_argument("--smoke-tp1")
    ap.add_argument("--smoke-tp2")
    ap.add_argument("--replicas", action="append", default=[],
                    help="a gpu_replicas JSON; repeat for runs of one host that split the set-ups")
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--results", default=str(REPO / "bench/results"))
    args = ap.parse_args(argv)
    tp, one, two, rep = load(args.tp), load(args.smoke_tp1), load(args.smoke_tp2), None
    if args.replicas:
        rep = merge_replicas([load(path) for path in args.replicas])
    parts = []
    if tp:
        parts.append(tp_check(tp))
    if one or two:
        parts.append(tp_points(one, two))
    if rep:
        parts.append(replicas(rep))
    print("\n\n".join(parts))
    if args.write:
        results = Path(args.results)
        results.mkdir(parents=True, exist_ok=True)
        if tp or one or two:
            path = results / "gpu-tp.json"
            earlier = json.loads(path.read_text()) if path.exists() else None
            record = dict(tp or {})
            record["tp_points"] = {"tp1": one, "tp2": two}
            if earlier is not None:
                record["earlier"] = earlier
            path.write_text(json.dumps(record, indent=1) + "\n")
            print(f"wrote {path}")
        if rep:
            path = results / "gpu-replicas.json"
            path.write_text(json.dumps(rep, indent=1) + "\n")
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
