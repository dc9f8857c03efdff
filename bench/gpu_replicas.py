"""Ray Serve engine replicas on GPUs (issue #31, item 2), in one device call:

    python3 bench/gpu_replicas.py [--replicas 1,2] [--routings prefix,pow2] [--out FILE]
        [--rate-per-replica 16] [--duration 20] [--rate-timeout 35] [--mix full] [--deadline 540]
    python3 bench/gpu_replicas.py --quick --out /tmp/gpu-replicas-cpu.json     (the same code path on CPU)

What runs. For each set-up, one after the other, a real `kvsieve serve
--replicas N` (python -m kvsieve.service.cli serve, Ray in-process) on this
host: num_gpus_per_replica 1 (KVSIEVE_RAY__NUM_GPUS_PER_REPLICA; the Helm
chart's serve.numGpusPerReplica, recorded from helm/kvsieve/values.yaml), so
Ray places one engine replica on each GPU; one ingress replica per engine
replica; routing `prefix` (service/scale/routing.py: rendezvous hashing of
the prompt's first ray.prefix_tokens tokens) or `pow2` (Serve's power of two
choices, which ignores the prompt: the "random routing" baseline). Set-ups:
N=1 (the first routing), then every N > 1 with every routing; the first N > 1
set-up also runs the kill test, after its load. The engines are bench/traffic.py's kvsieve
engine, passed through serve: the 7B-architecture config with dummy weights
(bench/models/r1-distill-qwen-7b; the script writes a copy beside a
generated word-level tokenizer of the model's vocabulary, which the ingress
loads), KVSIEVE_SGLANG_ARGS = load_format dummy, skip_tokenizer_init,
mem_fraction_static 0.85, stream_interval 8, decode CUDA graphs up to batch
128, no prefill graphs; --kv-tokens of KV split by --pool-share between the
token pool (--max-total-tokens) and the region (KVSIEVE_REGION_PAGES), as
bench/traffic.py splits it.

Load, per set-up: bench/traffic.py's make_trace (seeded Poisson arrivals,
log-uniform generation lengths, prompts whose first --prefix-tokens ids are
one of --prefixes shared "system prompts") at --rate-per-replica x N
requests/s for --duration s, sent at their arrival times as streaming
/v1/completions through the ingress (prompt as token ids, ignore_eos,
return_token_ids, kv_policy from --mix at --budget); at --rate-timeout s the
unsent are dropped and the streaming ones cancelled (the client hangs up, the
ingress aborts them). Figures are bench/traffic.py's summarize() (goodput =
completed requests' tokens / window, TTFT and TPOT p50/p99, errors, cut
requests), plus: radix_hit_rate = sum(cached_tokens) / sum(prompt_tokens)
over requests with a final usage (usage.prompt_tokens_details), the
trace's shared_fraction (its upper bound), and requests per engine replica
(kvsieve_requests_total deltas of /metrics, labelled by replica). The same
trace for every routing at one N. scaling[N][routing] = goodput(N, routing)
/ goodput(1). Placement: after each start, nvidia-smi's memory.used per GPU
and its compute processes mapped to the engine replicas' process trees
(placement_ok: N replicas on N distinct GPUs).

Kill test (the first N > 1 set-up, after its load): --kill-streams streams per
replica of --kill-tokens tokens with distinct prompts; once every stream has
its first chunk, SIGKILL to one engine replica's process (Serve's
`ServeReplica:<app>:EngineReplica` actor; SGLang's scheduler, its child, dies
with it); checks that its streams end with an error event (code
replica_failed) then [DONE], that the others finish, that new requests are
served meanwhile, and that Serve brings the replica back (a new process,
kvsieve_engine_replicas back at N, a request served); records the seconds
each took.

Results (--out, written after every set-up): device, GPUs, date, command,
commit, config, per set-up figures, scaling, radix hit rates, kill test, ok.
Each set-up's `kvsieve serve` log goes beside the JSON (FILE.<setup>.log).
--deadline (s from the start; 540 on GPU, so that the call ends inside its 10
minutes) skips set-ups that would not fit, recorded as skipped; set-ups run
in the order above, so the baseline comes first. Exit status 0 when every
set-up ran without errors and the kill test passed, 1 otherwise.

--quick: device cpu, the embedded default model (SmolLM2-135M), N=2 with
prefix routing only, 2 CPU replicas (num_gpus_per_replica 0, one CPU each),
about 12 short requests over 16 prefixes (with 2 prefixes both hashed to one
replica half the time, and the load then reached the other only by
spilling), then the kill test: the same functions end to end
(tests/test_gpu_replicas.py runs it: 4.8 and 6 minutes on this 2-core machine
while other work loaded it, most of it the two engine starts and the
replacement).
Set-up on the GPU host: bench/gpu_setup.sh (Ray from .raywhl, see
bench/MULTI_GPU_CALLS.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
from gpu_headline import STREAM_INTERVAL  # noqa: E402
from gpu_smoke import HEADLINE_KV_TOKENS, commit_of, memory_split, model_shape, policy_specs  # noqa: E402
from traffic import make_trace, parse_mix, summarize, trace_summary  # noqa: E402

APP = "kvsieve"  # settings.ray.app_name's default
MAX_MESSAGES = 5
STALE_AFTER_S = 10.0  # service/scale/hub.py: a killed replica's last metrics push ages out after this


# ----- options -----

def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="kvsieve serve --replicas N on GPUs: goodput, routing, a replica "
                                             "killed (see the docstring).")
    ap.add_argument("--out", default=str(REPO / "bench/results/gpu-replicas.json"))
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default cuda (cpu with --quick)")
    ap.add_argument("--model", default=None, help="config dir of the model (dummy weights on cuda); default "
                                                  "bench/models/r1-distill-qwen-7b; with --quick the embedded model")
    ap.add_argument("--replicas", default=None, help="engine replica counts (default 1,2; 2 with --quick)")
    ap.add_argument("--routings", default=None, help="routings at N > 1 (default prefix,pow2; prefix with --quick)")
    ap.add_argument("--no-kill", action="store_true", help="skip the kill test")
    ap.add_argument("--rate-per-replica", type=float, default=None, help="requests/s per engine replica (default 16)")
    ap.add_argument("--duration", type=float, default=None, help="seconds of arrivals (default 20)")
    ap.add_argument("--rate-timeout", type=float, default=None, help="seconds after the first arrival when what is "
                                                                      "left is cut (default 35)")
    ap.add_argument("--gen-min", type=int, default=None, help="default 128")
    ap.add_argument("--gen-max", type=int, default=None, help="default 1024")
    ap.add_argument("--prompt-min", type=int, default=None, help="default 512")
    ap.add_argument("--prompt-max", type=int, default=None, help="default 1024")
    ap.add_argument("--prefixes", type=int, default=None, help="shared prefixes (default 128)")
    ap.add_argument("--prefix-tokens", type=int, default=None, help="length of each shared prefix (default 448)")
    ap.add_argument("--private-min", type=int, default=None, help="default 16")
    ap.add_argument("--routing-tokens", type=int, default=None,
                    help="ray.prefix_tokens: leading tokens the prefix router hashes (default min(32, --prefix-tokens))")
    ap.add_argument("--mix", default="full", help="policy mix, name[:weight],... (default full: the compressed "
                                                  "path's steps are ~10x slower on a GPU, bench/results/traffic.json)")
    ap.add_argument("--budget", type=int, default=None, help="kv_policy.budget of compressing policies (default 256)")
    ap.add_argument("--kv-tokens", type=int, default=None, help=f"KV memory per replica in tokens (default "
                                                                f"{HEADLINE_KV_TOKENS}; cuda)")
    ap.add_argument("--pool-share", type=float, default=0.6, help="of --kv-tokens to the token pool (cuda)")
    ap.add_argument("--max-total-tokens", type=int, default=None, help="token pool per replica (default: from "
                                                                       "the split on cuda, 16384 on cpu)")
    ap.add_argument("--max-running", type=int, default=None, help="max_running_requests per replica (default 256)")
    ap.add_argument("--mem-fraction-static", type=float, default=0.85)
    ap.add_argument("--cuda-graph-max-bs", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--warmup-tokens", type=int, default=None, help="default 16 (4 with --quick)")
    ap.add_argument("--kill-streams", type=int, default=None, help="kill-test streams per replica (default 8)")
    ap.add_argument("--kill-tokens", type=int, default=None, help="tokens of each kill-test stream (default 1024)")
    ap.add_argument("--start-timeout", type=float, default=None, help="default 420 (600 on cpu)")
    ap.add_argument("--recovery-timeout", type=float, default=None, help="default 240 (600 on cpu)")
    ap.add_argument("--deadline", type=float, default=None, help="seconds from start after which no set-up "
                                                                  "starts and loads are cut (default 540; 0: none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--commit", default=None)
    ap.add_argument("--quick", action="store_true", help="CPU logic check (see the docstring); explicit options win")
    args = ap.parse_args(argv)
    q = args.quick
    defaults = {  # (GPU, --quick)
        "device": ("cuda", "cpu"), "replicas": ("1,2", "2"), "routings": ("prefix,pow2", "prefix"),
        "rate_per_replica": (16.0, 2.0), "duration": (20.0, 3.0), "rate_timeout": (35.0, 150.0),
        "gen_min": (128, 8), "gen_max": (1024, 16), "prompt_min": (512, 40), "prompt_max": (1024, 56),
        "prefixes": (128, 16), "prefix_tokens": (448, 32), "private_min": (16, 4), "budget": (256, 12),
        "kv_tokens": (HEADLINE_KV_TOKENS, None), "max_running": (256, 16), "warmup_tokens": (16, 4),
        "kill_streams": (8, 3), "kill_tokens": (1024, 400), "start_timeout": (420.0, 600.0),
        "recovery_timeout": (240.0, 600.0), "deadline": (540.0, 0.0),
    }
    for key, pair in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, pair[1] if q else pair[0])
    if args.routing_tokens is None:
        args.routing_tokens = max(1, min(32, args.prefix_tokens // 2 if q else args.prefix_tokens))
    args.replicas = sorted({int(n) for n in str(args.replicas).split(",")})
    args.routings = [r for r in str(args.routings).split(",") if r]
    bad = sorted(set(args.routings) - {"prefix", "pow2"})
    if bad or not args.routings:
        ap.error(f"--routings: unknown {bad}; choose from prefix,pow2")
    if not args.replicas or args.replicas[0] < 1:
        ap.error("--replicas: positive counts")
    args.mix = parse_mix(args.mix)
    return args


def setups_of(args) -> list[dict]:
    """N=1 first (the baseline), then each N > 1 with each routing; the kill
    test on the first N > 1 set-up, after its load (so that a tight
    --deadline drops the last routing's load rather than the kill test)."""
    out = []
    for n in args.replicas:
        for routing in (args.routings[:1] if n == 1 else args.routings):
            out.append({"name": f"n{n}-{routing}", "replicas": n, "routing": routing, "kill": False})
    multi = [s for s in out if s["replicas"] > 1]
    if multi and not args.no_kill:
        multi[0]["kill"] = True
    return out


# ----- the model -----

def prepare_model(args) -> tuple[str | None, Path, dict]:
    """(--model for serve or None for the embedded one, the config dir, its shape).
    On cuda a copy of the config dir with a word-level tokenizer of the
    model's vocabulary (ids 't0'...): the ingress tokenizes with
    AutoTokenizer, the engine skips its tokenizer (prompts are token ids)."""
    if args.model is None and args.device == "cpu":
        from kvsieve.service.default_model import ensure_default_model

        path = Path(ensure_default_model())
        return None, path, model_shape(path)
    src = Path(args.model or REPO / "bench/models/r1-distill-qwen-7b").resolve()
    shape = model_shape(src)
    if args.device == "cpu" or any(src.glob("tokenizer*.json")):
        return str(src), src, shape
    dst = Path(tempfile.gettempdir()) / f"kvsieve-replicas-model-{src.name}"
    if not (dst / "tokenizer.json").exists():
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        dst.mkdir(parents=True, exist_ok=True)
        config = json.loads((src / "config.json").read_text())
        vocab = {f"t{i}": i for i in range(config["vocab_size"])}
        tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        special = {k: f"t{config[k + '_id']}" for k in ("bos_token", "eos_token") if isinstance(config.get(k + "_id"), int)}
        PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", pad_token=special.get("eos_token", "t0"),
                                **special).save_pretrained(dst)
        (dst / "config.json").write_text(json.dumps(config, indent=1))
    return str(dst), dst, shape


