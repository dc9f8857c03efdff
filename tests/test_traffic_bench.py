"""bench/traffic.py: the arrival trace is seeded, Poisson and shaped as
documented (lengths, shared prefixes, a mix with `full` and snapkv); the
per-rate figures follow their documented definitions; and `--quick` replays
the trace end to end against vanilla SGLang and kvsieve on CPU (tiny Llama)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("traffic", REPO / "bench/traffic.py")
traffic = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(traffic)

SHAPE = dict(gen_min=512, gen_max=16384, prompt_min=64, prompt_max=2048, prefixes=4, prefix_tokens=512,
             private_min=16, vocab=152064)


def trace(rates=(2.0,), duration=60.0, seed=0, mix=None, **overrides):
    shape = {**SHAPE, **overrides}
    return traffic.make_trace(list(rates), duration, seed=seed, mix=mix or traffic.parse_mix(traffic.DEFAULT_MIX),
                              **shape)


# ----- the trace -----

def test_the_same_seed_gives_the_same_trace_and_another_seed_another():
    assert trace(seed=3) == trace(seed=3)
    a, b = trace(seed=3)[2.0], trace(seed=4)[2.0]
    assert [r["arrival"] for r in a] != [r["arrival"] for r in b]
    assert traffic.trace_hash(a) == traffic.trace_hash(trace(seed=3)[2.0]) != traffic.trace_hash(b)


def test_each_rate_draws_its_own_stream():
    # Adding a rate to the run leaves another rate's requests unchanged.
    assert trace(rates=(1.0, 2.0, 4.0))[2.0] == trace(rates=(2.0,))[2.0]


@pytest.mark.parametrize("rate", [0.5, 2.0, 8.0])
def test_arrivals_are_poisson_at_the_rate(rate):
    duration = 400.0
    reqs = trace(rates=(rate,), duration=duration)[rate]
    expected = rate * duration
    assert abs(len(reqs) - expected) < 5 * math.sqrt(expected)
    arrivals = [r["arrival"] for r in reqs]
    assert arrivals == sorted(arrivals) and 0 < arrivals[0] and arrivals[-1] < duration
    gaps = [b - a for a, b in zip([0.0] + arrivals, arrivals)]
    assert abs(statistics.mean(gaps) - 1 / rate) < 0.25 / rate  # exponential gaps of mean 1/rate
    assert statistics.stdev(gaps) == pytest.approx(1 / rate, rel=0.25)  # exponential: sd = mean


def test_lengths_stay_in_bounds_and_generations_are_log_uniform():
    reqs = trace(rates=(8.0,), duration=200.0)[8.0]
    gens = [r["gen"] for r in reqs]
    assert min(gens) >= 512 and max(gens) <= 16384
    assert all(64 <= len(r["prompt"]) <= 2048 for r in reqs)
    # log-uniform: the median is the geometric mean of the bounds (2896), a
    # quarter of the requests below 512 * 32 ** 0.25 (1218)
    assert statistics.median(gens) == pytest.approx(math.sqrt(512 * 16384), rel=0.15)
    assert sum(g < 512 * 32 ** 0.25 for g in gens) / len(gens) == pytest.approx(0.25, abs=0.05)
    assert all(0 <= r["shared"] <= 512 and len(r["prompt"]) - r["shared"] >= 16 for r in reqs)


def test_prompts_share_their_prefix_and_differ_after_it():
    reqs = trace(rates=(4.0,), duration=100.0)[4.0]
    by_prefix: dict[int, list[dict]] = {}
    for r in reqs:
        by_prefix.setdefault(r["prefix"], []).append(r)
    assert sorted(by_prefix) == [0, 1, 2, 3] and all(len(g) > 10 for g in by_prefix.values())
    heads = {}
    for k, group in by_prefix.items():
        longest = max(group, key=lambda r: r["shared"])
        assert longest["shared"] == 512
        for r in group:  # every prompt of a prefix starts with (a part of) the same ids
            assert r["prompt"][:r["shared"]] == longest["prompt"][:r["shared"]]
        heads[k] = tuple(longest["prompt"][:512])
    assert len(set(heads.values())) == 4  # four different system prompts
    assert len({tuple(r["prompt"]) for r in reqs}) == len(reqs)  # private parts make each prompt its own


def test_short_prompts_keep_a_private_part():
    reqs = trace(rates=(4.0,), duration=50.0, prompt_min=64, prompt_max=100)[4.0]
    # Shorter than the prefix plus --private-min: the prefix is cut, the private part stays.
    assert all(r["shared"] == len(r["prompt"]) - 16 for r in reqs)


def test_the_default_mix_holds_full_and_snapkv_and_weights_are_honoured():
    mix = traffic.parse_mix(traffic.DEFAULT_MIX)
    assert {"full", "snapkv", "streaming", "h2o", "rkv", "skipkv", "thinkv", "crystal_kv", "longflow",
            "crystalcache"} == set(mix)
    policies = [r["policy"] for r in trace(rates=(8.0,), duration=100.0)[8.0]]
    assert {"full", "snapkv"} <= set(policies) and set(policies) == set(mix)
    weighted = trace(rates=(8.0,), duration=200.0, mix=traffic.parse_mix("full:3,snapkv"))[8.0]
    share = sum(r["policy"] == "full" for r in weighted) / len(weighted)
    assert share == pytest.approx(0.75, abs=0.05)
    with pytest.raises(ValueError):
        traffic.parse_mix("full:0")


def test_quick_options_are_the_documented_small_ones():
    args = traffic.parse_args(["--quick"])
    assert (args.device, args.model, args.rates, args.duration) == ("cpu", "tiny", [2.0, 4.0], 3.0)
    assert (args.gen_min, args.gen_max, args.prompt_min, args.prompt_max) == (8, 32, 16, 48)
    full = traffic.parse_args([])
    assert (full.gen_min, full.gen_max, full.budget, full.kv_tokens) == (512, 16384, 1024, 786432)
    assert traffic.parse_args(["--quick", "--gen-max", "64"]).gen_max == 64  # explicit options win


def test_the_warm_up_waits_its_own_timeout_not_the_rates(monkeypatch):
    # A short --rate-timeout once cut the warm-up while kernels compiled and
    # marked a clean run FAILED: the warm-up has a timeout of its own.
    import asyncio
    from types import SimpleNamespace

    args = traffic.parse_args(["--quick", "--rate-timeout", "18", "--mix", "h2o,full"])
    assert args.warmup_timeout == 180.0 and args.rate_timeout == 18.0
    waited = []

    async def replay(engine, reqs, params_of, timeout):
        waited.append((len(reqs), timeout))
        return [], None, {}

    monkeypatch.setattr(traffic, "replay", replay)
    loop = asyncio.new_event_loop()
    try:
        out = traffic.warm_up(SimpleNamespace(loop=loop), args, {}, vocab=4096, engine_name="kvsieve")
    finally:
        loop.close()
    assert waited == [(2, 180.0)] and out["failed"] == [] and out["requests"] == 2


# ----- the figures -----

def record(policy="h2o", gen=16, sent=None, chunks=(), end=None, error=None, aborted=None, queue_time=0.0,
           retractions=0):
    rec = traffic.new_record({"id": "x", "policy": policy, "gen": gen})
    rec.update(sent=sent, chunks=list(chunks), end=end, error=error, aborted=aborted, queue_time=queue_time,
               retractions=retractions, tokens=chunks[-1][1] if chunks else 0)
    return rec


def test_figures_follow_their_definitions():
    records = [
        # completed: first token 0.5 s after sending, 16 tokens, (3.5 - 0.5) / (16 - 1) s per token after it
        record(sent=0.0, chunks=[(0.5, 1), (1.5, 9), (3.5, 16)], end=3.5, queue_time=0.2),
        record(sent=1.0, chunks=[(1.2, 1), (2.0, 9), (2.6, 16)], end=2.6, queue_time=1.5, retractions=1),
        # cut off at 10 s with 9 of its tokens streamed (a chunk after the cut is not counted)
        record(sent=2.0, gen=32, chunks=[(3.0, 1), (5.0, 9), (10.5, 17)], end=10.6, queue_time=0.1),
        # no first token by the cut: TTFT counted as 10 - 4 = 6 s (a lower bound), queued
        record(sent=4.0, gen=32, chunks=[], end=10.6, queue_time=None),
        record(sent=None),  # never sent
        record(policy="snapkv", sent=5.0, chunks=[(5.1, 1)], end=5.1, aborted="kvsieve: refused"),  # error
        record(policy="snapkv", sent=6.0, end=6.5, error="ValueError: bad kv_policy"),  # refused: no TTFT
    ]
    f = traffic.summarize(records, cut=10.0, duration=10.0, queued_threshold=1.0, with_usage=False)
    assert (f["offered"], f["sent"], f["completed"], f["unfinished"], f["unsent"], f["errors"]) == (7, 6, 2, 2, 1, 2)
    assert f["window_s"] == 10.0 and f["completed_tokens"] == 32 and f["goodput_tok_s"] == 3.2
    assert f["generated_tokens"] == 16 + 16 + 9 + 1 and f["generated_tok_s"] == 4.2
    assert f["offered_tok_s"] == round((16 + 16 + 32 + 32 + 16 + 16 + 16) / 10.0, 1)
    assert f["ttft_censored"] == 1
    # TTFT over the five sent with a first token or still waiting: 0.5, 0.2, 1.0, 6.0 (censored), 0.1
    # -> nearest-rank p50 = the 3rd smallest
    assert f["ttft_p50_s"] == 0.5 and f["ttft_p99_s"] == 6.0
    # TPOT per request: 3/15 = 200 ms, 1.4/15 = 93.33 ms, (5 - 3)/8 = 250 ms (cut one, chunks before the cut)
    assert f["tpot_requests"] == 3 and f["tpot_p50_ms"] == 200.0 and f["tpot_p99_ms"] == 250.0
    assert f["queued"] == 2  # queue time 1.5 s > 1 s, and the one still waiting at the cut
    assert f["retracted_requests"] == 1 and f["retractions"] == 1
    assert f["error_messages"] == ["abort: kvsieve: refused", "ValueError: bad kv_policy"]
    assert f["per_policy"]["h2o"]["requests"] == 5 and f["per_policy"]["snapkv"] == {
        "requests": 2, "completed": 0, "tpot_p50_ms": None}


def test_without_a_cut_the_window_ends_at_the_last_request():
    records = [record(sent=0.0, chunks=[(0.1, 1), (2.0, 16)], end=2.0),
               record(sent=1.0, chunks=[(1.1, 1), (4.0, 16)], end=4.0)]
    f = traffic.summarize(records, cut=None, duration=2.0, queued_threshold=1.0, with_usage=False)
    assert f["window_s"] == 4.0 and f["goodput_tok_s"] == 8.0 and f["generated_tok_s"] == 8.0
    assert f["unfinished"] == 0 and f["ttft_censored"] == 0 and f["queued"] == 0


def test_percentiles_are_nearest_rank():
    values = list(range(1, 101))
    assert traffic.percentile(values, 0.5) == 50 and traffic.percentile(values, 0.99) == 99
    assert traffic.percentile([7.0], 0.99) == 7.0 and traffic.percentile([], 0.5) is None


def test_a_result_file_of_other_settings_is_refused(tmp_path):
    out = tmp_path / "traffic.json"
    args = traffic.parse_args(["--quick"])
    cfg = vars(args)
    out.write_text(json.dumps({"kind": "traffic", "comparable": traffic.comparable({**cfg, "budget": 99}),
                               "trace": {}}))
    with pytest.raises(SystemExit, match="budget 99"):
        traffic.load_previous(out, cfg, {})
    out.write_text(json.dumps({"kind": "traffic", "comparable": traffic.comparable({**cfg, "engines": ["x"]}),
                               "trace": {}}))
    assert traffic.load_previous(out, cfg, {}) is not None  # which engines ran is no setting


# ----- end to end on CPU -----

@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("traffic") / "traffic.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench/traffic.py"), "--quick", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=400)
    # The progress lines (stdout) whole, SGLang's log (stderr) its end.
    assert proc.returncode == 0, proc.stdout + "\n--- stderr ---\n" + "\n".join(proc.stderr.splitlines()[-30:])
    return json.loads(out.read_text()), proc.stdout


def test_quick_replays_every_rate_on_both_engines(quick_run):
    data, stdout = quick_run
    assert data["kind"] == "traffic" and data["device"] == "cpu" and data["commit"]
    assert set(data["engines"]) == {"vanilla", "kvsieve"}
    rates = set(data["trace"])
    assert rates == {"2", "4"}
    for name, engine in data["engines"].items():
        assert engine["warmup"]["failed"] == [] and engine["warmup"]["requests"] == len(data["config"]["mix"])
        assert set(engine["rates"]) == rates
        for key, f in engine["rates"].items():
            assert f["status"] == "done", (name, key, f)
            assert f["offered"] == data["trace"][key]["requests"] > 0
            assert f["completed"] == f["offered"] and f["errors"] == 0 and f["unfinished"] == 0, (name, key, f)
            assert f["goodput_tok_s"] > 0 and f["completed_tokens"] == data["trace"][key]["total_gen_tokens"]
            for metric in ("ttft_p50_s", "ttft_p99_s", "tpot_p50_ms", "tpot_p99_ms"):
                assert f[metric] is not None and f[metric] > 0, (name, key, metric)
            assert f["ttft_p99_s"] >= f["ttft_p50_s"] and f["tpot_p99_ms"] >= f["tpot_p50_ms"]
            assert f["queued_source"] == "meta_info.queue_time"  # the scheduler's own queue time came back
            assert f["load_samples"] > 0 and f["retracted_counter_delta"] is not None
            assert f"{name:8s} rate {key:>5s}/s" in stdout  # one progress line per rate and engine
            if name == "kvsieve":
                # The step log (radix_ext/step_log.py) saw this rate's prefills and decodes.
                steps = f["steps"]
                assert steps["modes"]["extend"]["steps"] > 0 and steps["modes"]["extend"]["tokens"] > 0
                assert steps["modes"]["decode"]["steps"] > 0 and steps["decode_kinds"]
                # CPU: no graphs, every decode step of compressed rows is eager.
                assert set(steps["decode_kinds"]) == {"eager"}
                budget = steps["time_budget"]  # bench/capture_churn.time_budget over the rate's steps
                assert budget["steady_s"] > 0 and set(budget["excess_s"]) <= {"eager"}
                # The whole is the steady steps, plus the slower ones' excess, minus what faster ones saved.
                parts = budget["steady_s"] + sum(budget["excess_s"].values()) - budget["below_median_s"]
                assert budget["decode_s"] == pytest.approx(parts, abs=0.01)


def test_quick_runs_both_engines_at_equal_kv_memory(quick_run):
    data, _ = quick_run
    kv, split = data["config"]["kv_tokens"], data["memory_split"]
    vanilla, kvsieve = data["engines"]["vanilla"], data["engines"]["kvsieve"]
    assert vanilla["engine_kwargs"]["max_total_tokens"] == kv and vanilla["env"] == {}
    assert kvsieve["env"]["KVSIEVE_STEP_LOG"].endswith("-steps.jsonl")
    assert kvsieve["engine_kwargs"]["attention_backend"] == "kvsieve"
    assert kvsieve["engine_kwargs"]["max_total_tokens"] == split["pool_tokens"] == int(kv * 0.15)
    shape = data["model_shape"]
    region_tokens = int(kvsieve["env"]["KVSIEVE_REGION_PAGES"]) * 16 // (shape["layers"] * shape["kv_heads"])
    assert split["pool_tokens"] + region_tokens == pytest.approx(kv, abs=16)


def test_quick_kvsieve_requests_carried_their_policies_and_vanilla_none(quick_run):
    data, _ = quick_run
    policies = set()
    for rate in data["trace"].values():
        policies |= set(rate["policies"])
    assert {"full", "snapkv"} <= policies  # the quick trace itself holds both
    served = set()
    for f in data["engines"]["kvsieve"]["rates"].values():
        for name, p in f["per_policy"].items():
            assert p["usage_policies"] == {name: p["completed"]} and p["usage_mismatch"] == 0, (name, p)
            served.add(name)
    assert served == policies
    assert data["policies"]["snapkv"]["kv_policy"] == {"name": "snapkv", "budget": data["config"]["budget"]}
    for f in data["engines"]["vanilla"]["rates"].values():
        assert all("usage_policies" not in p for p in f["per_policy"].values())


def test_vanilla_gets_no_kv_policy_and_kvsieve_the_requests_own():
    req = trace(rates=(2.0,), duration=10.0)[2.0][0]
    specs = {req["policy"]: {"kv_policy": {"name": req["policy"], "budget": 1024}}}
    vanilla = traffic.sampling_params(req, "vanilla", specs, 0.7)
    kvsieve = traffic.sampling_params(req, "kvsieve", specs, 0.7)
    assert "custom_params" not in vanilla and vanilla["max_new_tokens"] == req["gen"] and vanilla["ignore_eos"]
    assert kvsieve == {**vanilla, "custom_params": {"kv_policy": {"name": req["policy"], "budget": 1024}}}


def test_the_nofold_variant_is_kvsieve_with_full_rows_on_sglangs_backend(tmp_path, monkeypatch):
    # The A/B engine: the requests' own policies, its own step log, and the
    # one setting that differs (set for the engine, cleared for vanilla).
    req = trace(rates=(2.0,), duration=10.0)[2.0][0]
    specs = {req["policy"]: {"kv_policy": {"name": req["policy"], "budget": 1024}}}
    assert traffic.sampling_params(req, "kvsieve-nofold", specs, 0.7) == traffic.sampling_params(req, "kvsieve",
                                                                                                  specs, 0.7)
    args = SimpleNamespace(out=str(tmp_path / "t.json"))
    assert traffic.step_log_path(args, "kvsieve").endswith("t-steps.jsonl")
    assert traffic.step_log_path(args, "kvsieve-nofold").endswith("t-nofold-steps.jsonl")
    assert traffic.step_log_path(args, "vanilla").endswith("t-steps.jsonl")  # asked for every engine, used by none
    split = {"region_pages": 64, "quantized_pages": 0}
    for key in ("KVSIEVE_FOLD_POOL_ROWS", "KVSIEVE_REGION_PAGES", "KVSIEVE_STEP_LOG"):
        monkeypatch.delenv(key, raising=False)
    env = traffic.set_region_env("kvsieve-nofold", split, traffic.step_log_path(args, "kvsieve-nofold"))
    assert env["KVSIEVE_FOLD_POOL_ROWS"] == "0" and env["KVSIEVE_REGION_PAGES"] == "64"
    assert traffic.set_region_env("kvsieve", split)["KVSIEVE_FOLD_POOL_ROWS"] == "1"
    assert traffic.set_region_env("vanilla", split) == {} and "KVSIEVE_FOLD_POOL_ROWS" not in os.environ
    # The eager-defer A/B: only that setting differs from kvsieve's, and kvsieve sets it back.
    off = traffic.set_region_env("kvsieve-noeagerdefer", split)
    assert off["KVSIEVE_EAGER_DEFER"] == "0" and off["KVSIEVE_FOLD_POOL_ROWS"] == "1"
    assert traffic.set_region_env("kvsieve", split)["KVSIEVE_EAGER_DEFER"] == "1"
    assert traffic.set_region_env("vanilla", split) == {} and "KVSIEVE_EAGER_DEFER" not in os.environ


def test_a_baseline_of_the_same_trace_gives_the_engines_this_call_does_not_run(tmp_path):
    args = traffic.parse_args(["--quick", "--engines", "kvsieve"])
    cfg = vars(args)
    trace = {"2": {"hash": "abc"}}
    split = {"kv_tokens": 8192}
    base = tmp_path / "vanilla.json"
    runs = {"vanilla": {"2": {"goodput_tok_s": 10.0}}, "kvsieve": {"2": {"goodput_tok_s": 1.0}}}
    record = {"kind": "traffic", "comparable": traffic.comparable({**cfg, "engines": ["vanilla", "kvsieve"]}),
              "trace": trace, "memory_split": split, "engines": runs, "commit": "6a171f1", "date": "d",
              "device": "H200"}
    base.write_text(json.dumps(record))
    engines, part = traffic.load_baseline(base, cfg, trace, split, ["kvsieve"])
    assert engines == {"vanilla": runs["vanilla"]}  # what this call runs is its own
    assert part == {"engines": ["vanilla"], "file": str(base), "commit": "6a171f1", "date": "d", "device": "H200"}
    # Another trace, another split, a rate it lacks, another setting: refused, naming why.
    for change, match in (({"trace": {"2": {"hash": "zzz"}}}, "another trace"),
                          ({"memory_split": {"kv_tokens": 1}}, "another KV split"),
                          ({"trace": {}}, "no run of rate"),
                          ({"comparable": traffic.comparable({**cfg, "budget": 99})}, "budget 99")):
        base.write_text(json.dumps({**record, **change}))
        with pytest.raises(SystemExit, match=match):
            traffic.load_baseline(base, cfg, trace, split, ["kvsieve"])
    with pytest.raises(SystemExit, match="no such file"):
        traffic.load_baseline(tmp_path / "none.json", cfg, trace, split, ["kvsieve"])
    # A run-only option: a result made with --baseline compares with one made without.
    assert "baseline" not in traffic.comparable({**cfg, "baseline": str(base)})
