"""Tiny random-weight checkpoints (Llama, Qwen3) built at test time.

No downloads: the tokenizer is a byte-level BPE trained here on a small
generated corpus, the weights come from a fixed seed. SGLang loads the
resulting directory like any HF checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _corpus() -> list[str]:
    words = (
        "the model thinks step by step about numbers and words so that every "
        "answer is checked twice before it is written down wait let me verify "
        "one two three four five six seven eight nine ten plus minus equals"
    ).split()
    lines = []
    for i in range(400):
        lines.append(" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(12)))
    return lines


def train_tokenizer(out_dir: Path, vocab_size: int = 512) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)


def build_tiny_model(out_dir: Path, arch: str = "llama", seed: int = 0) -> Path:
    """Write a tiny random checkpoint of `arch` ("llama" or "qwen3") to out_dir."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, Qwen3Config
    from transformers import LlamaForCausalLM, Qwen3ForCausalLM

    out_dir = Path(out_dir)
    if (out_dir / "config.json").exists():
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    train_tokenizer(out_dir)
    tok = AutoTokenizer.from_pretrained(out_dir)
    common = dict(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=16, **common))
    else:
        raise ValueError(f"unknown arch {arch!r}")
    # Random init is small; scale up so greedy decoding is not all one token.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
    model.save_pretrained(out_dir, safe_serialization=True)
    gen = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id}
    (out_dir / "generation_config.json").write_text(json.dumps(gen))
    return out_dir
