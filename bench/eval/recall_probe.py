"""Records which KV positions each compressed request could attend to, for
the top-10 attended-token recall (ThinKV §6.3). A policy module:
`kvsieve serve --policy-module bench.eval.recall_probe` with
$KVSIEVE_RECALL_DIR set wraps every registered compressing policy (names
and decisions unchanged) so that, every $KVSIEVE_RECALL_EVERY decode steps
(default 16), each layer's decision hook records the positions of the
row's valid slots per kv head: the tokens the step's query attended to
(select_decode / observe_decode run after the new token is stored and has
taken part in attention, before this step's eviction). Positions below the
request's private part (its prefix in SGLang's radix cache) are never
evicted; the record carries that prefix length.

One JSON line per request, written when it ends, to
$KVSIEVE_RECALL_DIR/recall-<pid>.jsonl:
  {"policy", "seq", "steps": {query position: {"prefix": n, "layers": [[positions of head 0], ...]}}}
`seq` counts the requests this process ended: run the probed requests one
at a time to match records to requests. Without $KVSIEVE_RECALL_DIR the
module changes nothing. Recording copies every sampled layer's view to the
host: a measurement server only.
"""

from __future__ import annotations

import functools
import json
import os
import threading
from pathlib import Path

from kvsieve.policies import get_policy, policy_names

RECALL_DIR_ENV = "KVSIEVE_RECALL_DIR"
RECALL_EVERY_ENV = "KVSIEVE_RECALL_EVERY"

_lock = threading.Lock()
_by_pool_row: dict[int, tuple[object, int]] = {}  # pool row -> (request state, private tokens so far)
_steps: dict[int, dict] = {}  # id(request state) -> {query position: record}
_ended = 0


def _record(batch, view) -> None:
    every = int(os.environ.get(RECALL_EVERY_ENV, "16"))
    if batch.pool_rows is None:
        return
    steps = batch.step.tolist()
    pool_rows = batch.pool_rows.tolist()
    for r, (step, pool_row) in enumerate(zip(steps, pool_rows)):
        if step % every or pool_row not in _by_pool_row:
            continue
        state, private = _by_pool_row[pool_row]
        valid = view.valid[r]
        position = view.position[r]
        heads = [position[h][valid[h]].tolist() for h in range(valid.shape[0])]
        query = max(max(p) for p in heads if p)  # the step's own token is stored before the decision
        entry = _steps.setdefault(id(state), {}).setdefault(query, {"prefix": query + 1 - private, "layers": {}})
        entry["layers"][batch.layer] = heads


def _wrap_step_inputs(fn):
    @functools.wraps(fn)
    def step_inputs(self, rows, device):
        for row in rows:
            if not row.prefill:
                _by_pool_row[row.pool_row] = (row.state, row.private_tokens)
        return fn(self, rows, device)
    step_inputs.__recall_probe__ = True
    return step_inputs


def _wrap_decision(fn):
    @functools.wraps(fn)
    def decision(self, batch, view, obs):
        _record(batch, view)
        return fn(self, batch, view, obs)
    decision.__recall_probe__ = True
    return decision


def _wrap_end_request(fn):
    @functools.wraps(fn)
    def end_request(self, state):
        global _ended
        steps = _steps.pop(id(state), {})
        for pool_row, (s, _) in list(_by_pool_row.items()):
            if s is state:
                del _by_pool_row[pool_row]
        with _lock:
            line = {"policy": self.name, "seq": _ended, "pid": os.getpid(),
                    "steps": {str(q): {"prefix": e["prefix"], "layers": [e["layers"][k] for k in sorted(e["layers"])]}
                              for q, e in sorted(steps.items())}}
            _ended += 1
            path = Path(os.environ[RECALL_DIR_ENV]) / f"recall-{os.getpid()}.jsonl"
            with open(path, "a") as f:
                f.write(json.dumps(line, separators=(",", ":")) + "\n")
        return fn(self, state)
    end_request.__recall_probe__ = True
    return end_request


def _unwrapped(cls, name):
    fn = getattr(cls, name)
    return fn.__wrapped__ if getattr(fn, "__recall_probe__", False) else fn


def install() -> list[str]:
    """Wrap every registered compressing policy; the names wrapped."""
    wrapped = []
    for name in policy_names():
        cls = get_policy(name)
        if not cls.compresses:
            continue
        cls.step_inputs = _wrap_step_inputs(_unwrapped(cls, "step_inputs"))
        cls.select_decode = _wrap_decision(_unwrapped(cls, "select_decode"))
        # Wrapped, observe_decode is no longer Policy's no-op, so the engine
        # calls it for the rows whose decision is not due: they are recorded too.
        cls.observe_decode = _wrap_decision(_unwrapped(cls, "observe_decode"))
        cls.end_request = _wrap_end_request(_unwrapped(cls, "end_request"))
        wrapped.append(name)
    return wrapped


if os.environ.get(RECALL_DIR_ENV):
    install()
