"""`kvsieve calibrate skipkv --model DIR`: SkipKV's steering vectors on CPU
with transformers (policies.skipkv.steering_vectors).

Each labelled trace of service/reasoning_traces.py is fed to the model after
its problem, in the model's chat template (the trace as the assistant's
turn), one forward with every layer's hidden states. A sentence's feature at
layer l is the hidden state at its closing newline token, where the engine
adds α·s (`--pool newline`, the default **(decision)**), or the mean over its
tokens (`--pool mean`). s_l = mean over execution sentences minus mean over
the others, for every layer; stored under ("skipkv", model name) with the
default layer (two thirds of the depth, or --layer).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Callable, Optional

POOLS = ("newline", "mean")


def add_parser(kinds) -> None:
    s = kinds.add_parser("skipkv", help="SkipKV: the steering vectors (execution minus other sentences, per layer)")
    s.add_argument("--model", help="local HF checkpoint directory (default: the embedded SmolLM2-135M-Instruct)")
    s.add_argument("--name", help="model id to store it under (default: the id `kvsieve serve` gives it)")
    s.add_argument("--traces", type=int, default=64, help="labelled reasoning traces (default 64)")
    s.add_argument("--seed", type=int, default=0, help="trace generator seed")
    s.add_argument("--pool", choices=POOLS, default="newline",
                   help="a sentence's feature: the hidden state at its newline (default) or its tokens' mean")
    s.add_argument("--layer", type=int, help="default layer of requests (default: two thirds of the depth)")
    s.add_argument("--config", help="YAML settings file (store.url)")


def _encode_chat(tok, problem: str) -> list[int]:
    if getattr(tok, "chat_template", None):
        ids = tok.apply_chat_template([{"role": "user", "content": problem}], add_generation_prompt=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    return tok.encode(problem + "\n")


def sentence_features(model_dir: str, traces, pool: str = "newline",
                      progress: Optional[Callable] = None) -> tuple[list, list[bool], int]:
    """Per sentence of every trace its [num_layers, hidden] feature and
    whether it is an execution sentence; and the model's layer count."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .reasoning_traces import EXECUTION

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    features, execution = [], []
    for trace in traces:
        ids = _encode_chat(tok, trace.problem)
        spans = []
        for text, label in trace.sentences:
            piece = tok.encode(text + "\n", add_special_tokens=False)
            spans.append((len(ids), len(ids) + len(piece), label == EXECUTION))
            ids += piece
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_hidden_states=True)
        # hidden_states[0] is the embeddings; [l + 1] the output of decoder layer l.
        layers = torch.stack(out.hidden_states[1:])[:, 0]  # [L, T, H]
        for start, end, is_execution in spans:
            features.append(layers[:, end - 1] if pool == "newline" else layers[:, start:end].mean(1))
            execution.append(is_execution)
        if progress:
            progress(1)
    return features, execution, model.config.num_hidden_layers


def run(args, open_store) -> int:
    if args.traces < 2:
        print("kvsieve calibrate skipkv: --traces must be at least 2", file=sys.stderr)
        return 2
    from tqdm import tqdm

    from kvsieve.policies.skipkv.steering_vectors import ARTIFACT_KIND, SteeringVectors, class_mean_difference, \
        default_layer

    from .default_model import DEFAULT_MODEL_NAME, ensure_default_model
    from .reasoning_traces import traces as make_traces

    model_dir = str(Path(args.model).resolve()) if args.model else str(ensure_default_model())
    name = args.name or (Path(model_dir).name if args.model else DEFAULT_MODEL_NAME)
    from transformers import AutoConfig

    num_layers = AutoConfig.from_pretrained(model_dir).num_hidden_layers
    layer = default_layer(num_layers) if args.layer is None else args.layer
    if not 0 <= layer < num_layers:
        print(f"kvsieve calibrate skipkv: --layer must be in [0, {num_layers})", file=sys.stderr)
        return 2
    traces = make_traces(args.traces, args.seed)
    with tqdm(total=len(traces), desc=f"skipkv steering calibration of {name}", unit="trace", file=sys.stderr) as bar:
        features, execution, num_layers = sentence_features(model_dir, traces, args.pool, progress=bar.update)
    try:
        s = class_mean_difference(features, execution)
    except ValueError as exc:
        print(f"kvsieve calibrate skipkv: {exc}; no artifact written", file=sys.stderr)
        return 1
    counts = {"execution": sum(execution), "other": len(execution) - sum(execution), "traces": len(traces)}
    vectors = SteeringVectors(model=name, vectors=s, default_layer=layer, counts=counts)
    artifact = vectors.to_artifact(pool=args.pool, seed=args.seed, created=time.time())
    open_store().put_artifact(ARTIFACT_KIND, name, artifact)
    print(f"skipkv steering calibration of {name}: {num_layers} layers, default layer {layer} "
          f"(|s| = {float(s[layer].norm()):.3f}), {counts['execution']} execution and {counts['other']} other "
          f"sentences from {len(traces)} traces; stored as ({ARTIFACT_KIND!r}, {name!r})")
    return 0
