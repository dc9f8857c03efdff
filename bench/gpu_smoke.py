"""The one-call GPU gate: one kvsieve engine, every registered policy, back to back.

One device call on an H100 (under 9 minutes, first graph capture included):

    bash .whl/device-setup.sh && python3 -m pip install -q --no-deps --target /tmp/site2 .gpu/*.whl && PYTHONPATH=/tmp/site2:/tmp/site python3 bench/gpu_smoke.py --out $OUT/gpu-smoke.json --commit SHA

(`.gpu/` holds the project's wheel, `pip wheel --no-deps . -w .gpu/`; the
device's copy of the tree may hold a `.git` of another commit, so pass the
commit the wheel was built from with `--commit` (it wins over `git rev-parse
HEAD`, then KVSIEVE_COMMIT).)

On this machine's CPU, the same logic end to end on tests/tiny_models.py's
Llama (built into /tmp when `--model tiny`), in a minute or two:

    python bench/gpu_smoke.py --quick --out /tmp/gpu-smoke-cpu.json
    # = --device cpu --model tiny --rows 4 --budget 8 --tokens 24 --kv-tokens 16384

What it does. One sglang.Engine with kvsieve's attention backend and the
headline's memory split (bench/gpu_headline.py, R1-Distill-Qwen-7B
architecture with dummy weights from bench/models/r1-distill-qwen-7b):
--kv-tokens tokens of KV (786,432: 45.1 GB of bf16 K and V), POOL_SHARE
(15%: 117,964 tokens) to SGLang's token pool (max_total_tokens) and the rest
to the compressed region (KVSIEVE_REGION_PAGES pages of 16 slots per layer
and KV head); mem_fraction_static 0.85, decode CUDA graphs up to batch 128,
prefill CUDA graphs off, max_running_requests --rows. The row count is the
largest the plan allows: min(--rows, the scheduler's max running requests
as the engine reports it, the rows whose compressed ceilings all fit in the
region at once), all three recorded. Then back to back in that engine:

1. every registered policy (kvsieve.policies.policy_names(): `full` and
   every compressing one) alone at that row count, each request generating
   --tokens (default budget + 96) past a --prompt-token prompt (64 random
   ids, distinct per request and per workload) at --temperature 0.7 with
   ignore_eos, at budget --budget (128: decisions start at once) with the
   policy's defaults otherwise (thinkv's TBQ on, which runs without
   quantized pages unless --tbq-share gives the region some; crystal_kv's
   `</think>` marker). A policy that refuses the budget (crystalcache needs
   at least 132) runs at the smallest budget above it that it accepts,
   recorded in `policies`;
2. a mixed batch: the same row count (at least one row per policy), the
   policies dealt round robin;
3. the first workload again (new prompts): what the others left behind.

`--tp N` (issue #31): the same engine with N tensor-parallel ranks
(tp_size), at the same total KV memory: the token pool holds the same
tokens (each rank its share of the heads) and KVSIEVE_REGION_PAGES, which is
per rank, is the split's region pages / N (bench/gpu_headline.py's --tp does
the same); peak GPU memory is then the largest of the N GPUs. `--headline
streaming,thinkv` adds, in the same engine and before the gate's workloads,
bench/gpu_headline.py's steady-window points (its timed_run): per policy,
--headline-rows requests (default: the gate's rows; at most what the region
holds at the budget) of 64-token prompts decoding --headline-budget (1024) +
2 x --headline-tail (64) tokens, greedy, the window opening once every
request holds the budget; each run cut after --headline-timeout s (120;
then `timed_out` with the tokens generated until then). Recorded under
`headline` (tokens/s, TPOT p50/p99, rows). A built-in preset's name
(`--headline rkv-paper,thinkv-paper`, issue #30) runs the preset's own
kv_policy at its own budget (headline_point). TP 2 against TP 1 on one host,
one device call (see bench/MULTI_GPU_CALLS.md):

    python3 bench/gpu_smoke.py --tp 2 --rows 256 --headline streaming,thinkv --headline-rows 128 --deadline 420 --out $OUT/smoke-tp2.json
    python3 bench/gpu_smoke.py --tp 1 --rows 256 --headline streaming,thinkv --headline-rows 128 --deadline 420 --out $OUT/smoke-tp1.json

Per workload: rows, generated tokens, wall seconds, tokens/s (completed
tokens / wall), errors (requests that raised or ended with an abort finish
reason, and a workload that timed out: count and first messages), requests
that ended short of --tokens, peak GPU memory used (nvidia-smi, polled every
0.25 s during the workload: the scheduler is another process), peak region
pages used and those still used after it (kvsieve_region_pages; any left
is an error), mean evicted tokens and TBQ use per policy from kv_usage, and
whether the engine is still alive after it (a 1-token `full` request). The
radix cache is flushed between workloads. A workload that fails is
recorded and the next one runs; one that outlasts --workload-timeout is
aborted; past --deadline (seconds since start; 450 by default, so that
with ~60 s of device set-up the call ends inside 9 minutes) the rest are
recorded as skipped; if the engine dies (a child sends SIGQUIT), the JSON says so before
the process ends. The JSON (--out) is written before and after every
workload; the exit status is non-zero when any workload had an error, was
skipped or the engine died.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
from gpu_headline import POOL_SHARE  # noqa: E402  (the headline's split: 15% token pool, the rest region)

PAGE = 16  # KVSIEVE_REGION_PAGE_SIZE's default
HEADLINE_KV_TOKENS = 786432  # bench/gpu_headline.py's --kv-tokens default (45.1 GB of bf16 K and V)
TINY_MODEL_DIR = Path("/tmp/kvsieve-smoke-models/tiny-llama")
MAX_MESSAGES = 5  # error messages kept per workload


# ----- options -----

def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="One engine, every registered policy back to back (see the docstring).")
    ap.add_argument("--out", default=str(REPO / "bench/results/gpu-smoke.json"), help="the JSON written")
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default cuda (cpu with --quick)")
    ap.add_argument("--model", default=None,
                    help="checkpoint dir (dummy weights from its config.json); 'tiny' builds tests/tiny_models.py's "
                         "Llama; default bench/models/r1-distill-qwen-7b (tiny with --quick)")
    ap.add_argument("--rows", type=int, default=None, help="requests per workload, at most (default 640; 4 with --quick)")
    ap.add_argument("--budget", type=int, default=None, help="kv_policy.budget (default 128; 8 with --quick)")
    ap.add_argument("--tokens", type=int, default=None, help="generated tokens per request (default budget + 96; "
                                                              "24 with --quick)")
    ap.add_argument("--prompt-tokens", type=int, default=64, help="prompt length (random ids)")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--policies", default=None, help="comma list (default: every registered policy)")
    ap.add_argument("--kv-tokens", type=int, default=None,
                    help=f"KV memory in tokens, split like the headline (default {HEADLINE_KV_TOKENS}; 16384 with --quick)")
    ap.add_argument("--pool-share", type=float, default=POOL_SHARE, help="of --kv-tokens to the token pool")
    ap.add_argument("--tbq-share", type=float, default=0.0,
                    help="of the region's bytes as quantized (TBQ, 4-bit) pages; 0: bf16 pages only, thinkv then "
                         "runs without TBQ (kv_usage tbq false)")
    ap.add_argument("--mem-fraction-static", type=float, default=0.85)
    ap.add_argument("--cuda-graph-max-bs", type=int, default=128, help="cuda_graph_max_bs_decode")
    ap.add_argument("--workload-timeout", type=float, default=None,
                    help="seconds before a workload's requests are aborted (default 90; 300 on cpu)")
    ap.add_argument("--deadline", type=float, default=None,
                    help="seconds from start after which no workload starts (default 450; 0: none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--solo-only", action="store_true",
                    help="each policy alone, no mixed batch and no repeat (a long-generation stress run at a "
                         "real budget, e.g. --policies rkv,thinkv --budget 1024 --tokens 1200)")
    ap.add_argument("--commit", default=None, help="the commit the wheel was built from (wins over `git rev-parse HEAD`)")
    ap.add_argument("--quick", action="store_true",
                    help="small defaults for a CPU logic check: --device cpu --model tiny --rows 4 --budget 8 "
                         "--tokens 24 --kv-tokens 16384 (explicit options win)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (tp_size); the region's pages are "
                                                      "split over them")
    ap.add_argument("--headline", default="", help="comma list of policies or built-in presets (rkv-paper, ...): "
                    "gpu_headline.py's steady-window points in this engine before the gate (e.g. streaming,thinkv)")
    ap.add_argument("--headline-budget", type=int, default=None, help="default 1024 (16 with --quick)")
    ap.add_argument("--headline-tail", type=int, default=None, help="default 64 (8 with --quick)")
    ap.add_argument("--headline-rows", type=int, default=None, help="default: the gate's rows")
    ap.add_argument("--headline-timeout", type=float, default=None, help="per point, s (default 120; 300 on cpu)")
    args = ap.parse_args(argv)
    quick = args.quick
    if args.device is None:
        args.device = "cpu" if quick else "cuda"
    if args.model is None:
        args.model = "tiny" if quick else str(REPO / "bench/models/r1-distill-qwen-7b")
    if args.rows is None:
        args.rows = 4 if quick else 640
    if args.budget is None:
        args.budget = 8 if quick else 128
    if args.tokens is None:
        args.tokens = 24 if quick else args.budget + 96
    if args.kv_tokens is None:
        args.kv_tokens = 16384 if quick else HEADLINE_KV_TOKENS
    if args.workload_timeout is None:
        args.workload_timeout = 300.0 if args.device == "cpu" else 90.0
    if args.deadline is None:
        args.deadline = 450.0
    if args.headline_budget is None:
        args.headline_budget = 16 if quick else 1024
    if args.headline_tail is None:
        args.headline_tail = 8 if quick else 64
    if args.headline_timeout is None:
        args.headline_timeout = 300.0 if args.device == "cpu" else 120.0
    args.headline = [p for p in args.headline.split(",") if p]
    if args.tp < 1:
        ap.error("--tp: at least 1")
    return args


# ----- provenance -----

def commit_of(explicit: str | None) -> dict:
    # An explicit commit wins: the device's copy of the tree may carry a
    # .git of another commit than the wheel that runs.
    if explicit:
        return {"commit": explicit, "commit_source": "--commit"}
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                                   capture_output=True, text=True, timeout=10).stdout.strip()
            return {"commit": out.stdout.strip(), "commit_source": "git", "tracked_changes": bool(dirty)}
    except (OSError, subprocess.SubprocessError):
        pass
    if os.environ.get("KVSIEVE_COMMIT"):
        return {"commit": os.environ["KVSIEVE_COMMIT"], "commit_source": "KVSIEVE_COMMIT"}
    return {"commit": "unknown", "commit_source": None}


def device_name(device: str) -> str:
    """torch.cuda.get_device_name(0), from a child process: this one keeps no CUDA context."""
    if device != "cuda":
        return "cpu"
    probe = "import torch; print(torch.cuda.get_device_name(0))"
    try:
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
        return out.stdout.strip().splitlines()[-1]
    except (OSError, subprocess.SubprocessError, IndexError):
        return "unknown (probe failed)"


# ----- the model, the policies, the memory split -----

def model_dir(arg: str) -> Path:
    if arg != "tiny":
        return Path(arg).resolve()
    sys.path.insert(0, str(REPO / "tests"))
    from tiny_models import build_tiny_model

    return build_tiny_model(TINY_MODEL_DIR, "llama")


def model_shape(path: Path) -> dict:
    cfg = json.loads((path / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    return {"layers": cfg["num_hidden_layers"], "kv_heads": cfg.get("num_key_value_heads", heads),
            "head_dim": head_dim, "vocab": cfg["vocab_size"], "dtype_bytes": 4 if "32" in dtype else 2}


def policy_specs(names: list[str], budget: int) -> dict:
    """Per policy: the kv_policy a user sends with this budget and the
    policy's defaults. A policy that refuses the budget gets the smallest
    larger one it accepts (recorded with the reason)."""
    from kvsieve.policies import KVPolicyError, get_policy, parse_kv_policy

    out = {}
    for name in names:
        cls = get_policy(name)
        if not cls.takes_budget:
            parse_kv_policy({"name": name})
            out[name] = {"kv_policy": {"name": name}, "budget": None}
            continue
        first_problem = None
        for b in range(budget, 8 * budget + 1025):
            try:
                parse_kv_policy({"name": name, "budget": b})
            except KVPolicyError as exc:
                first_problem = first_problem or str(exc)
                continue
            entry = {"kv_policy": {"name": name, "budget": b}, "budget": b}
            if b != budget:
                entry["budget_raised_from"] = budget
                entry["budget_note"] = first_problem
            out[name] = entry
            break
        else:
            out[name] = {"kv_policy": {"name": name, "budget": budget}, "budget": budget,
                         "invalid": first_problem}
    return out


def pages_per_head(name: str, spec: dict, prompt: int, tokens: int) -> int | None:
    """The request's compressed ceiling in pages per (layer, kv head), as
    admission reserves it (radix_ext/runtime.py's CompressedRequest); 0 for
    `full`; None where it cannot be computed here."""
    from kvsieve.policies import get_policy, parse_kv_policy

    try:
        parsed = parse_kv_policy(spec)
        if not parsed.compresses:
            return 0
        cls = get_policy(name)
        policy = cls()
        params = cls.Params.model_validate(parsed.params)
        private_prompt = prompt if parsed.prompt_compressed else 0
        ceiling = policy.max_private_tokens(params, private_prompt, tokens, parsed.budget)
        return -(-max(ceiling, 1) // PAGE)
    except Exception:  # noqa: BLE001 - an estimate only
        return None


def memory_split(args, shape: dict) -> dict:
    pool_tokens = int(args.kv_tokens * args.pool_share)
    region_tokens = args.kv_tokens - pool_tokens
    per_token_slots = shape["layers"] * shape["kv_heads"]
    region_pages = region_tokens * per_token_slots // PAGE
    quant_pages = 0
    if args.tbq_share > 0:
        from kvsieve.radix_ext.tbq_store import QuantPool

        bits = int(os.environ.get("KVSIEVE_TBQ_BITS", "4"))
        full_page = PAGE * shape["head_dim"] * 2 * shape["dtype_bytes"]
        quant_page = QuantPool.bytes_per_page(shape["head_dim"], PAGE, bits)
        region_bytes = region_pages * full_page
        quant_pages = int(region_bytes * args.tbq_share) // quant_page
        region_pages = (region_bytes - quant_pages * quant_page) // full_page
    return {"kv_tokens": args.kv_tokens, "pool_share": args.pool_share, "pool_tokens": pool_tokens,
            "region_tokens_per_layer_head": region_tokens, "region_pages": region_pages, "page_size": PAGE,
            "quantized_pages": quant_pages, "tbq_share": args.tbq_share}


# ----- monitoring -----

def region_gauges() -> dict:
    """kvsieve's region gauges, summed over the engine's processes."""
    try:
        from prometheus_client import CollectorRegistry, multiprocess

        reg = CollectorRegistry()
        multiprocess.MultiProcessCollector(reg)
        out = {"used": 0.0, "free": 0.0, "live": 0.0}
        for metric in reg.collect():
            for s in metric.samples:
                if s.name == "kvsieve_region_pages" and s.labels.get("state") in ("used", "free"):
                    out[s.labels["state"]] += s.value
                elif s.name == "kvsieve_compressed_requests_live":
                    out["live"] += s.value
        return out
    except Exception:  # noqa: BLE001
        return {}


class Monitor(threading.Thread):
    """Polls the GPU's memory.used (nvidia-smi) and the region's used pages
    while a workload runs; keeps the peaks."""

    def __init__(self, gpu: bool, ranks: int = 1):
        super().__init__(daemon=True)
        self.gpu = gpu
        self.stop_event = threading.Event()
        self.peak_mib: int | None = None
        self.peak_region_used: float | None = None
        self.gpu_error: str | None = None
        # The first `ranks` visible GPUs (tensor parallelism): the peak is the largest of them.
        visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip().isdigit()]
        self.index = ",".join(visible[:ranks] if len(visible) >= ranks else map(str, range(ranks)))

    def gpu_used_mib(self) -> int | None:
        try:
            out = subprocess.run(["nvidia-smi", "-i", self.index, "--query-gpu=memory.used",
                                  "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10)
            return max(int(line) for line in out.stdout.strip().splitlines())
        except (OSError, subprocess.SubprocessError, ValueError, IndexError) as exc:
            self.gpu_error = repr(exc)
            return None

    def run(self) -> None:
        last_region = 0.0
        while True:
            if self.gpu:
                used = self.gpu_used_mib()
                if used is not None:
                    self.peak_mib = used if self.peak_mib is None else max(self.peak_mib, used)
            now = time.monotonic()
            if now - last_region >= 1.0:
                last_region = now
                used_pages = region_gauges().get("used")
                if used_pages is not None:
                    self.peak_region_used = used_pages if self.peak_region_used is None else max(
                        self.peak_region_used, used_pages)
            if self.stop_event.wait(0.25):
                return

    def finish(self) -> None:
        self.stop_event.set()
        self.join(timeout=15)


# ----- one workload -----

def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    lo, hi = min(1000, vocab // 4), min(100000, vocab)
    rng = random.Random(seed)
    seen, out = set(), []
    while len(out) < n:
        ids = [rng.randrange(lo, hi) for _ in range(length)]
        if tuple(ids) not in seen:
            seen.add(tuple(ids))
            out.append(ids)
    return out


async def generate_one(engine, ids, params):
    try:
        return await engine.async_generate(input_ids=ids, sampling_params=params)
    except Exception as exc:  # noqa: BLE001 - an aborted or refused request: recorded, not raised
        return exc


def run_workload(engine, plan: list[tuple[str, dict]], args, vocab: int, seed: int, timeout: float) -> dict:
    """plan: (policy name, kv_policy) per row. Generates, classifies the
    outcomes per request, aborts everything past the timeout."""
    batch = prompts(len(plan), args.prompt_tokens, vocab, seed)
    loop = engine.loop
    started = time.perf_counter()
    tasks = [loop.create_task(generate_one(engine, ids, {
        "max_new_tokens": args.tokens, "temperature": args.temperature, "ignore_eos": True,
        "custom_params": {"kv_policy": policy}})) for ids, (_, policy) in zip(batch, plan)]
    done, pending = loop.run_until_complete(asyncio.wait(tasks, timeout=timeout))
    timed_out = len(pending)
    if pending:
        engine.tokenizer_manager.abort_request(abort_all=True)
        _, pending = loop.run_until_complete(asyncio.wait(pending, timeout=30))
        for task in pending:
            task.cancel()
        if pending:
            loop.run_until_complete(asyncio.wait(pending, timeout=5))
    wall = time.perf_counter() - started
    errors, tokens, short = [], 0, 0
    per_policy: dict[str, dict] = {}
    for task, (name, _) in zip(tasks, plan):
        stats = per_policy.setdefault(name, {"rows": 0, "errors": 0, "completion_tokens": 0, "evicted": [],
                                             "tbq": 0, "bits": []})
        stats["rows"] += 1
        out = task.result() if task.done() and not task.cancelled() else RuntimeError("cancelled after the timeout")
        if isinstance(out, BaseException):
            stats["errors"] += 1
            errors.append(f"{name}: {type(out).__name__}: {out}"[:400])
            continue
        meta = out.get("meta_info", {})
        done_tokens = int(meta.get("completion_tokens") or 0)
        tokens += done_tokens
        stats["completion_tokens"] += done_tokens
        reason = meta.get("finish_reason")
        if isinstance(reason, dict) and reason.get("type") == "abort":
            stats["errors"] += 1
            errors.append(f"{name}: abort: {reason.get('message')}"[:400])
            continue
        if done_tokens < args.tokens:
            short += 1
        usage = meta.get("kvsieve_kv_usage")
        usage = usage[-1] if isinstance(usage, list) and usage else usage
        if isinstance(usage, dict):
            stats["evicted"].append(usage.get("evicted_tokens", 0))
            stats["tbq"] += bool(usage.get("tbq"))
            if usage.get("kv_bits_per_element"):
                stats["bits"].append(usage["kv_bits_per_element"])
    summary = {}
    for name, s in per_policy.items():
        entry = {"rows": s["rows"], "errors": s["errors"], "completion_tokens": s["completion_tokens"]}
        if s["evicted"]:
            entry["evicted_tokens_mean"] = round(sum(s["evicted"]) / len(s["evicted"]), 1)
            entry["tbq_requests"] = s["tbq"]
        if s["bits"]:
            entry["kv_bits_per_element_mean"] = round(sum(s["bits"]) / len(s["bits"]), 3)
        summary[name] = entry
    failed_requests = len(errors)
    if timed_out:
        errors.insert(0, f"timeout: {timed_out} of {len(plan)} requests unfinished after {timeout:.0f} s (aborted)")
    return {"wall_s": round(wall, 2), "completion_tokens": tokens, "tokens_per_s": round(tokens / wall, 1) if wall else None,
            "errors": max(failed_requests, 1 if timed_out else 0), "failed_requests": failed_requests,
            "timed_out_requests": timed_out, "error_messages": errors[:MAX_MESSAGES], "short_requests": short,
            "per_policy": summary}


def engine_alive(engine, vocab: int, timeout: float = 60) -> tuple[bool, str | None]:
    """The child processes are up and a 1-token `full` request comes back."""
    try:
        import psutil

        for pid in engine.get_all_child_pids() if hasattr(engine, "get_all_child_pids") else []:
            if not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return False, f"child process {pid} is gone"
    except Exception as exc:  # noqa: BLE001
        return False, f"child check failed: {exc!r}"
    probe = engine.async_generate(input_ids=prompts(1, 4, vocab, seed=int(time.time()))[0], sampling_params={
        "max_new_tokens": 1, "temperature": 0.0, "custom_params": {"kv_policy": {"name": "full"}}})
    try:
        out = engine.loop.run_until_complete(asyncio.wait_for(probe, timeout))
        reason = out.get("meta_info", {}).get("finish_reason")
        if isinstance(reason, dict) and reason.get("type") == "abort":
            return False, f"probe aborted: {reason.get('message')}"
        return True, None
    except Exception as exc:  # noqa: BLE001
        return False, f"probe failed: {type(exc).__name__}: {exc}"


def flush_cache(engine, timeout: float = 10):
    """Empty the radix cache (the next workload's prompts are new anyway);
    SGLang refuses while requests are still being released, so retry."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if bool(getattr(engine.flush_cache(), "success", True)):
                return True
        except Exception as exc:  # noqa: BLE001
            return f"{type(exc).__name__}: {exc}"[:200]
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)


def region_after(timeout: float = 15) -> dict:
    """The region's gauges once the workload's pages are back (waits up to
    `timeout` for `used` to reach 0)."""
    deadline = time.monotonic() + timeout
    gauges = region_gauges()
    while gauges.get("used") and time.monotonic() < deadline:
        time.sleep(0.25)
        gauges = region_gauges()
    return gauges


# ----- the headline's points (--headline) -----

def headline_point(name: str, budget: int, tail: int, split: dict, shape: dict) -> dict:
    """What one --headline name runs: a policy {name, budget} at the headline's
    budget, its rows the region's tokens per (layer, head) over gpu_headline's
    ceiling (budget + a stream interval); a built-in preset (issue #30: rkv-paper,
    ...) its own kv_policy, with the headline's budget only where the preset
    leaves it open, its rows from the ceiling admission reserves for it
    (rkv-paper's 128-token buffer, longflow-paper's 3,200 budget). Each runs
    budget + 2 x tail tokens and opens its window at its budget; a preset with a
    budget_ratio (crystalcache's, prompt-only) at the headline's budget."""
    import gpu_headline as gh
    from kvsieve.service.presets import builtin_presets

    presets = builtin_presets()
    if name not in presets:
        ceiling = -(-(budget + gh.STREAM_INTERVAL + 1) // PAGE) * PAGE
        return {"preset": False, "kv_policy": {"name": name, "budget": budget}, "budget": budget,
                "tokens": budget + 2 * tail, "region_fit_rows": split["region_tokens_per_layer_head"] // ceiling}
    kv_policy = presets[name]
    if "budget" not in kv_policy and "budget_ratio" not in kv_policy:
        kv_policy["budget"] = budget
    own = kv_policy.get("budget", budget)
    tokens = own + 2 * tail
    pages = pages_per_head(kv_policy["name"], kv_policy, gh.SHORT_PROMPT, tokens)
    per_row = shape["layers"] * shape["kv_heads"] * pages if pages else None
    return {"preset": True, "kv_policy": kv_policy, "budget": own, "tokens": tokens,
            "region_fit_rows": split["region_pages"] // per_row if per_row else None}


def headline_points(engine, args, split: dict, shape: dict, engine_rows, gate_rows: int, results: dict, save,
                    t0: float) -> None:
    """bench/gpu_headline.py's kvsieve points (steady window once every request
    holds the budget) for args.headline, in this engine."""
    import gpu_headline as gh

    gh.VOCAB_IDS = (min(1000, shape["vocab"] // 4), min(100000, shape["vocab"]))
    tail = args.headline_tail
    for name in args.headline:
        point = headline_point(name, args.headline_budget, tail, split, shape)
        budget, fit = point["budget"], point["region_fit_rows"]
        rows = min(r for r in (args.headline_rows or gate_rows, fit, engine_rows) if r)
        entry = {"policy": name, "budget": budget, "rows": rows, "region_fit_rows": fit, "tp": args.tp,
                 "generated_tokens": point["tokens"], "temperature": 0.0, "method": "gpu_headline.timed_run"}
        if point["preset"]:
            entry.update(preset=name, kv_policy=point["kv_policy"])
        left = args.deadline - (time.monotonic() - t0) if args.deadline else None
        if left is not None and left < 30:
            entry.update(error=f"skipped: past --deadline {args.deadline:.0f} s")
        else:
            timeout = args.headline_timeout if left is None else max(10.0, min(args.headline_timeout, left - 15))
            try:
                entry.update(gh.timed_run(engine, gh.prompts(rows, gh.SHORT_PROMPT, 7),
                                          gh.params(point["tokens"], point["kv_policy"]), budget, timeout=timeout))
            except Exception as exc:  # noqa: BLE001 - recorded; the gate runs next
                entry.update(error=f"{type(exc).__name__}: {exc}"[:400])
            entry["region_after"] = region_after()
            entry["cache_flushed"] = flush_cache(engine)
        results["headline"].append(entry)
        save()
        print(f"headline {name:12s} TP {args.tp} rows {rows:4d} budget {budget}: {entry.get('tokens_per_s')} tok/s "
              f"TPOT p50/p99 {entry.get('tpot_p50_ms')}/{entry.get('tpot_p99_ms')} ms ({entry.get('seconds')} s)"
              + (f" error: {entry['error']}" if entry.get("error") else ""), flush=True)


# ----- main -----

def start_engine(engine_kwargs: dict, results: dict, save) -> object | None:
    """sglang.Engine(**engine_kwargs), its start time in `results`; None when
    it does not start (the error saved in `results`)."""
    import sglang

    started = time.monotonic()
    try:
        engine = sglang.Engine(**engine_kwargs)
    except BaseException as exc:
        results["engine_start_error"] = f"{type(exc).__name__}: {exc}"[:2000]
        save()
        print(f"FAILED: the engine did not start: {exc}", flush=True)
        return None
    results["engine_start_s"] = round(time.monotonic() - started, 1)
    results["stage"] = "workloads"
    return engine


def report_engine_death(engine, state: dict, results: dict, save) -> None:
    """When a child of the engine fails it sends SIGQUIT, and SGLang's own
    handler would kill this process before the JSON says so: ours marks the
    engine dead and the workload running (state["current"]) failed, saves,
    and ends the process with status 3."""
    def on_sigquit() -> None:
        state["engine_alive"] = False
        results["engine_died"] = "a child process sent SIGQUIT (it failed)"
        if state["current"] is not None:
            state["current"].update(status="engine died", engine_alive=False)
            state["current"]["errors"] = max(1, state["current"].get("errors") or 0)
        save()
        print("FAILED: the engine died (SIGQUIT from a child); JSON written", flush=True)
        from sglang.srt.utils import kill_process_tree

        kill_process_tree(os.getpid(), include_parent=False)
        os._exit(3)

    async def install() -> None:
        # Inside the engine's loop: SGLang makes its request loop there and
        # puts its own SIGQUIT handler on it (on the first request otherwise,
        # replacing ours); outside a running loop it would make another loop.
        engine.tokenizer_manager.auto_create_handle_loop()
        asyncio.get_running_loop().add_signal_handler(signal.SIGQUIT, on_sigquit)

    engine.loop.run_until_complete(install())


def main(argv: list[str]) -> int:
    t0 = time.monotonic()
    args = parse_args(argv)
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)

    from kvsieve.service.engine import prepare_process_environment

    prepare_process_environment(args.device, args.tp)  # SGLANG_USE_CPU_ENGINE (and rank cores) on cpu; prometheus
    from kvsieve.policies import policy_names

    model = model_dir(args.model)
    shape = model_shape(model)
    names = args.policies.split(",") if args.policies else policy_names()
    from kvsieve.service.presets import builtin_presets

    unknown = sorted((set(names) - set(policy_names())) | (set(args.headline) - set(policy_names())
                                                           - set(builtin_presets())))
    if unknown:
        raise SystemExit(f"unknown policies {unknown}; registered: {','.join(policy_names())}; --headline also "
                         f"takes the built-in presets {','.join(builtin_presets())}")
    specs = policy_specs(names, args.budget)
    split = memory_split(args, shape)
    # Per rank: each holds its share of the kv heads' pages (gpu_headline.py's --tp).
    split.update(tp=args.tp, region_pages_per_rank=split["region_pages"] // args.tp,
                 quantized_pages_per_rank=split["quantized_pages"] // args.tp)
    os.environ["KVSIEVE_REGION_PAGES"] = str(split["region_pages_per_rank"])
    os.environ["KVSIEVE_REGION_QUANT_PAGES"] = str(split["quantized_pages_per_rank"])

    engine_kwargs = dict(model_path=str(model), load_format="dummy", skip_tokenizer_init=True,
                         attention_backend="kvsieve", sampling_backend="pytorch", log_level="warning",
                         mem_fraction_static=args.mem_fraction_static, max_total_tokens=split["pool_tokens"],
                         max_running_requests=args.rows, random_seed=args.seed, enable_metrics=True)
    if args.device == "cuda":
        engine_kwargs.update(cuda_graph_max_bs_decode=args.cuda_graph_max_bs, disable_prefill_cuda_graph=True)
    else:
        engine_kwargs.update(device="cpu", disable_cuda_graph=True)
    if args.tp > 1:
        engine_kwargs["tp_size"] = args.tp
    if args.headline:  # the headline's chunk interval (its windows are read from streamed chunks)
        from gpu_headline import STREAM_INTERVAL

        engine_kwargs["stream_interval"] = STREAM_INTERVAL

    results = {
        "kind": "gpu-smoke", **commit_of(args.commit),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": device_name(args.device),
        "command": "python3 bench/gpu_smoke.py " + shlex.join(argv),
        "settings": {"device": args.device, "model": str(model), "model_shape": shape, "engine": engine_kwargs,
                     "env": {k: os.environ[k] for k in ("KVSIEVE_REGION_PAGES", "KVSIEVE_REGION_QUANT_PAGES")},
                     "memory_split": split, "budget": args.budget, "tokens": args.tokens,
                     "prompt_tokens": args.prompt_tokens, "temperature": args.temperature, "ignore_eos": True,
                     "workload_timeout_s": args.workload_timeout, "deadline_s": args.deadline or None,
                     "gpu_memory": "nvidia-smi memory.used of the first visible GPU (every process on it), MiB, "
                                   "polled every 0.25 s during each workload"},
        "tp": args.tp, "policies": specs, "rows": {"requested": args.rows}, "workloads": [], "ok": False,
        "stage": "starting the engine",
    }
    state = {"current": None, "engine_alive": True}

    def save() -> None:
        results["elapsed_s"] = round(time.monotonic() - t0, 1)
        tmp = out_path.with_suffix(out_path.suffix + ".tmp")
        tmp.write_text(json.dumps(results, indent=1))
        tmp.replace(out_path)

    save()
    print(f"gpu_smoke: {results['device']}, {len(names)} policies, split {json.dumps(split)}", flush=True)
    engine = start_engine(engine_kwargs, results, save)
    if engine is None:
        return 2
    exit_code = 1
    try:
        report_engine_death(engine, state, results, save)
        try:
            # What Engine.get_server_info() reports as internal_states, with a timeout.
            states = engine.loop.run_until_complete(asyncio.wait_for(engine.tokenizer_manager.get_internal_state(), 60))
            state0 = states[0] if states else {}
            engine_rows = state0.get("effective_max_running_requests_per_dp") or state0.get("max_running_requests")
            results["rows"]["engine_max_running_requests"] = engine_rows
            results["rows"]["engine_max_total_num_tokens"] = \
                engine._scheduler_init_result.scheduler_infos[0].get("max_total_num_tokens")
        except Exception as exc:  # noqa: BLE001
            engine_rows = None
            results["rows"]["engine_info_error"] = f"{type(exc).__name__}: {exc}"[:400]
        # Rows whose compressed ceilings fit the region at once, for every policy alone.
        per_row = {n: pages_per_head(n, s["kv_policy"], args.prompt_tokens, args.tokens) for n, s in specs.items()}
        worst = max((p for p in per_row.values() if p), default=0)
        region_rows = split["region_pages"] // (shape["layers"] * shape["kv_heads"] * worst) if worst else None
        results["rows"].update(region_fit=region_rows, ceiling_pages_per_head=per_row)
        rows = min(r for r in (args.rows, engine_rows, region_rows) if r)
        results["rows"]["used"] = rows
        results["region_at_start"] = region_gauges()
        if args.device == "cuda":
            results["gpu_memory_used_after_start_mib"] = Monitor(gpu=True, ranks=args.tp).gpu_used_mib()
        print(f"engine up in {results['engine_start_s']} s; rows {json.dumps(results['rows'])}", flush=True)
        save()

        if args.headline:
            results["headline"] = []
            headline_points(engine, args, split, shape, engine_rows, rows, results, save, t0)
        runnable = [n for n in names if "invalid" not in specs[n]]
        plans = [(f"solo:{n}", [n], [(n, specs[n]["kv_policy"])] * rows) for n in runnable]
        if runnable and not args.solo_only:
            # Every policy at least once, even where --rows is below their count (the CPU check).
            mixed = [(runnable[i % len(runnable)], specs[runnable[i % len(runnable)]]["kv_policy"])
                     for i in range(max(rows, len(runnable)))]
            plans.append(("mixed", runnable, mixed))
            plans.append((f"again:{runnable[0]}", [runnable[0]], [(runnable[0], specs[runnable[0]]["kv_policy"])] * rows))
        for n in names:
            if n not in runnable:
                results["workloads"].append({"name": f"solo:{n}", "policies": [n], "rows": 0, "status": "invalid spec",
                                             "errors": 1, "error_messages": [specs[n]["invalid"]]})

        for index, (label, policies, plan) in enumerate(plans):
            entry = {"name": label, "policies": policies, "rows": len(plan), "generated_tokens": args.tokens,
                     "status": "running"}
            results["workloads"].append(entry)
            left = args.deadline - (time.monotonic() - t0) if args.deadline else None
            if not state["engine_alive"] or (left is not None and left < 20):
                entry.update(status="skipped", errors=1, error_messages=[
                    "the engine died earlier" if not state["engine_alive"] else f"past --deadline {args.deadline:.0f} s"])
                save()
                print(f"{label:24s} skipped: {entry['error_messages'][0]}", flush=True)
                continue
            timeout = args.workload_timeout if left is None else max(10.0, min(args.workload_timeout, left - 15))
            state["current"] = entry
            save()
            monitor = Monitor(gpu=args.device == "cuda", ranks=args.tp)
            monitor.start()
            try:
                entry.update(run_workload(engine, plan, args, shape["vocab"], seed=1000 + index, timeout=timeout))
                entry["status"] = "done"
            except Exception as exc:  # noqa: BLE001 - recorded; the next workload runs
                entry.update(status="failed", errors=max(1, entry.get("errors") or 0),
                             error_messages=[f"{type(exc).__name__}: {exc}"[:400]])
            finally:
                monitor.finish()
            entry["peak_gpu_memory_used_mib"] = monitor.peak_mib
            if monitor.gpu_error and monitor.peak_mib is None:
                entry["gpu_memory_error"] = monitor.gpu_error
            entry["peak_region_pages_used"] = monitor.peak_region_used
            entry["region_after"] = region_after()
            if entry["region_after"].get("used"):  # pages the workload's requests never gave back
                entry["errors"] = (entry.get("errors") or 0) + 1
                entry.setdefault("error_messages", []).append(
                    f"region pages still used 15 s after the workload: {entry['region_after']['used']:.0f}")
            alive, why = engine_alive(engine, shape["vocab"])
            entry["engine_alive"] = alive
            if not alive:
                state["engine_alive"] = False
                entry["engine_error"] = why
            else:
                entry["cache_flushed"] = flush_cache(engine)
            state["current"] = None
            save()
            print(f"{label:24s} rows {entry['rows']:4d} {entry.get('wall_s', 0):7.1f} s "
                  f"{entry.get('tokens_per_s') or 0:9.1f} tok/s errors {entry.get('errors')} "
                  f"peak {entry['peak_gpu_memory_used_mib']} MiB region used after "
                  f"{entry['region_after'].get('used')} alive {alive}"
                  + (f" first error: {entry['error_messages'][0]}" if entry.get("error_messages") else ""), flush=True)

        by_name = {w["name"]: w for w in results["workloads"]}
        first = by_name.get(f"solo:{runnable[0]}", {}) if runnable else {}
        again = by_name.get(f"again:{runnable[0]}", {}) if runnable else {}
        if first.get("tokens_per_s") and again.get("tokens_per_s"):
            results["again_vs_first_tokens_per_s"] = round(again["tokens_per_s"] / first["tokens_per_s"], 3)
        failed = [w["name"] for w in results["workloads"] if w.get("errors") or w.get("status") != "done"]
        if args.headline:  # a measurement, not the gate: its own flag
            results["headline_ok"] = all(not h.get("error") for h in results.get("headline", []))
        results["failed_workloads"] = failed
        results["engine_alive_at_end"] = state["engine_alive"]
        results["ok"] = not failed and state["engine_alive"]
        results["stage"] = "done"
        exit_code = 0 if results["ok"] else 1
    finally:
        save()
        try:
            engine.shutdown()
        except Exception as exc:  # noqa: BLE001
            print(f"shutdown: {exc!r}", flush=True)
    results["elapsed_s"] = round(time.monotonic() - t0, 1)
    save()
    print(f"{'OK' if results['ok'] else 'FAILED'}: {len(results['workloads'])} workloads in {results['elapsed_s']} s"
          + (f"; failed: {', '.join(results['failed_workloads'])}" if results.get("failed_workloads") else "")
          + f" -> {out_path}", flush=True)
    return exit_code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
