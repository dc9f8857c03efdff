"""One plain sglang.Engine with kvsieve's backend (no HTTP front end, so
scheduler settings the service does not expose can be set), checking:

- SGLANG_MAX_NEW_TOKENS_LIMIT caps compressed requests too;
- min_new_tokens is the client's, not the one SGLang lowered to its
  pool-bounded max_new_tokens before kvsieve lifted that bound;
- a compressed request refused by priority validation
  (abort_on_priority_when_disabled) leaves no runtime entry: the
  `kvsieve_compressed_requests_live` gauge returns to 0.
"""

import json
import subprocess
import sys

SCRIPT = r'''
import json, os, sys, tempfile
os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp()
os.environ["SGLANG_MAX_NEW_TOKENS_LIMIT"] = "170"
WANTED_MIN = 150


def live(registry_cls, multiprocess):
    reg = registry_cls()
    multiprocess.MultiProcessCollector(reg)
    return [s.value for m in reg.collect() for s in m.samples if s.name == "kvsieve_compressed_requests_live"]


def main():
    import sglang
    from prometheus_client import CollectorRegistry, multiprocess

    # Pool of 128 tokens: SGLang clips max_new_tokens of a 4-token prompt to
    # about 122 and lowers min_new_tokens with it; compressed requests are
    # bounded by the context (and the limit, 170) instead.
    engine = sglang.Engine(model_path=sys.argv[1], device="cpu", attention_backend="kvsieve",
                           sampling_backend="pytorch", disable_cuda_graph=True, max_total_tokens=128,
                           random_seed=0, log_level="error", enable_metrics=True,
                           abort_on_priority_when_disabled=True)
    policy = {"kv_policy": {"name": "streaming", "budget": 16}}
    prompt = [5, 17, 42, 99]
    out = {}
    try:
        def run(params_list):
            return engine.generate(input_ids=[prompt] * len(params_list), sampling_params=[
                {"max_new_tokens": 200, "temperature": 0, "custom_params": policy, **p} for p in params_list])

        # SGLang's own clip, seen on a `full` request (it keeps SGLang's bound).
        out["clipped"] = clipped = len(engine.generate(input_ids=prompt, sampling_params={
            "max_new_tokens": 200, "ignore_eos": True, "custom_params": {"kv_policy": "full"}})["output_ids"])
        free = run([{"ignore_eos": True}])[0]["output_ids"]
        out["limited"] = len(free)
        # What the request would do with min_new_tokens lowered to SGLang's
        # clip, for a few stop tokens frequent in the greedy output: one that
        # stops before WANTED_MIN tells the two apart.
        counts = {}
        for t in free[clipped - 10:WANTED_MIN + 10]:
            counts[t] = counts.get(t, 0) + 1
        candidates = sorted(counts, key=lambda t: -counts[t])[:6]
        probes = run([{"min_new_tokens": clipped, "stop_token_ids": [t]} for t in candidates])
        early = [t for t, p in zip(candidates, probes) if len(p["output_ids"]) < WANTED_MIN]
        out["probe_lengths"] = [len(p["output_ids"]) for p in probes]
        if early:
            out["stop_token"] = early[0]
            out["with_min"] = len(run([{"min_new_tokens": WANTED_MIN, "stop_token_ids": [early[0]]}])[0]["output_ids"])
        out["live_before"] = live(CollectorRegistry, multiprocess)

        try:
            engine.generate(input_ids=prompt, priority=1, sampling_params={"max_new_tokens": 5, "custom_params": policy})
            out["priority"] = "not refused"
        except Exception as exc:  # SGLang raises the abort's message
            out["priority"] = str(exc)
        out["live_after"] = live(CollectorRegistry, multiprocess)
    finally:
        engine.shutdown()
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
'''


def test_limits_and_refusals_of_compressed_requests(tiny_llama, tmp_path):
    script = tmp_path / "engine_run.py"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(script), str(tiny_llama)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads([l for l in done.stdout.splitlines() if l.startswith("RESULT ")][-1][len("RESULT "):])
    # Requested 200; SGLANG_MAX_NEW_TOKENS_LIMIT=170 holds for compressed
    # requests, while the pool clip (about 122 here) does not.
    assert out["clipped"] < 150
    assert out["limited"] == 170
    # min_new_tokens=150 holds: with it lowered to SGLang's clip, the same
    # request stops early at this stop token.
    assert "stop_token" in out, f"no stop token tells the two apart: {out}"
    assert out["with_min"] >= 150, out
    # Refused by SGLang's priority validation before it was queued: no entry left.
    assert "priority is disabled" in out["priority"], out
    assert out["live_before"] == [0.0] and out["live_after"] == [0.0], out