# ----- GPUs -----

def gpu_memory() -> list[dict]:
    """Per GPU: index, uuid, memory.used (MiB); [] without nvidia-smi."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid,memory.used,memory.total",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=20)
        rows = [[c.strip() for c in line.split(",")] for line in out.stdout.strip().splitlines() if line.strip()]
        return [{"index": int(r[0]), "uuid": r[1], "used_mib": int(r[2]), "total_mib": int(r[3])} for r in rows]
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return []


def gpu_processes() -> dict[int, str]:
    """pid -> GPU uuid of the compute processes nvidia-smi lists."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return {int(p.strip()): u.strip() for p, u in (line.split(",", 1) for line in out.stdout.strip().splitlines()
                                                       if "," in line)}
    except (OSError, subprocess.SubprocessError, ValueError):
        return {}


def wait_gpus_free(limit_mib: int = 4096, timeout: float = 120) -> dict:
    """Before a start: the previous set-up's engines have let go of their memory."""
    started = time.monotonic()
    mem = gpu_memory()
    while mem and any(g["used_mib"] > limit_mib for g in mem) and time.monotonic() - started < timeout:
        time.sleep(2)
        mem = gpu_memory()
    return {"waited_s": round(time.monotonic() - started, 1), "used_mib": [g["used_mib"] for g in mem],
            "free": all(g["used_mib"] <= limit_mib for g in mem)}


