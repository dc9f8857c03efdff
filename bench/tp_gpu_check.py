"""Tensor parallelism 2 against TP 1, through real `kvsieve serve` engines:

    python bench/tp_gpu_check.py OUT_DIR [--models tiny,small] [--device cuda|cpu] [--cases full,h2o-8,...]
        [--parallel 1]

For each model (built here into /tmp, random weights, fp32, no downloads):
`tiny` is tests/tiny_models.py's Llama (2 kv heads: 1 per rank); `small` is
a Llama with real attention shapes (head_dim 128, 8 query heads, 4 kv heads:
2 per rank, GQA group 2; 4 layers, hidden 1024). One server at a time: TP 1
runs every case of tests/tp_cases.py (one per registered policy) alone, then all of them
submitted at once (a mixed batch); then TP 2 does the same. Checks per case:
greedy token ids and kv_usage (private, retained, evicted tokens, eviction
events, retained bytes) of TP 2 equal TP 1's; the mixed batch's tokens equal
the same server's solo tokens and its kv_usage equals the other TP's mixed
batch. After each server's runs: every region page is back (the
kvsieve_region_pages{state="used"} gauge, all ranks, reads 0) and the
eviction counter equals the sum of what the requests reported (counted once,
not once per rank).

Servers are `kvsieve serve` started through this script (`--serve-child`) so
that on CUDA the engine gets disable_cuda_graph and a modest
mem_fraction_static, which serve has no flags for. fp32 everywhere: the
all-reduce's float order then does not flip greedy choices. Writes
OUT_DIR/gpu-tp.json (after every server) and OUT_DIR/logs/; exits 0 when a
check fails (the JSON's "ok" says so), non-zero only on a crash. `--device`
defaults to cuda when a GPU is visible, else cpu (a smoke test).

`--parallel 1` (issue #31: the whole check inside one 10-minute device call
beside other work) runs every server at once instead of one at a time:
each model's TP 1 and TP 2 servers side by side, and the models side by
side; on CUDA model i's TP 1 server gets GPU i mod (GPUs) (CUDA_VISIBLE_DEVICES)
and every TP 2 server both. The checks are the same (each server's greedy
tokens do not depend on what else runs on its GPU: fp32, same batch shapes);
start and case seconds are then not comparable between servers, and the
JSON says `parallel: true`. On two H100s the sequential check took about 8
minutes (tiny ~260 s, small ~200 s, mostly server starts).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from datetime import datetime, timezone
from pathlib import Path

# SGLang's fused CUDA ops (sgl_kernel's rmsnorm among them) do not dispatch
# fp32, and the servers here run fp32 (see above). Every process of a server
# imports this script (the serve child runs it; SGLang's spawned ranks import
# it as __mp_main__), so with this variable set every platform op takes its
# PyTorch-native path, which takes any dtype.
if os.environ.get("KVSIEVE_TP_NATIVE_OPS") == "1":
    from sglang.srt.layers.utils.multi_platform import MultiPlatformOp

    MultiPlatformOp.dispatch_forward = lambda self: self.forward_native

REPO = Path(__file__).resolve().parent.parent
MODEL_ROOT = Path("/tmp/kvsieve-tp-models")
MAX_TOTAL_TOKENS = 4096
USAGE = ("private_tokens", "retained_tokens", "evicted_tokens", "eviction_events", "retained_kv_bytes")
# Engine options serve has no flags for (CUDA only): no SGLang graphs (the
# region's are off under TP anyway) for a fast start, a modest pool.
CUDA_EXTRA = {"disable_cuda_graph": True, "mem_fraction_static": 0.5}


# ----- cases -----

# One per registered policy plus variants, shared with tests/test_tensor_parallel.py.
sys.path.insert(0, str(REPO / "tests"))
from tp_cases import case_label, tp_cases, tp_prompt as prompt_for  # noqa: E402

CASES = tp_cases()


# ----- models -----

def build_model(name: str) -> Path:
    from tiny_models import build_tiny_model

    if name == "tiny":
        return build_tiny_model(MODEL_ROOT / "tiny-llama", "llama")
    if name == "small":
        return build_small_llama(MODEL_ROOT / "small-llama")
    raise SystemExit(f"unknown model {name!r} (tiny, small)")


def build_small_llama(out_dir: Path, seed: int = 0, std_factor: float = 1.6) -> Path:
    """tiny_models' recipe with real attention shapes. Weights normal(0,
    std_factor / sqrt(hidden)): the tiny model's 0.2 at hidden 64 is 1.6 /
    sqrt(64); HF's 0.02 gives near-constant greedy output."""
    import torch
    from tiny_models import train_tokenizer
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if (out_dir / "config.json").exists():
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    train_tokenizer(out_dir)
    tok = AutoTokenizer.from_pretrained(out_dir)
    hidden = 1024
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=2048, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, head_dim=128, max_position_embeddings=2048,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False, torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, std_factor / hidden ** 0.5)
    model.save_pretrained(out_dir, safe_serialization=True)
    gen = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id}
    (out_dir / "generation_config.json").write_text(json.dumps(gen))
    return out_dir


