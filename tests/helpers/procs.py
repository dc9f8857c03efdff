"""Process-tree measurements shared by the server tests."""

from __future__ import annotations

import psutil


def tree_cpu_seconds(proc: psutil.Process | int) -> float:
    """User + system CPU seconds of a process and its descendants (a server
    and its SGLang processes); processes that end meanwhile count as 0."""
    root = psutil.Process(proc) if isinstance(proc, int) else proc
    total = 0.0
    for p in [root, *root.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total
