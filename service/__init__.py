"""OpenAI-compatible API with kv_policy, metrics and the CLI (import kvsieve.service)."""