def placement(root_pid: int, n: int) -> dict:
    """Which GPU each engine replica's processes use (nvidia-smi's compute
    processes in each replica's process tree), and memory.used per GPU."""
    import psutil

    by_pid = gpu_processes()
    mem = gpu_memory()
    index_of = {g["uuid"]: g["index"] for g in mem}
    replicas = {}
    for proc in engine_replica_procs(root_pid):
        try:
            tree = [proc, *proc.children(recursive=True)]
        except psutil.Error:
            continue
        gpus = sorted({index_of.get(by_pid[p.pid], by_pid[p.pid]) for p in tree if p.pid in by_pid}, key=str)
        replicas[str(proc.pid)] = gpus
    loaded = [g["index"] for g in mem if g["used_mib"] > 8192]
    distinct = {g for gpus in replicas.values() for g in gpus}
    one_each = len(replicas) == n and all(len(g) == 1 for g in replicas.values()) and len(distinct) == n
    return {"replica_gpus": replicas, "gpu_used_mib": {g["index"]: g["used_mib"] for g in mem},
            "gpus_loaded": loaded, "compute_processes_seen": bool(by_pid),
            # nvidia-smi may not list processes inside a VM: then the loaded GPUs count.
            "placement_ok": one_each if by_pid else len(loaded) == n}


# ----- the server -----

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_replica_procs(root_pid: int) -> list:
    import psutil

    found = []
    try:
        children = psutil.Process(root_pid).children(recursive=True)
    except psutil.Error:
        return found
    for proc in children:
        try:
            if f"ServeReplica:{APP}:EngineReplica" in " ".join(proc.cmdline()) and \
                    proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except psutil.Error:
            pass
    return found


def metric_samples(text: str, name: str) -> list:
    from prometheus_client.parser import text_string_to_metric_families

    return [s for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name]


