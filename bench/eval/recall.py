"""Top-10 attended-token recall (ThinKV §6.3, after Quest): at a decode step,
the fraction of the 10 keys with the highest full attention that the
compressed cache still holds, per layer and kv head (attention summed over
the head's query group), averaged over sampled steps, heads and layers.

Two halves:
- the engine side: each request runs solo through a real `kvsieve serve`
  started with the recall probe (recall_probe.py), which records, every
  `every` decode steps, the positions each layer and kv head attended to;
- the reference side: the same model in transformers (eager attention,
  float32) runs teacher-forced over the request's prompt and the tokens the
  compressed run generated, and gives each sampled query's full attention
  over every earlier token, evicted ones included.

  python -m bench.eval recall --out bench/results/eval-smollm2-recall.json \\
      --policies thinkv,crystal_kv,skipkv,rkv --budgets 64,128 --math 8
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path
from statistics import mean
from typing import Optional

TOP_K = 10


def add_parser(sub) -> None:
    p = sub.add_parser("recall", help="top-10 attended-token recall of policies at budgets (ThinKV §6.3)")
    p.add_argument("--out", required=True, help="results JSON (resumed when it exists)")
    p.add_argument("--model", help="local HF checkpoint directory (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--policies", required=True, help="comma list of compressing policies")
    p.add_argument("--budgets", required=True, help="comma list: N tokens or ref (no eviction)")
    p.add_argument("--tasks", default="math", help="comma list of math, needle, da")
    p.add_argument("--math", type=int, default=8)
    p.add_argument("--math-max-tokens", type=int, default=512)
    p.add_argument("--needle-lengths", default="1024")
    p.add_argument("--needle-depths", default="0.5")
    p.add_argument("--da-distances", default="1024")
    p.add_argument("--every", type=int, default=16, help="record every N decode steps (default 16)")
    p.add_argument("--serve-arg", action="append", default=[], metavar="ARG")


def recall_of_steps(attentions, record: dict, group: int, k: int = TOP_K) -> Optional[dict]:
    """Recall of one request: `attentions` is transformers' per-layer
    [1, Hq, T, T] of the teacher-forced sequence; `record` the probe's
    line. {"recall": mean, "per_layer": [...], "steps": n} or None when no
    step was recorded."""
    import torch

    per_layer: list[list[float]] = [[] for _ in attentions]
    for q_text, step in record["steps"].items():
        q = int(q_text)
        prefix = step["prefix"]
        for layer, heads in enumerate(step["layers"]):
            probs = attentions[layer][0, :, q, : q + 1].float()  # [Hq, q+1]
            kv_heads = probs.view(len(heads), group, -1).sum(dim=1)  # [H, q+1]
            kk = min(k, q + 1)
            top = kv_heads.topk(kk, dim=-1).indices.tolist()
            for h, positions in enumerate(heads):
                held = set(positions)
                hit = sum(1 for p in top[h] if p < prefix or p in held)
                per_layer[layer].append(hit / kk)
    if not per_layer[0]:
        return None
    layer_means = [mean(x) for x in per_layer if x]
    return {"recall": mean(layer_means), "per_layer": [round(x, 4) for x in layer_means],
            "steps": len(record["steps"])}


class Reference:
    """The model in transformers, eager attention, float32: full attention
    of a token sequence, teacher-forced."""

    def __init__(self, model_dir: str):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32,
                                                          attn_implementation="eager").eval()
        cfg = self.model.config
        self.group = cfg.num_attention_heads // cfg.num_key_value_heads

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        ids = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    def attentions(self, ids: list[int]):
        import torch

        with torch.no_grad():
            out = self.model(torch.tensor([ids]), output_attentions=True, use_cache=False)
        return out.attentions


def _next_line(folder: Path, seen: int, timeout: float = 120) -> dict:
    """The probe's line number `seen` (requests end in order when run solo)."""
    deadline = time.monotonic() + timeout
    while True:
        lines = []
        for f in sorted(folder.glob("recall-*.jsonl")):
            lines += [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
        lines.sort(key=lambda x: x["seq"])
        if len(lines) > seen:
            return lines[seen]
        if time.monotonic() > deadline:
            raise TimeoutError(f"no probe record {seen} in {folder}")
        time.sleep(0.2)


def run(args) -> int:
    from tqdm import tqdm

    from .runner import REF_SLACK, new_meta
    from .server import Client, serve
    from .tasks import TaskConfig, build_items

    if args.model:
        model_dir = str(Path(args.model).resolve())
    else:
        from kvsieve.service.default_model import ensure_default_model

        model_dir = str(ensure_default_model())
    ref = Reference(model_dir)
    lengths = tuple(int(x) for x in args.needle_lengths.split(","))
    cfg = TaskConfig(math=args.math, math_max_tokens=args.math_max_tokens, needle_lengths=lengths,
                     needle_depths=tuple(float(x) for x in args.needle_depths.split(",")), needle_reps=1,
                     da_distances=tuple(int(x) for x in args.da_distances.split(",")), da_samples=1)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    items = build_items(tasks, cfg, lambda s: len(ref.tok.encode(s, add_special_tokens=False)))
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    budgets = [b.strip() for b in args.budgets.split(",") if b.strip()]
    out = Path(args.out)
    data = json.loads(out.read_text()) if out.exists() else {"cells": {}}
    command = "python -m bench.eval " + " ".join(sys.argv[1:])
    meta = new_meta("", model_dir, cfg.to_json(), command, 1)
    meta.update(every=args.every, top_k=TOP_K, reference="transformers, eager attention, float32, teacher-forced")
    data["meta"] = {**data.get("meta", {}), **meta}
    jobs = [(t, p, b, it) for p in policies for b in budgets for t in tasks for it in items[t]]
    todo = [j for j in jobs if j[3].id not in data["cells"].get(f"{j[0]}|{j[1]}|{j[2]}", {}).get("records", {})]
    if not todo:
        print(f"{out}: nothing to run", file=sys.stderr)
        return 0
    probe_dir = Path(tempfile.mkdtemp(prefix="kvsieve-recall-"))
    env = {"KVSIEVE_RECALL_DIR": str(probe_dir), "KVSIEVE_RECALL_EVERY": str(args.every)}
    extra = ("--policy-module", "bench.eval.recall_probe", *args.serve_arg)
    seen = 0
    with serve(model_dir, extra, env=env) as url:
        client = Client(url)
        data["meta"]["model"] = client.model
        for task, policy, budget, item in tqdm(todo, desc="recall", unit="req", file=sys.stderr):
            spec = {"name": policy, "compress_prompt": task != "math" or None}
            spec = {k: v for k, v in spec.items() if v is not None}
            prompt = ref.prompt_ids(item.messages)
            spec["budget"] = len(prompt) + item.max_tokens + REF_SLACK if budget == "ref" else int(budget)
            resp = client.chat(item.messages, item.max_tokens, spec)
            cell = data["cells"].setdefault(f"{task}|{policy}|{budget}",
                                            {"task": task, "policy": policy, "budget": budget, "records": {}})
            if "error" in resp:
                cell["records"][item.id] = {"kv_policy": spec, "error": resp["error"], "status": resp["status"]}
            else:
                record = _next_line(probe_dir, seen)
                seen += 1
                output = resp["choices"][0]["token_ids"]
                entry = {"kv_policy": spec, "prompt_tokens": resp["usage"]["prompt_tokens"],
                         "completion_tokens": len(output), "kv_usage": resp["kv_usage"]}
                if resp["usage"]["prompt_tokens"] != len(prompt):
                    entry["error"] = f"prompt ids differ: engine {resp['usage']['prompt_tokens']}, here {len(prompt)}"
                else:
                    got = recall_of_steps(ref.attentions(prompt + output), record, ref.group)
                    entry.update(got or {"recall": None, "steps": 0})
                cell["records"][item.id] = entry
            for c in data["cells"].values():
                rs = [r["recall"] for r in c["records"].values() if r.get("recall") is not None]
                c["recall"] = round(mean(rs), 4) if rs else None
            tmp = out.with_name(f".{out.name}.tmp")
            tmp.write_text(json.dumps(data, indent=1))
            os.replace(tmp, out)
        client.close()
    for key, c in sorted(data["cells"].items()):
        print(f"{key}: top-{TOP_K} recall {c['recall']}", file=sys.stderr)
    return 0
