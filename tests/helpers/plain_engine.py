"""Greedy generation with a plain sglang.Engine (no kvsieve server), for
comparisons. Usage: plain_engine.py MODEL_DIR JSON_REQUESTS -> JSON on stdout.

JSON_REQUESTS: [{"input_ids": [...], "max_new_tokens": N, "custom_params": {...}|null}, ...]
"""

import json
import os
import sys

os.environ["SGLANG_USE_CPU_ENGINE"] = "1"


def main() -> None:
    import sglang

    model_dir, requests = sys.argv[1], json.loads(sys.argv[2])
    engine = sglang.Engine(model_path=model_dir, device="cpu", attention_backend="torch_native",
                           sampling_backend="pytorch", disable_cuda_graph=True,
                           max_total_tokens=65536, random_seed=0, log_level="error")
    try:
        results = []
        for r in requests:
            params = {"max_new_tokens": r["max_new_tokens"], "temperature": 0.0, "ignore_eos": True}
            if r.get("custom_params") is not None:
                params["custom_params"] = r["custom_params"]
            out = engine.generate(input_ids=r["input_ids"], sampling_params=params)
            results.append({"output_ids": out["output_ids"], "meta_info": out["meta_info"]})
    finally:
        engine.shutdown()
    print("RESULT " + json.dumps(results))


if __name__ == "__main__":
    main()
