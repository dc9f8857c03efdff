"""Headless load-test run against a kvsieve server.

    .venv/bin/python loadtest/run.py --host http://127.0.0.1:8000 --users 20 --run-time 60s --out OUT

Writes to OUT: locust's CSVs (locust_*.csv) and HTML report (report.html),
the request log (requests.jsonl), summary.json and summary.md (by policy:
TTFT, TPOT, throughput, errors; plus the server's KV state after the run),
run.json (machine, date, command) and, with --plot, a PNG over time.

--stages "60s:2,150s:12,150s:2" ramps the users in stages (loadtest/stages_shape.py)
instead of --users for --run-time; users being removed finish the request in
hand (--stop-timeout). --replicas-every S scrapes the engine replica count
(Ray Serve mode) from /metrics every S seconds into replicas.jsonl; the
summary lists its changes and the plot draws it beside the users.

After locust stops (in-flight requests are cut off, as clients going away),
the runner sends one 1-token request (its release republishes the token
pool's counters, see refresh_kv_gauges) and waits up to --drain-timeout
seconds for the server to free every KV page, reading its /metrics. Exit status 1 when any request got a 5xx or
no answer, or KV memory stayed held.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from replica_watch import ReplicaWatch, read_watch, replica_changes  # noqa: E402
from summary import read_log, summarize, to_markdown  # noqa: E402


def machine() -> dict:
    cpu = ""
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem_gib = None
    try:
        kb = next(int(line.split()[1]) for line in open("/proc/meminfo") if line.startswith("MemTotal"))
        mem_gib = round(kb / 2**20, 1)
    except (OSError, StopIteration):
        pass
    return {"host": platform.node(), "os": platform.platform(), "python": platform.python_version(),
            "cpu": cpu, "cores": os.cpu_count(), "memory_gib": mem_gib}


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True,
                              text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def scrape(host: str) -> dict[str, float]:
    """/metrics as {'name{label="v",...}': value} for kvsieve_* and sglang:* gauges we report."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"{host}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


def kv_state(metrics: dict[str, float]) -> dict:
    def total(prefix: str) -> float:
        return sum(v for k, v in metrics.items() if k.startswith(prefix))

    return {
        "region_pages_used": total('kvsieve_region_pages{state="used"'),
        "region_pages_free": total('kvsieve_region_pages{state="free"'),
        "region_reserved_pages": total("kvsieve_region_reserved_pages{"),
        "token_pool_in_use": total('kvsieve_token_pool_tokens{state="in_use"'),
        "kv_tokens_in_use": total("kvsieve_kv_tokens_in_use{"),
        "retained_kv_tokens": total("kvsieve_retained_kv_tokens{"),
        "running_requests": total("sglang:num_running_reqs{"),
    }


def kv_idle(state: dict) -> bool:
    return all(state[k] == 0 for k in ("region_pages_used", "region_reserved_pages", "token_pool_in_use",
                                       "kv_tokens_in_use", "retained_kv_tokens", "running_requests"))


def refresh_kv_gauges(host: str) -> None:
    """One 1-token request. kvsieve publishes the token pool's counters at each
    KV release; after requests are cut off, the last release can come before
    SGLang frees their last slots (in_use stays at 1-2 while SGLang's own
    sglang:num_used_tokens is 0), so the counters are stale until the next
    release. This request's release brings them up to date."""
    body = json.dumps({"prompt": "ok", "max_tokens": 1, "kv_policy": "full"}).encode()
    req = urllib.request.Request(f"{host}/v1/completions", data=body, headers={"content-type": "application/json"})
    try:
        urllib.request.urlopen(req, timeout=120).read()
    except OSError as exc:  # e.g. 401 when the server wants an API key: the wait below still runs
        print(f"refresh request failed: {exc}", file=sys.stderr)


#: Seconds between two refresh requests while the KV is not idle yet.
REFRESH_EVERY_S = 10


