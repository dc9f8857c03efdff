"""`kvsieve serve`: start the engine, serve the API, shut everything down.

SIGINT and SIGTERM stop uvicorn gracefully; then the engine and every process
SGLang started are shut down before this process exits.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from pathlib import Path

logger = logging.getLogger("kvsieve")


def _graceful_server_class():
    import uvicorn

    class GracefulServer(uvicorn.Server):
        """uvicorn re-raises a caught SIGINT/SIGTERM once it has stopped, which
        kills this process before the engine's child processes are shut down.
        Here the signal only stops the server; serve() then shuts the engine
        down and returns normally."""

        @contextlib.contextmanager
        def capture_signals(self):
            handled = (signal.SIGINT, signal.SIGTERM)
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    return GracefulServer


def serve(args) -> None:
    from .engine import prepare_process_environment

    prepare_process_environment(args.device, args.tp_size)
    if args.policy_module:
        # In the environment, so SGLang's scheduler process imports them too.
        from kvsieve.policies import POLICY_MODULES_ENV, load_policy_modules

        os.environ[POLICY_MODULES_ENV] = ",".join(args.policy_module)
        load_policy_modules()

    # Imported only now: SGLang and prometheus_client read the environment above.
    import uvicorn

    from .app import create_app
    from .default_model import ensure_default_model
    from .engine import EngineClient, EngineSettings
    from .model_name import export_served_model_name, served_model_name
    from .presets import load_presets

    _GracefulServer = _graceful_server_class()

    presets = load_presets(args.presets)
    model_path = str(Path(args.model).resolve()) if args.model else str(ensure_default_model())
    model_name = served_model_name(args.served_model_name, args.model, model_path)
    export_served_model_name(model_name)

    started = time.monotonic()
    engine = EngineClient(EngineSettings(
        model_path=model_path,
        device=args.device,
        context_length=args.context_length,
        max_total_tokens=args.max_total_tokens,
        max_running_requests=args.max_running_requests,
        max_queued_requests=args.max_queued_requests,
        dtype=args.dtype,
        log_level=args.log_level,
        tp_size=args.tp_size,
        extra={"chunked_prefill_size": args.chunked_prefill_size} if args.chunked_prefill_size else {},
    ))
    logger.warning("engine up in %.1f s: %s (context %d)", time.monotonic() - started, model_name, engine.context_length)
    try:
        app = create_app(engine, model_name, presets)
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                loop="asyncio", timeout_graceful_shutdown=5,
                                # uvicorn's 5 s default closes idle keep-alive connections
                                # while clients and load balancers (60 s idle) still reuse
                                # them: a request sent as the close lands is reset.
                                timeout_keep_alive=75)
        server = _GracefulServer(config)
        engine.route_sigterm_to(lambda: server.handle_exit(signal.SIGTERM, None))
        server.run()
    finally:
        engine.shutdown()
        logger.warning("engine shut down")