# ----- servers -----

def serve_child(extra_json: str, serve_args: list[str]) -> int:
    """Run `kvsieve serve` in this process with extra sglang.Engine kwargs
    and a POST /flush_cache route (SGLang's flush: empty the radix tree, so
    the mixed batch's prompts are not prefix hits of the solo runs)."""
    from kvsieve.service import app, cli, engine

    extra = json.loads(extra_json)
    plain_kwargs = engine.EngineSettings.engine_kwargs
    engine.EngineSettings.engine_kwargs = lambda self: {**plain_kwargs(self), **extra}
    plain_app = app.create_app

    def create_app_with_flush(client, *args, **kwargs):
        api = plain_app(client, *args, **kwargs)

        @api.post("/flush_cache")
        async def flush_cache():
            out = await client._engine.tokenizer_manager.flush_cache()
            return {"success": bool(out.success)}

        return api

    app.create_app = create_app_with_flush
    return cli.main(["serve", *serve_args])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_sized_region_pages(model: Path, tp: int, page_size: int = 16) -> int:
    """The region a CPU server of this model gets (the token pool's size per
    (layer, kv head) of this rank). On CUDA the region is otherwise carved
    from mem_fraction_static's whole budget: for these toy models tens of GB,
    whose pass scratch alone outgrows the workspace share, and whose size on
    the TP 1 server's GPU would unbalance a TP 2 server starting beside it."""
    config = json.loads((model / "config.json").read_text())
    heads = max(1, config["num_key_value_heads"] // tp)
    return MAX_TOTAL_TOKENS * config["num_hidden_layers"] * heads // page_size


class Server:
    def __init__(self, model: Path, tp: int, device: str, log_dir: Path, gpu: int | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"{model.name}-tp{tp}.log"
        extra = CUDA_EXTRA if device == "cuda" else {}
        cmd = [sys.executable, str(Path(__file__).resolve()), "--serve-child", json.dumps(extra),
               "--model", str(model), "--device", device, "--dtype", "float32", "--tp-size", str(tp),
               "--max-total-tokens", str(MAX_TOTAL_TOKENS), "--port", str(self.port), "--log-level", "warning"]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "KVSIEVE_TP_NATIVE_OPS": "1" if device == "cuda" else "0"}
        if device == "cuda":
            env["KVSIEVE_REGION_PAGES"] = str(cpu_sized_region_pages(model, tp))
        if gpu is not None and device == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = str(gpu)
        self.proc = subprocess.Popen(cmd, stdout=open(self.log_path, "wb"), stderr=subprocess.STDOUT, env=env)

    def wait_up(self, timeout: float = 600) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"server did not come up in {timeout} s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        # SIGTERM: serve shuts the engine (and its rank processes) down itself.
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def complete(self, prompt: list[int], policy, max_tokens: int) -> dict:
        import httpx

        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True, "kv_policy": policy}
        started = time.monotonic()
        r = httpx.post(f"{self.url}/v1/completions", json=body, timeout=600)
        r.raise_for_status()
        out = r.json()
        return {"tokens": out["choices"][0]["token_ids"], "kv_usage": out.get("kv_usage") or {},
                "seconds": round(time.monotonic() - started, 3)}

    def flush_cache(self) -> bool:
        import httpx

        return httpx.post(f"{self.url}/flush_cache", timeout=60).json()["success"]

    def metric(self, name: str, **labels) -> float:
        import httpx

        total = 0.0
        for line in httpx.get(f"{self.url}/metrics", timeout=30).text.splitlines():
            if line.startswith((name + "{", name + " ")) and all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def region_used_pages(self, timeout: float = 30) -> float:
        """The region's used pages (all ranks), waiting for them to return."""
        deadline = time.monotonic() + timeout
        used = self.metric("kvsieve_region_pages", state="used")
        while used != 0 and time.monotonic() < deadline:
            time.sleep(0.2)
            used = self.metric("kvsieve_region_pages", state="used")
        return used


