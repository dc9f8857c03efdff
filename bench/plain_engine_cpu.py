"""Baseline for bench/foundation_cpu.py: a plain sglang.Engine in one process,
no HTTP, same model, greedy, ignore_eos. Prints tokens/s for one stream and a
batch of 8.

    .venv/bin/python bench/plain_engine_cpu.py [MODEL_DIR]
"""

import os
import sys
import time

os.environ["SGLANG_USE_CPU_ENGINE"] = "1"

TOKENS = 128


def main() -> None:
    import sglang

    from kvsieve.service.default_model import ensure_default_model

    model = sys.argv[1] if len(sys.argv) > 1 else str(ensure_default_model())
    engine = sglang.Engine(model_path=model, device="cpu", attention_backend="torch_native",
                           sampling_backend="pytorch", disable_cuda_graph=True,
                           max_total_tokens=65536, log_level="error")
    params = {"max_new_tokens": TOKENS, "temperature": 0, "ignore_eos": True}
    prompt = list(range(100, 130))
    try:
        engine.generate(input_ids=prompt, sampling_params={**params, "max_new_tokens": 4})  # warm-up
        t0 = time.monotonic()
        engine.generate(input_ids=prompt, sampling_params=params)
        print(f"single stream: {TOKENS / (time.monotonic() - t0):.1f} tok/s")
        batch = [list(range(100 + i, 130 + i)) for i in range(8)]
        t0 = time.monotonic()
        engine.generate(input_ids=batch, sampling_params=params)
        print(f"batch of 8: {8 * TOKENS / (time.monotonic() - t0):.1f} tok/s")
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
