"""What policies learn about the served model (policies.base.ModelInfo),
built once per scheduler process from SGLang's model runner."""

from __future__ import annotations

import logging
from typing import Optional

from kvsieve.policies.base import ModelInfo

from . import head_parallel

logger = logging.getLogger(__name__)

SENTENCE_ENDS = (".", "?", "!")


def _tokenizer(model_runner):
    """The model's tokenizer, or None (skip_tokenizer_init, or none on disk)."""
    args = model_runner.server_args
    if getattr(args, "skip_tokenizer_init", False):
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(args.tokenizer_path or args.model_path,
                                             trust_remote_code=getattr(args, "trust_remote_code", False))
    except Exception as err:  # a model without tokenizer files still serves input_ids
        logger.warning("kvsieve: no tokenizer for policies (%s); sentence-based policies see no sentences", err)
        return None


def delimiter_ids(tokenizer) -> frozenset:
    """Token ids whose text ends a sentence: ".", "?", "!" (stripped) or any "\\n"."""
    ids = set()
    for token_id in range(len(tokenizer)):
        text = tokenizer.decode([token_id])
        stripped = text.strip()
        if "\n" in text or (stripped and stripped[-1] in SENTENCE_ENDS and set(stripped) <= set(".?!\"')")):
            ids.add(token_id)
    return frozenset(ids)


def build_model_info(model_runner, num_layers: int, num_kv_heads: int, head_dim: int) -> ModelInfo:
    config = model_runner.model_config
    tokenizer = _tokenizer(model_runner)
    encode: Optional[callable] = None
    decode: Optional[callable] = None
    delimiters: frozenset = frozenset()
    if tokenizer is not None:
        delimiters = delimiter_ids(tokenizer)

        def encode(text: str) -> list:
            return tokenizer.encode(text, add_special_tokens=False)

        def decode(ids: list) -> str:
            return tokenizer.decode(ids)

    return ModelInfo(
        name=model_runner.server_args.served_model_name or model_runner.server_args.model_path,
        num_layers=num_layers, num_kv_heads=num_kv_heads,
        # This rank's query heads (tensor parallelism splits them like the kv heads).
        num_q_heads=getattr(config, "num_attention_heads", num_kv_heads) // head_parallel.SHARDS.size,
        head_dim=head_dim,
        delimiter_ids=delimiters, encode=encode, decode=decode)