class Serve:
    """One `kvsieve serve --replicas N` process with its own Ray."""

    def __init__(self, args, setup: dict, model: str | None, shape: dict, log_path: Path, store: Path):
        self.args, self.setup, self.log_path = args, setup, log_path
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        n = setup["replicas"]
        cmd = [sys.executable, "-m", "kvsieve.service.cli", "serve", "--replicas", str(n), "--host", "127.0.0.1",
               "--port", str(self.port), "--device", args.device, "--log-level", "warning",
               "--max-total-tokens", str(args.max_total_tokens), "--max-running-requests", str(args.max_running)]
        if model:
            cmd += ["--model", model]
        env = {k: v for k, v in os.environ.items() if k != "KVSIEVE_CONFIG" and not k.startswith("KVSIEVE_RAY__")}
        env.update({
            "PYTHONUNBUFFERED": "1",
            "KVSIEVE_RAY__ROUTING": setup["routing"],
            "KVSIEVE_RAY__PREFIX_TOKENS": str(args.routing_tokens),
            "KVSIEVE_RAY__NUM_GPUS_PER_REPLICA": "1" if args.device == "cuda" else "0",
            "KVSIEVE_RAY__NUM_CPUS_PER_REPLICA": "1",
            "KVSIEVE_RAY__INGRESS_REPLICAS": str(n if args.device == "cuda" else 1),
            "KVSIEVE_RAY__MAX_ONGOING_REQUESTS": str(2 * args.max_running),
            "KVSIEVE_RAY__GRACEFUL_SHUTDOWN_TIMEOUT_S": "5",
            "KVSIEVE_RAY__HEALTH_CHECK_PERIOD_S": "2",
            "KVSIEVE_LIMITS__MAX_TOKENS": str(max(args.gen_max, args.kill_tokens, args.warmup_tokens)),
            "KVSIEVE_LIMITS__REQUEST_TIMEOUT_S": "1800",
            "KVSIEVE_STORE__URL": f"file://{store}",
        })
        env.pop("RAY_ADDRESS", None)
        if args.device == "cuda":
            env["KVSIEVE_SGLANG_ARGS"] = json.dumps(args.sglang_args)
            env.update(args.region_env)
        # Not the repo root: Ray puts the driver's directory first on its workers'
        # sys.path, so from there they would import the checkout rather than the
        # wheel installed on the device (kvsieve/__init__.py makes that work too,
        # but the run should measure what it installed).
        self.command = shlex.join(cmd)
        self.env_shown = {k: v for k, v in env.items() if k.startswith(("KVSIEVE_", "NCCL_", "CUDA_VISIBLE"))}
        self.started = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True, cwd=str(store.parent))

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def metrics(self) -> str:
        import httpx

        return httpx.get(f"{self.url}/metrics", timeout=30).text

    def replicas_reporting(self) -> float:
        samples = metric_samples(self.metrics(), "kvsieve_engine_replicas")
        return samples[0].value if samples else 0

    def wait_ready(self, n: int, timeout: float, not_before: float = 0.0, exclude: tuple = ()) -> float:
        """Seconds until n engine replicas are initialised (their process title
        no longer names the init call) and report metrics; `not_before`: a
        killed replica's last push has aged out of the hub."""
        import httpx
        import psutil

        started = time.monotonic()
        while time.monotonic() - started < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvsieve serve exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                ready = []
                for p in engine_replica_procs(self.proc.pid):
                    try:
                        if p.pid not in exclude and "initialize" not in " ".join(p.cmdline()):
                            ready.append(p)
                    except psutil.Error:
                        pass
                if len(ready) == n and time.monotonic() >= not_before and \
                        httpx.get(f"{self.url}/v1/models", timeout=10).status_code == 200 and \
                        self.replicas_reporting() == n:
                    return round(time.monotonic() - started, 1)
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(1)
        raise TimeoutError(f"{n} engine replicas not up in {timeout:.0f} s:\n{self.log_tail()}")

    def load_counters(self) -> dict:
        """From one read of /metrics: requests per engine replica, and the sum
        and count of the replicas' own TTFT histogram (time from a request's
        arrival at its engine replica), which beside the client's TTFT splits
        the engines from the front end (proxy, ingress, router)."""
        text = self.metrics()
        per_replica: dict[str, float] = {}
        for s in metric_samples(text, "kvsieve_requests_total"):
            if "replica" in s.labels:
                per_replica[s.labels["replica"]] = per_replica.get(s.labels["replica"], 0.0) + s.value
        return {"per_replica": per_replica,
                "ttft_sum": sum(s.value for s in metric_samples(text, "kvsieve_time_to_first_token_seconds_sum")),
                "ttft_count": sum(s.value for s in metric_samples(text, "kvsieve_time_to_first_token_seconds_count"))}

    def stop(self) -> dict:
        started = time.monotonic()
        code = None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                code = self.proc.wait(timeout=150)
            except subprocess.TimeoutExpired:
                pass
        else:
            code = self.proc.returncode
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever of its Ray processes is left
        except ProcessLookupError:
            pass
        self.proc.wait()
        return {"stop_s": round(time.monotonic() - started, 1), "exit_code": code}


# ----- load -----

