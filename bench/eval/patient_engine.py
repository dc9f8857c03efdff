"""A policy module (`kvsieve serve --policy-module bench.eval.patient_engine`)
that registers no policy: it raises SGLang's scheduler watchdog from 300 s
to $KVSIEVE_EVAL_WATCHDOG_S (default 3600) for the accuracy harness. On an
oversubscribed CPU one forward pass of a batch can stall past 300 s, and
the watchdog then kills the whole server with every request in flight; the
harness measures answers, not latency, so it waits instead."""

from __future__ import annotations

import os

from sglang.srt.server_args import ServerArgs

WATCHDOG_ENV = "KVSIEVE_EVAL_WATCHDOG_S"
_post_init = ServerArgs.__post_init__


def _patient_post_init(self) -> None:
    # Set before SGLang's own checks, which project it into the scheduler's config.
    self.watchdog_timeout = float(os.environ.get(WATCHDOG_ENV, "3600"))
    _post_init(self)


if getattr(_post_init, "__name__", "") != "_patient_post_init":
    ServerArgs.__post_init__ = _patient_post_init
