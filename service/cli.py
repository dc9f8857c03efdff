"""The `kvsieve` command: serve (one process, or Ray Serve replicas),
prepare-model, the store's presets, keys and artifacts, and calibrate."""

from __future__ import annotations

import argparse
import json
import logging
import sys

# serve flag -> (settings section, field). Flags default to None so that the
# settings (environment, YAML file, defaults) decide unless a flag is given.
_SERVE_FLAGS = {
    "model": ("engine", "model"),
    "served_model_name": ("engine", "served_model_name"),
    "device": ("engine", "device"),
    "dtype": ("engine", "dtype"),
    "context_length": ("engine", "context_length"),
    "max_total_tokens": ("engine", "max_total_tokens"),
    "max_running_requests": ("engine", "max_running_requests"),
    "max_queued_requests": ("engine", "max_queued_requests"),
    "chunked_prefill_size": ("engine", "chunked_prefill_size"),
    "tp_size": ("engine", "tp_size"),
    "presets": ("engine", "presets_file"),
    "policy_module": ("engine", "policy_modules"),
    "host": ("server", "host"),
    "port": ("server", "port"),
    "log_level": ("server", "log_level"),
    "replicas": ("ray", "replicas"),
    "ray_address": ("ray", "address"),
}


def _serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve the OpenAI-compatible API (one engine, or Ray Serve replicas)")
    p.add_argument("--config", help="YAML settings file (also $KVSIEVE_CONFIG); see README 'Settings'")
    p.add_argument("--model", help="local HF checkpoint directory (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--served-model-name", help="model id in the API (default: the directory name)")
    p.add_argument("--host", help="default 127.0.0.1")
    p.add_argument("--port", type=int, help="default 8000")
    p.add_argument("--device", choices=["cpu", "cuda"], help="default cpu")
    p.add_argument("--dtype", help="default auto")
    p.add_argument("--context-length", type=int, help="cap the model's context length")
    p.add_argument("--max-total-tokens", type=int,
                   help="KV pool size in tokens (default 65536; SGLang would size it from memory)")
    p.add_argument("--max-running-requests", type=int)
    p.add_argument("--max-queued-requests", type=int,
                   help="requests waiting past this many get 503 + Retry-After (default: no limit)")
    p.add_argument("--chunked-prefill-size", type=int, help="SGLang's prefill chunk, in tokens")
    p.add_argument("--tp-size", type=int, help="tensor-parallel ranks of the engine (default 1); on CPU each "
                   "rank gets an equal share of the cores")
    p.add_argument("--presets", help="JSON file of named kv_policy presets (beside the store's)")
    p.add_argument("--policy-module", action="append", metavar="MODULE",
                   help="import MODULE to register more policies (@register_policy); repeatable")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="default warning")
    p.add_argument("--replicas", type=int,
                   help="serve through Ray Serve with N engine replicas (Ray in-process unless --ray-address)")
    p.add_argument("--ray-address", help="an existing Ray cluster (ray://host:10001, or auto)")


def _store_parsers(sub) -> None:
    presets = sub.add_parser("presets", help="named kv_policy presets in the store")
    presets.add_argument("--config", help="YAML settings file (store.url)")
    ps = presets.add_subparsers(dest="action", required=True)
    s = ps.add_parser("set", help="create or replace a preset")
    s.add_argument("name")
    s.add_argument("kv_policy", help='a kv_policy JSON object, e.g. \'{"name": "snapkv", "budget": 256}\'')
    ps.add_parser("get").add_argument("name")
    ps.add_parser("list")
    ps.add_parser("delete").add_argument("name")

    keys = sub.add_parser("keys", help="API keys (stored hashed) and their rate limits")
    keys.add_argument("--config", help="YAML settings file (store.url)")
    ks = keys.add_subparsers(dest="action", required=True)
    c = ks.add_parser("create", help="create a key; it is printed once and never stored")
    c.add_argument("name")
    c.add_argument("--rate", type=float, help="requests per second (default: auth.default_rate_per_s)")
    c.add_argument("--burst", type=int, help="bucket size (default: auth.default_burst)")
    ks.add_parser("list")
    ks.add_parser("delete").add_argument("key_id")

    art = sub.add_parser("artifacts", help="calibration artifacts keyed by (kind, model)")
    art.add_argument("--config", help="YAML settings file (store.url)")
    a = art.add_subparsers(dest="action", required=True)
    put = a.add_parser("put", help="store a JSON file as the artifact of (kind, model)")
    put.add_argument("kind")
    put.add_argument("model")
    put.add_argument("file")
    get = a.add_parser("get")
    get.add_argument("kind")
    get.add_argument("model")
    a.add_parser("list")