def new_record(req: dict) -> dict:
    return {"id": req["id"], "policy": req["policy"], "gen": req["gen"], "shared": req.get("shared", 0),
            "prompt_tokens": len(req["prompt"]), "sent": None, "end": None, "chunks": [], "tokens": 0,
            "error": None, "aborted": None, "queue_time": None, "retractions": 0, "went_back": False,
            "usage": None, "api_usage": None, "finish": None, "done": False, "status": None}


def error_text(err) -> str:
    if isinstance(err, dict):
        return f"{err.get('code') or err.get('type')}: {err.get('message')}"[:300]
    return str(err)[:300]


async def stream_one(client, url: str, body: dict, rec: dict, t0: float) -> None:
    """One streaming completion into rec (times in s from t0)."""
    from kvsieve.service.sse_client import asse_lines

    rec["sent"] = time.perf_counter() - t0
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            rec["status"] = r.status_code
            if r.status_code != 200:
                rec["error"] = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}"
            else:
                async for line in asse_lines(r):
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        rec["done"] = True
                        break
                    event = json.loads(line[6:])
                    if "error" in event:
                        rec["error"] = error_text(event["error"])
                        rec["error_code"] = event["error"].get("code") if isinstance(event["error"], dict) else None
                        rec["error_at"] = time.perf_counter() - t0
                        continue
                    choice = event["choices"][0]
                    rec["tokens"] += len(choice.get("token_ids") or [])
                    rec["chunks"].append((time.perf_counter() - t0, rec["tokens"]))
                    if event.get("usage"):
                        rec["api_usage"] = event["usage"]
                        rec["usage"] = event.get("kv_usage")
                    if choice.get("finish_reason"):
                        rec["finish"] = choice["finish_reason"]
        if rec["error"] is None and rec["finish"] is None:
            rec["error"] = "the stream ended without a finish reason"
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - a failed request is a result
        rec["error"] = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        rec["end"] = time.perf_counter() - t0


def request_body(req: dict, specs: dict, args, max_tokens: int | None = None) -> dict:
    return {"prompt": req["prompt"], "max_tokens": max_tokens or req["gen"], "temperature": args.temperature,
            "ignore_eos": True, "stream": True, "return_token_ids": True,
            "kv_policy": specs[req["policy"]]["kv_policy"]}


async def replay(url: str, requests: list[dict], specs: dict, args, timeout: float) -> tuple[list[dict], float | None]:
    """Each request at its arrival time; past `timeout` the unsent are dropped
    and the streaming ones cancelled. Returns the records and the cut-off."""
    import httpx

    records = [new_record(r) for r in requests]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800, connect=30), limits=limits) as client:
        t0 = time.perf_counter()

        async def send(req, rec):
            delay = t0 + req["arrival"] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            await stream_one(client, url, request_body(req, specs, args), rec, t0)

        tasks = [asyncio.create_task(send(r, rec)) for r, rec in zip(requests, records)]
        cut = None
        _, pending = await asyncio.wait(tasks, timeout=timeout) if tasks else (set(), set())
        if pending:
            cut = time.perf_counter() - t0
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        for rec in records:  # cancelled ones: unfinished (summarize classifies by end vs cut)
            if rec["sent"] is not None and cut is not None and rec["end"] is not None and rec["end"] >= cut:
                rec["end"] = None
    return records, cut


