"""`kvsieve calibrate thinkv --model DIR`: ThinKV's offline calibration
(appendix D.1) on CPU with transformers.

Greedy-decodes a set of reasoning prompts, records for every decode step and
layer the attention sparsity (the share of a query head's probabilities
below 1% of its row's maximum, averaged over the heads: the engine's
definition, kernels/attention_ref.py), runs the KDE analysis
(policies.thinkv.calibration.calibrate) and stores {model, layers,
thresholds} in the store under ("thinkv", model name).

Prompts come from a small seeded generator of arithmetic and logic word
problems written here (no download, no extra dependency).
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Callable, Optional

import numpy as np

SPARSITY_THRESHOLD = 0.01  # as kernels.attention_ref

_NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Fay", "Gus", "Hana"]
_ITEMS = ["apples", "books", "coins", "marbles", "stamps", "pencils"]


def _arithmetic(rng: random.Random) -> str:
    a, b, c = rng.randint(12, 99), rng.randint(2, 9), rng.randint(3, 40)
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    return (f"{name} has {a} {item}. {name} buys {b} boxes with {c} {item} each, then gives away a third of "
            f"everything, rounded down. How many {item} are left?")


def _sequence(rng: random.Random) -> str:
    start, step, ratio = rng.randint(1, 9), rng.randint(2, 7), rng.randint(2, 3)
    terms = [start]
    for i in range(4):
        terms.append(terms[-1] + step if i % 2 == 0 else terms[-1] * ratio)
    return f"Find the next two numbers of the sequence {', '.join(map(str, terms))}, and explain the rule."


def _logic(rng: random.Random) -> str:
    a, b, c = rng.sample(_NAMES, 3)
    return (f"{a} is older than {b}. {c} is younger than {b} but older than the youngest of the three. "
            f"Is that possible? If not, which statement must change, and who is the oldest?")


def _equation(rng: random.Random) -> str:
    x, m, k = rng.randint(2, 20), rng.randint(2, 9), rng.randint(1, 30)
    return f"Solve for x: {m}x + {k} = {m * x + k}. Then check the answer by substituting it back."


GENERATORS = (_arithmetic, _sequence, _logic, _equation)


def calibration_prompts(count: int, seed: int = 0) -> list[str]:
    """`count` reasoning prompts, the same for the same seed."""
    rng = random.Random(seed)
    return [GENERATORS[i % len(GENERATORS)](rng) + " Think step by step before answering." for i in range(count)]


def step_sparsity(attentions) -> np.ndarray:
    """Per layer, the sparsity of one decode query: attentions is the
    model's tuple of [1, Hq, 1, keys] probabilities."""
    out = []
    for p in attentions:
        row = p[0, :, -1, :].float()  # [Hq, keys]
        sparse = (row < SPARSITY_THRESHOLD * row.amax(-1, keepdim=True)).float().mean(-1)
        out.append(float(sparse.mean()))
    return np.array(out)


def sparsity_traces(model_dir: str, prompts: list[str], max_new_tokens: int,
                    progress: Optional[Callable] = None) -> list[np.ndarray]:
    """Greedy decode each prompt on CPU; per prompt a [steps, layers] trace."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    traces = []
    for prompt in prompts:
        if getattr(tok, "chat_template", None):
            ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        else:
            ids = tok.encode(prompt)
        rows = []
        with torch.no_grad():
            out = model(torch.tensor([ids]), use_cache=True)
            for _ in range(max_new_tokens):
                token = out.logits[0, -1].argmax().view(1, 1)
                if tok.eos_token_id is not None and int(token) == tok.eos_token_id:
                    break
                out = model(token, past_key_values=out.past_key_values, use_cache=True, output_attentions=True)
                rows.append(step_sparsity(out.attentions))
                if progress:
                    progress(1)
        traces.append(np.stack(rows) if rows else np.zeros((0, model.config.num_hidden_layers)))
    return traces


def add_parser(sub) -> None:
    p = sub.add_parser("calibrate", help="offline calibration of a policy for a model (stored as an artifact)")
    kinds = p.add_subparsers(dest="kind", required=True)
    t = kinds.add_parser("thinkv", help="ThinKV: the sparsity layers and thought thresholds (appendix D.1)")
    t.add_argument("--model", help="local HF checkpoint directory (default: the embedded SmolLM2-135M-Instruct)")
    t.add_argument("--name", help="model id to store it under (default: the id `kvsieve serve` gives it)")
    t.add_argument("--prompts", type=int, default=32, help="calibration prompts (default 32; the paper: 100)")
    t.add_argument("--max-new-tokens", type=int, default=1024, help="greedy decode steps per prompt (default 1024)")
    t.add_argument("--max-layers", type=int, default=4, help="most calibrated layers kept (default 4)")
    t.add_argument("--seed", type=int, default=0, help="prompt generator seed")
    t.add_argument("--config", help="YAML settings file (store.url)")
    from .auto_calibrate import add_parser as add_auto_parser
    from .calibrate_skipkv import add_parser as add_skipkv_parser

    add_auto_parser(kinds)
    add_skipkv_parser(kinds)


def run(args, open_store) -> int:
    """The `kvsieve calibrate thinkv|auto|skipkv` command; open_store() gives the settings' store."""
    if getattr(args, "kind", "thinkv") == "auto":
        from .auto_calibrate import run as run_auto

        return run_auto(args, open_store)
    if getattr(args, "kind", "thinkv") == "skipkv":
        from .calibrate_skipkv import run as run_skipkv

        return run_skipkv(args, open_store)
    for flag in ("prompts", "max_new_tokens", "max_layers"):
        if getattr(args, flag) < 1:
            print(f"kvsieve calibrate thinkv: --{flag.replace('_', '-')} must be at least 1", file=sys.stderr)
            return 2
    from tqdm import tqdm

    from kvsieve.policies.thinkv.calibration import ARTIFACT_KIND, Calibration, calibrate

    from .default_model import DEFAULT_MODEL_NAME, ensure_default_model

    model_dir = str(Path(args.model).resolve()) if args.model else str(ensure_default_model())
    name = args.name or (Path(model_dir).name if args.model else DEFAULT_MODEL_NAME)
    prompts = calibration_prompts(args.prompts, args.seed)
    with tqdm(total=len(prompts) * args.max_new_tokens, desc=f"thinkv calibration of {name}", unit="step",
              file=sys.stderr) as bar:
        traces = sparsity_traces(model_dir, prompts, args.max_new_tokens, progress=bar.update)
    traces = [t for t in traces if len(t) >= 2]
    try:
        layers, thresholds = calibrate(traces, max_layers=args.max_layers)
    except ValueError as exc:
        print(f"kvsieve calibrate thinkv: {exc}; no artifact written (requests on {name!r} keep the "
              f"fallback)", file=sys.stderr)
        return 1
    artifact = Calibration(model=name, layers=tuple(layers), thresholds=thresholds).to_artifact()
    store = open_store()
    store.put_artifact(ARTIFACT_KIND, name, artifact)
    print(f"thinkv calibration of {name}: layers {layers}, thresholds {thresholds[0]:.4f} {thresholds[1]:.4f} "
          f"({len(traces)} prompts, {sum(len(t) for t in traces)} steps); stored as ({ARTIFACT_KIND!r}, {name!r})")
    return 0
