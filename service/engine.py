"""The SGLang engine behind the API: construction per platform, generation,
abort, shutdown. The only module of the service that talks to SGLang."""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional

from kvsieve.policies import policy_names

logger = logging.getLogger(__name__)


@dataclass
class EngineSettings:
    """What the service needs to start an engine; the rest keeps SGLang's defaults."""

    model_path: str
    device: str = "cpu"  # "cpu" or "cuda"
    context_length: Optional[int] = None
    max_total_tokens: Optional[int] = None
    max_running_requests: Optional[int] = None
    max_queued_requests: Optional[int] = None
    dtype: str = "auto"
    random_seed: int = 0
    log_level: str = "warning"
    tp_size: int = 1
    extra: dict[str, Any] = field(default_factory=dict)

    def engine_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = dict(
            model_path=self.model_path,
            dtype=self.dtype,
            random_seed=self.random_seed,
            log_level=self.log_level,
            enable_metrics=True,
            sampling_backend="pytorch",
        )
        # kvsieve's backend on both: SGLang's own backend (torch_native on CPU,
        # triton on GPU) for uncompressed rows, the compressed region for the
        # others. CUDA graphs stay on for batches without compressed rows.
        if self.device == "cpu":
            # sleep_on_idle: an idle scheduler waits on its sockets instead of
            # spinning, which would take a core from whatever else runs here
            # (the forward passes of a busy neighbour, other replicas).
            kwargs.update(device="cpu", attention_backend="kvsieve", disable_cuda_graph=True, sleep_on_idle=True)
        else:
            kwargs.update(device="cuda", attention_backend="kvsieve")
        if self.tp_size > 1:
            kwargs["tp_size"] = self.tp_size
        for name in ("context_length", "max_total_tokens", "max_running_requests", "max_queued_requests"):
            value = getattr(self, name)
            if value is not None:
                kwargs[name] = value
        kwargs.update(self.extra)
        kwargs.update(sglang_overrides())  # last: the operator's explicit choice
        return kwargs


#: JSON object of further sglang.Engine arguments (SGLang's ServerArgs
#: names), for what kvsieve's settings do not cover, e.g.
#: '{"cuda_graph_backend_prefill": "disabled"}' (no prefill graph capture at start).
SGLANG_ARGS_ENV = "KVSIEVE_SGLANG_ARGS"


def sglang_overrides() -> dict:
    import json

    raw = os.environ.get(SGLANG_ARGS_ENV, "").strip()
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise SystemExit(f"{SGLANG_ARGS_ENV}: not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise SystemExit(f"{SGLANG_ARGS_ENV}: want a JSON object of sglang.Engine arguments, got {raw!r}")
    return value


def prepare_process_environment(device: str, tp_size: int = 1) -> None:
    """Environment SGLang reads at import time; call before importing sglang."""
    if device == "cpu":
        os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
        if tp_size > 1 and "SGLANG_CPU_OMP_THREADS_BIND" not in os.environ:
            os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = cpu_thread_binding(sorted(os.sched_getaffinity(0)), tp_size)
    # SGLang's metrics live in prometheus_client's multiprocess mode (the
    # scheduler is another process); it must be set before prometheus_client
    # is first imported in this process.
    if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
        import tempfile

        os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="kvsieve-prom-")


def cpu_thread_binding(cores: list[int], tp_size: int) -> str:
    """SGLang's per-rank core lists ("0-3|4-7"): equal shares of this
    process's cores, in order (SGLang's own default wants one NUMA node per
    rank, which a laptop does not have)."""
    if tp_size > len(cores):
        raise ValueError(f"tp_size={tp_size}: more CPU ranks than the {len(cores)} cores this process may use")
    share = len(cores) // tp_size
    ranks = [cores[r * share:(r + 1) * share] for r in range(tp_size)]
    def cpulist(rank: list[int]) -> str:
        contiguous = rank[-1] - rank[0] == len(rank) - 1
        return f"{rank[0]}-{rank[-1]}" if contiguous and len(rank) > 1 else ",".join(map(str, rank))
    return "|".join(cpulist(rank) for rank in ranks)


class EngineClient:
    """Thin async facade over sglang.Engine for the HTTP layer."""

    #: Policies this engine runs: the kvsieve attention backend serves every
    #: registered policy, on CPU and on GPU.

    def __init__(self, settings: EngineSettings):
        import sglang

        self.settings = settings
        self.served_policies = frozenset(policy_names())
        self._engine = sglang.Engine(**settings.engine_kwargs())
        info = self._engine.tokenizer_manager
        self.context_length: int = info.context_len
        self.tokenizer = info.tokenizer

    @property
    def child_pids(self) -> list[int]:
        return self._engine.get_all_child_pids()

    async def generate(
        self, input_ids: list[int], sampling_params: dict[str, Any], rid: str
    ) -> AsyncIterator[dict]:
        """Stream SGLang's cumulative outputs for one request."""
        stream = await self._engine.async_generate(
            input_ids=input_ids, sampling_params=sampling_params, rid=rid, stream=True
        )
        task = asyncio.current_task()
        async for chunk in stream:
            # SGLang waits for outputs in asyncio.wait_for, which on Python
            # 3.11 swallows a cancel that lands as an output arrives: a Ray
            # Serve replica (one cancel, no retry) then ran a hung-up request
            # to its end. A cancel still pending here is such a one.
            if task is not None and task.cancelling():
                raise asyncio.CancelledError
            yield chunk

    def route_sigterm_to(self, callback) -> None:
        """Make SIGTERM call `callback` instead of SGLang's own handler.

        SGLang installs its handler on the event loop at the first request; it
        drains and then SIGKILLs its own process tree, parent included. The
        service wants one shutdown path for SIGINT and SIGTERM: stop the HTTP
        server, then shut the engine down, then exit 0.
        """
        from sglang.srt.managers.tokenizer_manager import SignalHandler

        class _RoutedSignalHandler(SignalHandler):
            def sigterm_handler(self, signum=None, frame=None):
                callback()

        self._engine.tokenizer_manager.signal_handler_class = _RoutedSignalHandler

    def abort(self, rid: str) -> None:
        self._engine.tokenizer_manager.abort_request(rid=rid)

    def shutdown(self) -> None:
        self._engine.shutdown()