def _serve_settings(args):
    from .config import load_settings

    overrides: dict = {}
    for flag, (section, name) in _SERVE_FLAGS.items():
        value = getattr(args, flag, None)
        if value is not None:
            overrides.setdefault(section, {})[name] = value
    return load_settings(args.config, **overrides)


def _serve(args) -> int:
    from .config import ConfigError

    try:
        settings = _serve_settings(args)
    except ConfigError as exc:
        print(f"kvsieve serve: {exc}", file=sys.stderr)
        return 2
    logging.getLogger().setLevel(settings.server.log_level.upper())
    if settings.ray.enabled:
        from .scale.launch import serve_ray

        serve_ray(settings)
        return 0
    from .server import serve

    # The single process reads its engine options from args.
    e, s = settings.engine, settings.server
    args.model, args.served_model_name, args.device, args.dtype = e.model, e.served_model_name, e.device, e.dtype
    args.context_length, args.max_total_tokens = e.context_length, e.max_total_tokens
    args.max_running_requests, args.max_queued_requests = e.max_running_requests, e.max_queued_requests
    args.chunked_prefill_size, args.presets, args.policy_module = e.chunked_prefill_size, e.presets_file, e.policy_modules
    args.tp_size = e.tp_size
    args.host, args.port, args.log_level = s.host, s.port, s.log_level
    serve(args)
    return 0


def _open_store(args):
    from .config import load_settings
    from .store import open_store

    settings = load_settings(args.config)
    return open_store(settings.store.url, settings.store.timeout_s)


def _presets(args) -> int:
    store = _open_store(args)
    if args.action == "set":
        from .presets import validate_presets  # imports the policies (and torch): only here

        try:
            value = json.loads(args.kv_policy)
            validate_presets({args.name: value})
        except (json.JSONDecodeError, ValueError) as exc:
            print(f"kvsieve presets set: {exc}", file=sys.stderr)
            return 2
        store.set_preset(args.name, value)
    elif args.action == "get":
        value = store.get_preset(args.name)
        if value is None:
            print(f"no preset {args.name!r}", file=sys.stderr)
            return 1
        print(json.dumps(value))
    elif args.action == "list":
        for name, value in sorted(store.list_presets().items()):
            print(f"{name}\t{json.dumps(value)}")
    elif args.action == "delete":
        if not store.delete_preset(args.name):
            print(f"no preset {args.name!r}", file=sys.stderr)
            return 1
    return 0


def _keys(args) -> int:
    from .auth import new_key

    store = _open_store(args)
    if args.action == "create":
        key, record = new_key(args.name, args.rate, args.burst)
        store.put_key(record)
        print(key)  # the only time the key exists outside the client
        print(f"key id {record.key_id}; stored as its SHA-256 only", file=sys.stderr)
    elif args.action == "list":
        for key_id, rec in sorted(store.list_keys().items()):
            print(f"{key_id}\t{rec.name}\trate={rec.rate_per_s or 'default'}\tburst={rec.burst or 'default'}")
    elif args.action == "delete":
        if not store.delete_key(args.key_id):
            print(f"no key {args.key_id!r}", file=sys.stderr)
            return 1
    return 0


def _artifacts(args) -> int:
    from pathlib import Path

    store = _open_store(args)
    if args.action == "put":
        store.put_artifact(args.kind, args.model, json.loads(Path(args.file).read_text()))
    elif args.action == "get":
        data = store.get_artifact(args.kind, args.model)
        if data is None:
            print(f"no artifact {args.kind!r} for {args.model!r}", file=sys.stderr)
            return 1
        print(json.dumps(data))
    elif args.action == "list":
        for kind, model in store.list_artifacts():
            print(f"{kind}\t{model}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvsieve", description="KV-compressed LLM serving on SGLang")
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    sub.add_parser("prepare-model", help="convert the embedded default model (done by serve when needed)")
    _store_parsers(sub)
    from .calibrate import add_parser as _calibrate_parser

    _calibrate_parser(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(level=(getattr(args, "log_level", None) or "warning").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    if args.command == "serve":
        return _serve(args)
    if args.command == "prepare-model":
        from .default_model import ensure_default_model

        print(ensure_default_model())
        return 0
    from .config import ConfigError
    from .store import StoreUnavailable

    try:
        if args.command == "calibrate":
            from .calibrate import run as calibrate

            return calibrate(args, lambda: _open_store(args))
        return {"presets": _presets, "keys": _keys, "artifacts": _artifacts}[args.command](args)
    except (ConfigError, StoreUnavailable) as exc:
        print(f"kvsieve {args.command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
