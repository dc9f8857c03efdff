"""bench/gpu_replicas.py (issue #31: `kvsieve serve --replicas N` on GPUs):
its set-up order, the model copy with a tokenizer the ingress can load, the
radix figures; and `--quick`, the same code path on CPU end to end: Ray
Serve with two engine replicas of the embedded model, a trace replayed
through the ingress, a replica killed mid-stream and brought back."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("gpu_replicas", REPO / "bench/gpu_replicas.py")
gpu_replicas = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_replicas)


def test_setups_run_the_baseline_first_and_kill_on_the_first_multi_replica_one():
    args = gpu_replicas.parse_args([])
    assert args.device == "cuda" and args.replicas == [1, 2] and args.routings == ["prefix", "pow2"]
    setups = gpu_replicas.setups_of(args)
    assert [(s["name"], s["kill"]) for s in setups] == [("n1-prefix", False), ("n2-prefix", True), ("n2-pow2", False)]
    assert args.routing_tokens == 32  # the router hashes inside the shared prefix
    quick = gpu_replicas.parse_args(["--quick"])
    assert quick.device == "cpu" and [s["name"] for s in gpu_replicas.setups_of(quick)] == ["n2-prefix"]
    assert quick.routing_tokens < quick.prefix_tokens
    assert not any(s["kill"] for s in gpu_replicas.setups_of(gpu_replicas.parse_args(["--no-kill"])))
    with pytest.raises(SystemExit):
        gpu_replicas.parse_args(["--routings", "random"])


def test_the_gpu_model_copy_has_a_tokenizer_of_the_models_vocabulary(tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    monkeypatch.setattr(gpu_replicas.tempfile, "gettempdir", lambda: str(tmp_path))
    args = gpu_replicas.parse_args([])
    model, path, shape = gpu_replicas.prepare_model(args)
    assert Path(model) == path and path.parent == tmp_path
    config = json.loads((path / "config.json").read_text())
    assert config == json.loads((REPO / "bench/models/r1-distill-qwen-7b/config.json").read_text())
    tok = AutoTokenizer.from_pretrained(path)
    assert len(tok) == shape["vocab"] == 152064  # the ingress accepts every id the model has
    assert tok.eos_token_id == config["eos_token_id"]


def test_radix_figures_count_requests_that_ended_with_a_usage():
    recs = [{"api_usage": {"prompt_tokens": 100, "prompt_tokens_details": {"cached_tokens": 60}}, "error": None,
             "shared": 80},
            {"api_usage": {"prompt_tokens": 50, "prompt_tokens_details": {"cached_tokens": 0}}, "error": None,
             "shared": 40},
            {"api_usage": None, "error": "replica_failed: ...", "shared": 80}]
    out = gpu_replicas.radix_figures(recs, None)
    assert out["radix_hit_rate"] == 0.4 and out["shared_fraction"] == 0.8 and out["requests_with_usage"] == 2


@pytest.mark.timeout(900)
def test_quick_runs_ray_serve_replicas_load_and_a_kill_on_cpu(tmp_path):
    out = tmp_path / "gpu-replicas.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench/gpu_replicas.py"), "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=850, cwd=REPO)
    print(proc.stdout[-4000:])
    assert out.exists(), proc.stderr[-4000:]
    result = json.loads(out.read_text())
    logs = "".join(p.read_text(errors="replace")[-3000:] for p in tmp_path.glob("*.log"))
    assert proc.returncode == 0 and result["ok"], (proc.stdout[-3000:], proc.stderr[-3000:], logs)
    setup = result["setups"]["n2-prefix"]
    load = setup["load"]
    assert setup["status"] == "done" and load["errors"] == 0 and load["completed"] == load["offered"] > 0
    assert load["goodput_tok_s"] > 0 and load["tpot_p50_ms"] is not None
    assert load["radix_hit_rate"] is not None and len(load["requests_per_replica"]) == 2
    # The engines' own TTFT (from arrival at the replica) is part of the client's.
    assert 0 < load["engine_ttft_mean_s"] <= load["client_ttft_mean_s"]
    kill = result["kill"]
    assert kill["ok"] and kill["finished"] > 0 and kill["failed"] == kill["failed_cleanly"] > 0
    assert kill["recovered"] and kill["victim_pid"] not in kill["replica_pids_after"]
    assert all(code == 200 for code in kill["new_requests_during_outage"])
    assert setup["exit_code"] == 0
