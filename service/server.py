"""`kvsieve serve`: start the engine, serve the API, shut everything down.

SIGINT and SIGTERM stop uvicorn gracefully; then the engine and every process
SGLang started are shut down before this process exits.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

logger = logging.getLogger("kvsieve")


def serve(args) -> None:
    from .engine import prepare_process_environment

    prepare_process_environment(args.device)

    # Imported only now: SGLang and prometheus_client read the environment above.
    import uvicorn

    from .app import create_app
    from .default_model import DEFAULT_MODEL_NAME, ensure_default_model
    from .engine import EngineClient, EngineSettings
    from .presets import load_presets

    presets = load_presets(args.presets)
    if args.model:
        model_path = str(Path(args.model).resolve())
        model_name = args.served_model_name or Path(model_path).name
    else:
        model_path = str(ensure_default_model())
        model_name = args.served_model_name or DEFAULT_MODEL_NAME

    started = time.monotonic()
    engine = EngineClient(EngineSettings(
        model_path=model_path,
        device=args.device,
        context_length=args.context_length,
        max_total_tokens=args.max_total_tokens,
        max_running_requests=args.max_running_requests,
        dtype=args.dtype,
        log_level=args.log_level,
    ))
    logger.warning("engine up in %.1f s: %s (context %d)", time.monotonic() - started, model_name, engine.context_length)
    try:
        app = create_app(engine, model_name, presets)
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                loop="asyncio", timeout_graceful_shutdown=5)
        uvicorn.Server(config).run()
    finally:
        engine.shutdown()
        logger.warning("engine shut down")