def radix_figures(records: list[dict], cut: float | None) -> dict:
    done = [r for r in records if r["api_usage"] and r["error"] is None]
    prompt = sum(r["api_usage"]["prompt_tokens"] for r in done)
    cached = sum((r["api_usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) for r in done)
    shared = sum(r["shared"] for r in done)
    return {"radix_hit_rate": round(cached / prompt, 4) if prompt else None, "cached_tokens": cached,
            "prompt_tokens": prompt, "shared_fraction": round(shared / prompt, 4) if prompt else None,
            "requests_with_usage": len(done)}


def mean_client_ttft(records: list[dict]) -> float | None:
    ttft = [r["chunks"][0][0] - r["sent"] for r in records if r["chunks"] and r["sent"] is not None]
    return round(sum(ttft) / len(ttft), 3) if ttft else None


def run_load(svc: Serve, args, trace: list[dict], specs: dict, timeout: float) -> dict:
    time.sleep(3)  # the warm-up's requests reach the hub first (replicas push every 2 s)
    before = svc.load_counters()
    started = time.monotonic()
    records, cut = asyncio.run(replay(svc.url, trace, specs, args, timeout))
    wall = time.monotonic() - started
    figures = summarize(records, cut, args.duration, 1.0, with_usage=True)
    time.sleep(3)  # one metrics push (2 s) and some
    after = svc.load_counters()
    a, b = after["per_replica"], before["per_replica"]
    per_replica = {k: int(a.get(k, 0) - b.get(k, 0)) for k in sorted(set(a) | set(b))}
    served = after["ttft_count"] - before["ttft_count"]
    figures["engine_ttft_mean_s"] = round((after["ttft_sum"] - before["ttft_sum"]) / served, 3) if served else None
    figures["client_ttft_mean_s"] = mean_client_ttft(records)
    figures.update(radix_figures(records, cut))
    figures.update(wall_s=round(wall, 1), timeout_s=round(timeout, 1), requests_per_replica=per_replica,
                   error_messages=sorted({r["error"] for r in records if r["error"]})[:MAX_MESSAGES])
    return figures


def warm_up(svc: Serve, args, specs: dict, vocab: int, n: int) -> dict:
    """Two short requests per replica and policy, random distinct prompts (none
    of the trace's prefixes): first-use compilation stays out of the load."""
    rng = random.Random(f"{args.seed}:warmup")
    lo, hi = min(1000, vocab // 4), min(100000, vocab)
    reqs = [{"id": f"warmup-{i}", "arrival": 0.0, "gen": args.warmup_tokens, "policy": name,
             "prompt": [rng.randrange(lo, hi) for _ in range(args.prompt_min)]}
            for i, name in enumerate([p for p in specs for _ in range(2 * n)])]
    started = time.monotonic()
    records, cut = asyncio.run(replay(svc.url, reqs, specs, args, 300))
    return {"requests": len(reqs), "seconds": round(time.monotonic() - started, 1),
            "errors": sorted({r["error"] for r in records if r["error"]})[:MAX_MESSAGES], "cut_off": cut is not None}


# ----- the kill test -----

def stream_sync(url: str, body: dict, out: dict, t0: float) -> None:
    out.update(new_record({"id": out.get("id", "?"), "policy": "kill", "gen": body["max_tokens"], "prompt": []}))
    asyncio.run(_stream_alone(url, body, out, t0))


async def _stream_alone(url: str, body: dict, out: dict, t0: float) -> None:
    import httpx

    async with httpx.AsyncClient(timeout=httpx.Timeout(1800, connect=30)) as client:
        await stream_one(client, url, body, out, t0)


def kill_test(svc: Serve, args, specs: dict, vocab: int, n: int, time_left) -> dict:
    import httpx
    import psutil

    rng = random.Random(f"{args.seed}:kill")
    lo, hi = min(1000, vocab // 4), min(100000, vocab)
    policy = next(iter(specs))
    count = args.kill_streams * n
    bodies = [{"prompt": [rng.randrange(lo, hi) for _ in range(args.prompt_min)], "max_tokens": args.kill_tokens,
               "temperature": args.temperature, "ignore_eos": True, "stream": True, "return_token_ids": True,
               "kv_policy": specs[policy]["kv_policy"]} for _ in range(count)]
    outs = [{"id": f"kill-{i}"} for i in range(count)]
    t0 = time.perf_counter()
    threads = [threading.Thread(target=stream_sync, args=(svc.url, b, o, t0), daemon=True) for b, o in zip(bodies, outs)]
    for t in threads:
        t.start()
    result: dict = {"streams": count, "tokens_each": args.kill_tokens, "policy": policy}
    # Kill once every stream has its first chunk: a request a replica has not
    # started yet would be routed again (tests/test_scale_ray.py).
    deadline = time.monotonic() + 120
    while not all(o.get("chunks") for o in outs) and not any(o.get("end") is not None for o in outs):
        if time.monotonic() > deadline:
            result["error"] = "not every stream had its first chunk within 120 s"
            break
        time.sleep(0.1)
    victims = engine_replica_procs(svc.proc.pid)
    result["replicas_before"] = len(victims)
    if len(victims) != n or "error" in result:
        result.setdefault("error", f"{len(victims)} engine replica processes, not {n}")
        for t in threads:
            t.join(timeout=max(10.0, min(600.0, time_left() - 30)))
        result["ok"] = False
        return result
    victim = victims[0]
    try:
        orphans = victim.children(recursive=True)
    except psutil.Error:
        orphans = []
    chunks_at_kill = [len(o["chunks"]) for o in outs]
    killed_at = time.monotonic()
    kill_t = time.perf_counter() - t0
    victim.kill()  # SIGKILL: no drain, no goodbye
    result.update(victim_pid=victim.pid, victim_children=[p.pid for p in orphans], chunks_at_kill=chunks_at_kill,
                  ended_before_kill=sum(o["finish"] is not None for o in outs))
    # SGLang's processes die with their parent (PR_SET_PDEATHSIG); any left would hold the GPU.
    _, alive = psutil.wait_procs(orphans, timeout=10)
    result["children_left_after_10_s"] = [p.pid for p in alive]
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    # Meanwhile new requests go to the surviving replicas (once Serve has seen the death: a second or two).
    time.sleep(2)
    served = []
    for i in range(4):
        try:
            r = httpx.post(f"{svc.url}/v1/completions", timeout=120, json={
                "prompt": [rng.randrange(lo, hi) for _ in range(8)], "max_tokens": 4, "ignore_eos": True})
            served.append(r.status_code)
        except httpx.HTTPError as exc:
            served.append(repr(exc)[:100])
    result["new_requests_during_outage"] = served
    for t in threads:
        t.join(timeout=max(10.0, min(900.0, time_left() - 30)))
    result["hung_streams"] = sum(t.is_alive() for t in threads)
    finished = [o for o in outs if o["finish"] == "length" and o["error"] is None and o["done"]]
    failed = [o for o in outs if o["error"] is not None]
    clean = [o for o in failed if o.get("error_code") == "replica_failed" and o["done"]]
    result.update(finished=len(finished), failed=len(failed), failed_cleanly=len(clean),
                  error_messages=sorted({o["error"] for o in failed})[:MAX_MESSAGES],
                  failed_stream_end_after_kill_s=round(max((o["end"] - kill_t for o in failed), default=0.0), 2),
                  finished_tokens=sorted({o["tokens"] for o in finished}))
    ok = (result["hung_streams"] == 0 and len(finished) + len(failed) == count and finished and failed
          and len(clean) == len(failed) and all(o["tokens"] == args.kill_tokens for o in finished)
          and all(s == 200 for s in served))
    # Serve replaces the replica: a new process, n replicas reporting, a request served.
    try:
        budget = max(10.0, min(args.recovery_timeout, time_left() - 20))
        svc.wait_ready(n, budget, not_before=killed_at + STALE_AFTER_S + 3, exclude=(victim.pid,))
        result["recovered_s"] = round(time.monotonic() - killed_at, 1)
        result["replica_pids_after"] = [p.pid for p in engine_replica_procs(svc.proc.pid)]
        r = httpx.post(f"{svc.url}/v1/completions", timeout=120, json={"prompt": [lo, lo + 1, lo + 2], "max_tokens": 4})
        result["served_after_recovery"] = r.status_code
        result["recovered"] = r.status_code == 200 and victim.pid not in result["replica_pids_after"]
    except (TimeoutError, RuntimeError) as exc:
        result["recovered"] = False
        result["recovery_error"] = str(exc)[:1500]
    result["ok"] = bool(ok and result["recovered"])
    return result


# ----- main -----

def device_info(device: str) -> dict:
    if device != "cuda":
        return {"device": "cpu", "gpus": []}
    probe = ("import json, torch; n = torch.cuda.device_count(); "
             "print(json.dumps([torch.cuda.get_device_name(i) for i in range(n)]))")
    try:
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
        names = json.loads(out.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        names = []
    return {"device": f"{len(names)} x {names[0]}" if names else "cuda (probe failed)", "gpus": names}


def helm_gpu_values() -> dict:
    try:
        import yaml

        values = yaml.safe_load((REPO / "helm/kvsieve/values.yaml").read_text())
        return {"serve.numGpusPerReplica": values["serve"]["numGpusPerReplica"],
                "ray.workers.gpusPerWorker": values["ray"]["workers"]["gpusPerWorker"]}
    except Exception as exc:  # noqa: BLE001
        return {"error": f"{type(exc).__name__}: {exc}"[:200]}


def main(argv: list[str]) -> int:
    t0 = time.monotonic()
    args = parse_args(argv)
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    from kvsieve.policies import policy_names

    unknown = sorted(set(args.mix) - set(policy_names()))
    if unknown:
        raise SystemExit(f"--mix: unknown policies {unknown}; registered: {','.join(policy_names())}")
    model, model_dir, shape = prepare_model(args)
    specs = policy_specs(list(args.mix), args.budget)
    args.region_env = {}
    split = None
    if args.device == "cuda":
        split = memory_split(argparse.Namespace(kv_tokens=args.kv_tokens, pool_share=args.pool_share, tbq_share=0.0),
                             shape)
        if args.max_total_tokens is None:
            args.max_total_tokens = split["pool_tokens"]
        args.region_env = {"KVSIEVE_REGION_PAGES": str(split["region_pages"]), "KVSIEVE_REGION_QUANT_PAGES": "0"}
        args.sglang_args = {"load_format": "dummy", "skip_tokenizer_init": True,
                            "mem_fraction_static": args.mem_fraction_static, "stream_interval": STREAM_INTERVAL,
                            "cuda_graph_max_bs_decode": args.cuda_graph_max_bs, "disable_prefill_cuda_graph": True,
                            "random_seed": args.seed}
    elif args.max_total_tokens is None:
        args.max_total_tokens = 16384
    setups = setups_of(args)
    traces = {}
    for n in args.replicas:
        rate = args.rate_per_replica * n
        traces[n] = make_trace([rate], args.duration, seed=args.seed, gen_min=args.gen_min, gen_max=args.gen_max,
                               prompt_min=args.prompt_min, prompt_max=args.prompt_max, prefixes=args.prefixes,
                               prefix_tokens=args.prefix_tokens, private_min=args.private_min, mix=args.mix,
                               vocab=shape["vocab"])[rate]
    info = device_info(args.device)
    store = Path(tempfile.mkdtemp(prefix="kvsieve-replicas-store-")) / "store.json"
    config = {k: v for k, v in vars(args).items() if k not in ("sglang_args", "region_env")}
    results = {
        "kind": "gpu-replicas", **commit_of(args.commit), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        **info, "command": "python3 bench/gpu_replicas.py " + shlex.join(argv), "config": config,
        "model": str(model_dir), "model_shape": shape, "memory_split": split, "policies": specs,
        "engine_args": {"KVSIEVE_SGLANG_ARGS": getattr(args, "sglang_args", None), **args.region_env,
                        "max_total_tokens": args.max_total_tokens, "max_running_requests": args.max_running},
        "helm": helm_gpu_values(), "num_gpus_per_replica": 1 if args.device == "cuda" else 0,
        "routing": {"prefix": "service/scale/routing.py PrefixAffinityRouter (rendezvous hash of the first "
                              f"{args.routing_tokens} prompt tokens, spill past 4 queued)",
                    "pow2": "Ray Serve's default power of two choices on queue length (ignores the prompt)"},
        "traces": {str(n): trace_summary(t, args.duration) for n, t in traces.items()},
        "setups": {}, "kill": None, "ok": False,
    }

    def save() -> None:
        results["elapsed_s"] = round(time.monotonic() - t0, 1)
        tmp = out_path.with_suffix(out_path.suffix + ".tmp")
        tmp.write_text(json.dumps(results, indent=1))
        tmp.replace(out_path)

    def time_left() -> float:
        return args.deadline - (time.monotonic() - t0) if args.deadline else 1e9

    save()
    print(f"gpu_replicas: {info['device']}; set-ups {[s['name'] for s in setups]}; model {model_dir.name}; "
          f"pool {args.max_total_tokens} tokens/replica; traces "
          + ", ".join(f"N={n}: {len(t)} requests" for n, t in traces.items()), flush=True)
    ok = True
    for setup in setups:
        name, n = setup["name"], setup["replicas"]
        entry = results["setups"][name] = {**setup, "status": "starting"}
        need = 120 + (150 if setup["kill"] else 0)
        if time_left() < need:
            entry.update(status="skipped", reason=f"{time_left():.0f} s left of --deadline, {need} s needed")
            print(f"{name}: skipped ({entry['reason']})", flush=True)
            ok = False
            save()
            continue
        if args.device == "cuda":
            entry["gpus_before"] = wait_gpus_free()
        log_path = out_path.with_suffix(f".{name}.log")
        svc = Serve(args, setup, model, shape, log_path, store)
        entry.update(command=svc.command, env=svc.env_shown, log=log_path.name)
        try:
            entry["start_s"] = svc.wait_ready(n, min(args.start_timeout, max(30.0, time_left() - 60)))
            if args.device == "cuda":
                entry["placement"] = placement(svc.proc.pid, n)
            print(f"{name}: {n} replica(s) up in {entry['start_s']} s"
                  + (f"; placement {json.dumps(entry['placement'])}" if "placement" in entry else ""), flush=True)
            entry["warmup"] = warm_up(svc, args, specs, shape["vocab"], n)
            save()
            timeout = min(args.rate_timeout, max(10.0, time_left() - (200 if setup["kill"] else 40)))
            entry["load"] = run_load(svc, args, traces[n], specs, timeout)
            L = entry["load"]
            print(f"{name}: {L['offered']} offered, {L['completed']} done, {L['unfinished']} unfinished, "
                  f"{L['errors']} errors; goodput {L['goodput_tok_s']} tok/s; TTFT p50/p99 {L['ttft_p50_s']}/"
                  f"{L['ttft_p99_s']} s (mean {L['client_ttft_mean_s']} s, at the engines "
                  f"{L['engine_ttft_mean_s']} s); TPOT p50/p99 {L['tpot_p50_ms']}/{L['tpot_p99_ms']} ms; radix hit rate "
                  f"{L['radix_hit_rate']} (shared {L['shared_fraction']}); per replica {L['requests_per_replica']}"
                  + (f"; first error {L['error_messages'][0]}" if L["error_messages"] else ""), flush=True)
            ok &= L["errors"] == 0 and not entry["warmup"]["errors"]
            save()
            if setup["kill"]:
                results["kill"] = {"setup": name, **kill_test(svc, args, specs, shape["vocab"], n, time_left)}
                K = results["kill"]
                print(f"kill test ({name}): {K.get('finished')} finished, {K.get('failed')} failed "
                      f"({K.get('failed_cleanly')} with replica_failed then [DONE]), new requests "
                      f"{K.get('new_requests_during_outage')}, recovered {K.get('recovered')} in "
                      f"{K.get('recovered_s')} s; ok {K['ok']}" + (f"; {K['error']}" if K.get("error") else ""),
                      flush=True)
                ok &= K["ok"]
            entry["status"] = "done"
        except Exception as exc:  # noqa: BLE001 - recorded; the next set-up runs
            entry.update(status="failed", error=f"{type(exc).__name__}: {exc}"[:3000])
            print(f"{name}: FAILED {type(exc).__name__}: {str(exc)[:2000]}", flush=True)
            ok = False
        finally:
            entry.update(svc.stop())
            save()
    base = results["setups"].get(next((s["name"] for s in setups if s["replicas"] == 1), ""), {}).get("load")
    results["scaling"] = {}
    for setup in setups:
        load = results["setups"][setup["name"]].get("load")
        if base and load and base.get("goodput_tok_s"):
            results["scaling"].setdefault(str(setup["replicas"]), {})[setup["routing"]] = round(
                load["goodput_tok_s"] / base["goodput_tok_s"], 3)
    results["radix_hit_rate"] = {s["name"]: (results["setups"][s["name"]].get("load") or {}).get("radix_hit_rate")
                                 for s in setups}
    if results["kill"] is None and any(s["kill"] for s in setups):
        results["kill"] = {"ok": False, "error": "not run (its set-up failed or was skipped)"}
        ok = False
    results["ok"] = bool(ok)
    save()
    print(f"{'OK' if ok else 'FAILED'}: scaling {json.dumps(results['scaling'])}; radix hit rate "
          f"{json.dumps(results['radix_hit_rate'])}; kill ok {(results['kill'] or {}).get('ok')} "
          f"-> {out_path} in {results['elapsed_s']} s", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
