"""GPU smoke check of the kvsieve plugin inside real SGLang 0.5.17 on CUDA
(run through the device tool; see ../shared/gpu/README.md).

1. attention_backend="triton" (what `kvsieve serve --device cuda` runs):
   the plugin's scheduler hooks are loaded; `full` requests run and a
   compressing kv_policy is refused by name, not run as full.
2. attention_backend="kvsieve" on CUDA (the reference path, not the GPU
   kernel): h2o with a budget above the length equals full token for token;
   h2o with a small budget completes and keeps its budget.

    python bench/gpu_smoke.py MODEL_DIR OUT.json
"""

from __future__ import annotations

import json
import sys
import time


def run(model: str, backend: str, requests: list[dict]) -> dict:
    import sglang as sgl

    from kvsieve.radix_ext.usage import last_kv_usage

    started = time.monotonic()
    engine = sgl.Engine(model_path=model, attention_backend=backend, sampling_backend="pytorch",
                        disable_cuda_graph=True, mem_fraction_static=0.3, log_level="warning")
    up = time.monotonic() - started
    try:
        outputs = []
        for r in requests:
            params = {"max_new_tokens": r["tokens"], "temperature": 0, "ignore_eos": True,
                      "custom_params": {"kv_policy": r["policy"]}}
            try:
                out = engine.generate(input_ids=r["prompt"], sampling_params=params)
            except ValueError as exc:  # the engine's abort (e.g. a refused kv_policy) reaches us as this
                outputs.append({"policy": r["policy"], "refused": str(exc)})
                continue
            meta = out["meta_info"]
            outputs.append({"policy": r["policy"], "output_ids": out.get("output_ids"),
                            "finish_reason": meta.get("finish_reason"),
                            "kv_usage": last_kv_usage(meta)})
        # A batch at once, of the requests the engine runs: the hooks on a mixed running batch.
        ran = [r for r, o in zip(requests, outputs) if "refused" not in o]
        batch = engine.generate(input_ids=[r["prompt"] for r in ran],
                                sampling_params=[{"max_new_tokens": r["tokens"], "temperature": 0, "ignore_eos": True,
                                                  "custom_params": {"kv_policy": r["policy"]}} for r in ran])
        return {"backend": backend, "engine_start_s": round(up, 1), "outputs": outputs,
                "batch_finish": [b["meta_info"].get("finish_reason") for b in batch],
                "batch_output_ids": [b.get("output_ids") for b in batch]}
    finally:
        engine.shutdown()


def main() -> None:
    model, out_path = sys.argv[1], sys.argv[2]
    import torch

    prompt = [5, 6, 7, 8, 9, 10, 11, 12]
    results = {"device": torch.cuda.get_device_name(0), "date": time.strftime("%Y-%m-%d"),
               "command": "python bench/gpu_smoke.py " + " ".join(sys.argv[1:])}
    results["triton"] = run(model, "triton", [
        {"prompt": prompt, "tokens": 24, "policy": "full"},
        {"prompt": prompt, "tokens": 24, "policy": {"name": "h2o", "budget": 16}},
    ])
    results["kvsieve"] = run(model, "kvsieve", [
        {"prompt": prompt, "tokens": 40, "policy": "full"},
        {"prompt": prompt, "tokens": 40, "policy": {"name": "h2o", "budget": 256}},
        {"prompt": prompt, "tokens": 40, "policy": {"name": "h2o", "budget": 8}},
        {"prompt": prompt, "tokens": 40, "policy": {"name": "streaming", "budget": 8}},
    ])
    t, k = results["triton"]["outputs"], results["kvsieve"]["outputs"]
    results["checks"] = {
        "triton_full_completes": t[0]["finish_reason"]["type"] == "length",
        "triton_refuses_compressing_policy": t[1].get("refused", "").startswith("kv_policy:"),
        "kvsieve_h2o_large_budget_equals_full": k[1]["output_ids"] == k[0]["output_ids"],
        "kvsieve_batch_equals_solo": results["kvsieve"]["batch_output_ids"] == [o["output_ids"] for o in k],
        "kvsieve_small_budgets_complete": all(o["finish_reason"]["type"] == "length" for o in k[2:]),
        "kvsieve_small_budget_retained": [o["kv_usage"] and o["kv_usage"].get("retained_tokens") for o in k[2:]],
    }
    with open(out_path, "w") as f:
        json.dump(results, f, indent=2)
    print(json.dumps(results["checks"], indent=2))


if __name__ == "__main__":
    main()
