"""kvsieve: per-request KV-cache compression for reasoning models, served by SGLang."""

__version__ = "0.1.0"
SGLANG_VERSION = "0.5.17"