# ----- runs -----

def run_engine(model: Path, tp: int, device: str, cases: list, log_dir: Path, gpu: int | None = None) -> dict:
    """Start one server, run every case alone then all at once, stop it."""
    started = time.monotonic()
    server = Server(model, tp, device, log_dir, gpu)
    try:
        server.wait_up()
        result = {"start_s": round(time.monotonic() - started, 1), "solo": {}, "mixed": {}}
        print(f"  {model.name} TP{tp}: up in {result['start_s']} s", flush=True)
        for index, policy, tokens in cases:
            out = server.complete(prompt_for(index, policy), policy, tokens)
            result["solo"][case_label(policy)] = out
            print(f"  {model.name} TP{tp} {case_label(policy):24s} {out['seconds']:7.2f} s "
                  f"evicted {out['kv_usage'].get('evicted_tokens')} tokens {out['tokens'][:8]}...", flush=True)
        result["flushed"] = server.flush_cache()
        mixed_started = time.monotonic()
        with ThreadPoolExecutor(len(cases)) as pool:
            futures = {case_label(p): pool.submit(server.complete, prompt_for(i, p), p, t) for i, p, t in cases}
            result["mixed"] = {label: f.result() for label, f in futures.items()}
        result["mixed_s"] = round(time.monotonic() - mixed_started, 2)
        print(f"  {model.name} TP{tp} mixed batch of {len(cases)}: {result['mixed_s']} s", flush=True)
        reported = sum(o["kv_usage"].get("evicted_tokens", 0) for run in ("solo", "mixed")
                       for o in result[run].values())
        result["evicted_reported"] = reported
        result["evicted_counter"] = server.metric("kvsieve_evicted_tokens_total")
        result["region_used_pages_at_end"] = server.region_used_pages()
        result["region_idle"] = result["region_used_pages_at_end"] == 0
        result["evicted_counted_once"] = result["evicted_counter"] == reported
        return result
    except Exception:
        print(server.log_tail(), file=sys.stderr, flush=True)
        raise
    finally:
        server.stop()


