"""The default GPU memory split, checked in one short device call: an
engine started the way a user starts one (no KVSIEVE_REGION_PAGES, no
--max-running-requests), so kvsieve's workspace is carved from SGLang's KV
budget before the pool/region split (radix_ext/memory_plan.py) and SGLang's
own choice of running requests is lowered to the planned rows. Prints the
split and the lowering (from the scheduler's log), then serves a few
compressed requests; exits non-zero if either line is missing or a request
fails. CUDA graphs off (a fast start: the gate, bench/gpu_smoke.py, runs
them).

    PYTHONPATH=/tmp/site2:/tmp/site python3 bench/gpu_carve_check.py   # R1-Distill-Qwen-7B shape, dummy weights
"""

from __future__ import annotations

import asyncio
import os
import random
import sys
import tempfile
from pathlib import Path

MODEL = Path(__file__).resolve().parent / "models" / "r1-distill-qwen-7b"


async def serve(engine, rows: int) -> list:
    rng = random.Random(0)

    async def one(i):
        ids = [rng.randrange(1000, 100000) for _ in range(64)]
        out = await engine.async_generate(input_ids=ids, sampling_params={
            "max_new_tokens": 96, "temperature": 0.7, "ignore_eos": True,
            "custom_params": {"kv_policy": {"name": ("rkv", "thinkv", "streaming", "crystalcache")[i % 4],
                                            "budget": 132}}})
        return out["meta_info"]["finish_reason"]
    return await asyncio.gather(*(one(i) for i in range(rows)))


def main() -> int:
    import sglang

    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    os.environ.pop("KVSIEVE_REGION_PAGES", None)
    # The scheduler's warnings (the split, the lowering) go to stderr: keep a copy.
    fd = os.dup(2)
    os.dup2(log.fileno(), 2)
    try:
        engine = sglang.Engine(model_path=str(MODEL), load_format="dummy", skip_tokenizer_init=True,
                               attention_backend="kvsieve", sampling_backend="pytorch", log_level="warning",
                               mem_fraction_static=0.85, disable_cuda_graph=True)
        reasons = engine.loop.run_until_complete(serve(engine, 64))
        engine.shutdown()
    finally:
        os.dup2(fd, 2)
    text = Path(log.name).read_text(errors="replace")
    split = [line for line in text.splitlines() if "kvsieve KV memory split" in line]
    lowered = [line for line in text.splitlines() if "max_running_requests lowered" in line]
    print("\n".join(split[:1] + lowered[:1]) or text[-3000:])
    bad = [r for r in reasons if not isinstance(r, dict) or r.get("type") != "length"]
    print(f"{len(reasons)} requests, {len(bad)} not finished by length: {bad[:3]}")
    return 0 if split and lowered and not bad else 1


if __name__ == "__main__":
    sys.exit(main())