def wait_for_idle(host: str, timeout: float) -> tuple[dict, float]:
    start = last_refresh = time.monotonic()
    while True:
        state = kv_state(scrape(host))
        waited = time.monotonic() - start
        if kv_idle(state) or waited > timeout:
            return state, round(waited, 1)
        if time.monotonic() - last_refresh > REFRESH_EVERY_S:
            # The refresh before the wait can itself come before the last
            # cut-off request's slots are freed (CI: token_pool_in_use stayed
            # at 4 for the whole 60 s wait): ask again.
            refresh_kv_gauges(host)
            last_refresh = time.monotonic()
        time.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="headless kvsieve load test (locust)")
    ap.add_argument("--host", required=True, help="kvsieve base URL, e.g. http://127.0.0.1:8000")
    ap.add_argument("--users", type=int, default=20)
    ap.add_argument("--spawn-rate", type=float, default=5)
    ap.add_argument("--run-time", default="60s", help="locust's --run-time (60s, 5m)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--kv-policies", default="", help='policy mix, e.g. "full=2,h2o=1" (default: all)')
    ap.add_argument("--short-tokens", type=int, default=32)
    ap.add_argument("--long-tokens", type=int, default=256)
    ap.add_argument("--burst-size", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--drain-timeout", type=float, default=60.0)
    ap.add_argument("--plot", type=Path, help="also write a PNG of TPOT and throughput by policy over time")
    ap.add_argument("--note", default="", help="free text kept in run.json (server settings, model)")
    ap.add_argument("--stages", default="", help='users in stages, e.g. "60s:2,150s:12,150s:2" (then --users '
                                                 'and --run-time are not used)')
    ap.add_argument("--stop-timeout", type=float, default=120.0,
                    help="with --stages: seconds a user being removed may take to finish its request")
    ap.add_argument("--replicas-every", type=float, default=0.0,
                    help="scrape the engine replica count from /metrics every this many seconds (0: off)")
    args = ap.parse_args(argv)
    if args.stages:
        from stages import parse_stages

        parse_stages(args.stages)  # a bad stage stops the run before it starts

    out: Path = args.out.resolve()  # locust runs in another directory
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "requests.jsonl"
    log_path.unlink(missing_ok=True)
    started = dt.datetime.now(dt.timezone.utc)
    run_info = {
        "date": started.isoformat(timespec="seconds"),
        "command": shlex.join([Path(sys.executable).name, "loadtest/run.py", *(argv if argv is not None else sys.argv[1:])]),
        "git_commit": git_commit(),
        "machine": machine(),
        "note": args.note,
        "server": {"models": json.loads(urllib.request.urlopen(f"{args.host}/v1/models", timeout=10).read())["data"]},
    }
    (out / "run.json").write_text(json.dumps(run_info, indent=2) + "\n")

    env = {**os.environ, "PYTHONPATH": str(HERE)}
    if args.stages:
        from stages import SPAWN_RATE_ENV, STAGES_ENV

        env.update({STAGES_ENV: args.stages, SPAWN_RATE_ENV: str(args.spawn_rate)})
        load = ["-f", f"{HERE / 'locustfile.py'},{HERE / 'stages_shape.py'}", "--stop-timeout", f"{args.stop_timeout:.0f}s"]
    else:
        load = ["-f", str(HERE / "locustfile.py"), "--users", str(args.users), "--spawn-rate", str(args.spawn_rate),
                "--run-time", args.run_time]
    locust = [
        sys.executable, "-m", "locust", *load, "--headless", "--host", args.host,
        "--csv", str(out / "locust"), "--html", str(out / "report.html"),
        "--only-summary", "--loglevel", "WARNING",
        "--kv-policies", args.kv_policies, "--request-log", str(log_path),
        "--short-tokens", str(args.short_tokens), "--long-tokens", str(args.long_tokens),
        "--burst-size", str(args.burst_size), "--seed", str(args.seed),
    ]
    watch_path = out / "replicas.jsonl"
    watch = ReplicaWatch(args.host, watch_path, args.replicas_every).start() if args.replicas_every > 0 else None
    locust_start = time.time()
    # Stopped (SIGTERM), this runner takes locust down with it: a locust left
    # running would go on loading the server for the rest of its stages.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    proc = subprocess.Popen(locust, cwd=HERE, env=env)
    try:
        proc.wait()
        refresh_kv_gauges(args.host)
        state, waited = wait_for_idle(args.host, args.drain_timeout)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=60)
        if watch is not None:
            watch.stop()
    summary = summarize(read_log(log_path))
    summary.update(locust_exit_code=proc.returncode, kv_after_run=state, kv_idle_after_s=waited,
                   kv_idle=kv_idle(state))
    if watch is not None:
        rows = read_watch(watch_path)
        changes = replica_changes(rows, locust_start)
        summary["replicas"] = {"changes_s_from_start": changes, "max": max((c["replicas"] for c in changes), default=None),
                               "scrapes": len(rows), "scrape_errors": sum("error" in r for r in rows)}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "summary.md").write_text(to_markdown(summary))
    if args.plot:
        from plot import plot

        load_text = f"stages {args.stages}" if args.stages else f"{args.users} users, {args.run_time}"
        plot(read_log(log_path), args.plot.resolve(), title=f"kvsieve load test, {load_text}",
             replicas=read_watch(watch_path) if watch is not None else None,
             users=users_over_time(out / "locust_stats_history.csv"))
    print(to_markdown(summary))
    print(f"KV after the run: {json.dumps(state)} (idle after {waited} s)")
    if "replicas" in summary:
        print(f"engine replicas (s from the start: count): {summary['replicas']['changes_s_from_start']}")
    failed = summary["total"].get("failed", 0) or not summary["kv_idle"]
    return 1 if failed else 0


def users_over_time(history_csv: Path) -> list[tuple[float, int]]:
    """(epoch s, users) from locust's stats history CSV (one row a second)."""
    import csv

    if not history_csv.exists():
        return []
    with open(history_csv) as f:
        return [(float(row["Timestamp"]), int(row["User Count"])) for row in csv.DictReader(f)
                if row.get("Name") == "Aggregated"]


if __name__ == "__main__":
    sys.exit(main())