def first_difference(a: list, b: list):
    """Index of the first differing token (None when equal)."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def usage_equal(a: dict, b: dict) -> dict:
    return {key: a.get(key) == b.get(key) for key in USAGE}


def compare(one: dict, two: dict, cases: list) -> dict:
    """Per case: TP 2 against TP 1 (solo and mixed), mixed against solo."""
    out = {}
    for _, policy, _ in cases:
        label = case_label(policy)
        s1, s2, m1, m2 = one["solo"][label], two["solo"][label], one["mixed"][label], two["mixed"][label]
        checks = {
            "tokens_tp2_eq_tp1": s2["tokens"] == s1["tokens"],
            "usage_tp2_eq_tp1": all(usage_equal(s1["kv_usage"], s2["kv_usage"]).values()),
            "mixed_tokens_tp2_eq_tp1": m2["tokens"] == m1["tokens"],
            "mixed_usage_tp2_eq_tp1": all(usage_equal(m1["kv_usage"], m2["kv_usage"]).values()),
            "mixed_tokens_eq_solo_tp1": m1["tokens"] == s1["tokens"],
            "mixed_tokens_eq_solo_tp2": m2["tokens"] == s2["tokens"],
        }
        out[label] = {
            "policy": policy, "ok": all(checks.values()), **checks,
            "usage_fields_equal": usage_equal(s1["kv_usage"], s2["kv_usage"]),
            "first_difference": {"tp2_vs_tp1": first_difference(s1["tokens"], s2["tokens"]),
                                 "mixed_tp2_vs_tp1": first_difference(m1["tokens"], m2["tokens"]),
                                 "mixed_vs_solo_tp1": first_difference(s1["tokens"], m1["tokens"]),
                                 "mixed_vs_solo_tp2": first_difference(s2["tokens"], m2["tokens"])},
            "tp1_tokens": s1["tokens"][:16], "tp2_tokens": s2["tokens"][:16],
            "tp1_kv_usage": s1["kv_usage"], "tp2_kv_usage": s2["kv_usage"],
            "tp1_mixed_kv_usage": m1["kv_usage"], "tp2_mixed_kv_usage": m2["kv_usage"],
            "tp1_s": s1["seconds"], "tp2_s": s2["seconds"],
            "tp1_mixed_s": m1["seconds"], "tp2_mixed_s": m2["seconds"],
        }
        status = "ok" if out[label]["ok"] else "MISMATCH " + ",".join(k for k, v in checks.items() if not v)
        print(f"{label:24s} {status}  tp1 {s1['tokens'][:6]} tp2 {s2['tokens'][:6]} "
              f"evicted {s1['kv_usage'].get('evicted_tokens')}/{s2['kv_usage'].get('evicted_tokens')}", flush=True)
    return out


def engine_checks_ok(run: dict) -> bool:
    return run["region_idle"] and run["evicted_counted_once"] and run["flushed"]


def check_model(name: str, device: str, cases: list, log_dir: Path, parallel: bool = False,
                gpu: int | None = None) -> dict:
    model = build_model(name)
    if parallel:  # TP 1 (on `gpu`) and TP 2 side by side
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(run_engine, model, 1, device, cases, log_dir, gpu)
            second = pool.submit(run_engine, model, 2, device, cases, log_dir)
            one, two = first.result(), second.result()
    else:
        one = run_engine(model, 1, device, cases, log_dir)
        two = run_engine(model, 2, device, cases, log_dir)
    per_case = compare(one, two, cases)
    summary = {k: one[k] for k in ("region_idle", "region_used_pages_at_end", "evicted_counter",
                                    "evicted_reported", "evicted_counted_once", "flushed")}
    summary2 = {k: two[k] for k in summary}
    evicted_somewhere = two["evicted_reported"] > 0  # the policies did evict: the check has teeth
    ok = all(c["ok"] for c in per_case.values()) and engine_checks_ok(one) and engine_checks_ok(two)
    ok = ok and evicted_somewhere
    print(f"{name}: {'ok' if ok else 'FAILED'} (TP1 up {one['start_s']} s, TP2 up {two['start_s']} s; "
          f"region idle {one['region_idle']}/{two['region_idle']}; evicted counted once "
          f"{one['evicted_counted_once']}/{two['evicted_counted_once']})", flush=True)
    return {"model_dir": str(model), "ok": ok, "cases": per_case,
            "tp1": {"start_s": one["start_s"], "mixed_s": one["mixed_s"], **summary},
            "tp2": {"start_s": two["start_s"], "mixed_s": two["mixed_s"], **summary2}}


# ----- entry -----

def device_info() -> dict:
    """GPU names from a short child process: the parent holds no CUDA context."""
    probe = ("import json, torch; n = torch.cuda.device_count() if torch.cuda.is_available() else 0; "
             "print(json.dumps({'cuda': n, 'names': [torch.cuda.get_device_name(i) for i in range(n)], "
             "'torch': torch.__version__}))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def parse_args(argv: list[str]) -> dict:
    if not argv or argv[0].startswith("--"):
        raise SystemExit(__doc__)
    opts = dict(zip(argv[1::2], argv[2::2]))
    unknown = set(opts) - {"--models", "--device", "--cases", "--parallel"}
    if unknown or len(argv[1:]) % 2:
        raise SystemExit(f"bad options {argv[1:]}\n{__doc__}")
    labels = [case_label(p) for p, _ in CASES]
    wanted = opts["--cases"].split(",") if "--cases" in opts else labels
    if set(wanted) - set(labels):
        raise SystemExit(f"unknown cases {sorted(set(wanted) - set(labels))}; cases: {','.join(labels)}")
    cases = [(i, p, t) for i, (p, t) in enumerate(CASES) if case_label(p) in wanted]
    return {"out": Path(argv[0]), "models": opts.get("--models", "tiny,small").split(","),
            "device": opts.get("--device"), "cases": cases, "parallel": opts.get("--parallel", "0") == "1"}


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    info = device_info()
    device = args["device"] or ("cuda" if info["cuda"] else "cpu")
    if device == "cuda" and info["cuda"] < 2:
        print(f"warning: {info['cuda']} GPU(s) visible; TP 2 needs 2", flush=True)
    args["out"].mkdir(parents=True, exist_ok=True)
    log_dir = args["out"] / "logs"
    log_dir.mkdir(exist_ok=True)
    report = {"command": " ".join([sys.executable, *sys.argv]), "date_utc": datetime.now(timezone.utc).isoformat(),
              "device": device, "gpus": info["names"], "torch": info["torch"], "dtype": "float32",
              "max_total_tokens": MAX_TOTAL_TOKENS, "engine_extra": CUDA_EXTRA if device == "cuda" else {},
              "cases": [case_label(p) for _, p, _ in args["cases"]], "models": {}, "parallel": args["parallel"]}
    path = args["out"] / "gpu-tp.json"
    started = time.monotonic()
    if args["parallel"]:
        for name in args["models"]:  # built here, not in the threads
            build_model(name)
        gpus = max(1, info["cuda"])
        print(f"== {','.join(args['models'])} on {device}, every server at once", flush=True)
        with ThreadPoolExecutor(len(args["models"])) as pool:
            futures = {pool.submit(check_model, name, device, args["cases"], log_dir, True, i % gpus): name
                       for i, name in enumerate(args["models"])}
            for future in as_completed(futures):
                name = futures[future]
                try:
                    report["models"][name] = future.result()
                except Exception as exc:  # noqa: BLE001 - the other model's result still counts
                    report["models"][name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:3000]}
                    print(f"{name}: FAILED {type(exc).__name__}: {exc}", flush=True)
                report["ok"] = all(m["ok"] for m in report["models"].values())
                report["total_s"] = round(time.monotonic() - started, 1)
                path.write_text(json.dumps(report, indent=1))
    for name in [] if args["parallel"] else args["models"]:
        print(f"== {name} on {device}", flush=True)
        report["models"][name] = check_model(name, device, args["cases"], log_dir)
        report["ok"] = all(m["ok"] for m in report["models"].values())
        report["total_s"] = round(time.monotonic() - started, 1)
        path.write_text(json.dumps(report, indent=1))
    print(f"{'OK' if report['ok'] else 'FAILED'}: TP2 vs TP1 on {','.join(args['models'])} ({device}) "
          f"in {report['total_s']} s -> {path}", flush=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--serve-child":
        sys.exit(serve_child(sys.argv[2], sys.argv[3:]))
    sys.exit(main(sys.argv[1:]))
