"""The `kvsieve` command."""

from __future__ import annotations

import argparse
import logging
import sys


def _serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve the OpenAI-compatible API on one engine")
    p.add_argument("--model", help="local HF checkpoint directory (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--served-model-name", help="model id in the API (default: the directory name)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--context-length", type=int, help="cap the model's context length")
    p.add_argument("--max-total-tokens", type=int, default=65536,
                   help="KV pool size in tokens (default 65536; SGLang would size it from memory)")
    p.add_argument("--max-running-requests", type=int)
    p.add_argument("--max-queued-requests", type=int,
                   help="requests waiting past this many get 503 + Retry-After (default: no limit)")
    p.add_argument("--chunked-prefill-size", type=int, help="SGLang's prefill chunk, in tokens")
    p.add_argument("--presets", help="JSON file of named kv_policy presets")
    p.add_argument("--policy-module", action="append", default=[], metavar="MODULE",
                   help="import MODULE to register more policies (@register_policy); repeatable")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvsieve", description="KV-compressed LLM serving on SGLang")
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    sub.add_parser("prepare-model", help="convert the embedded default model (done by serve when needed)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(args, "log_level", "warning").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    if args.command == "serve":
        from .server import serve

        serve(args)
    elif args.command == "prepare-model":
        from .default_model import ensure_default_model

        print(ensure_default_model())
    return 0


if __name__ == "__main__":
    sys.exit(main())
