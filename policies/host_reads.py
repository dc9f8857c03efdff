"""Reading device values on the host without waiting for the GPU.

A policy whose host state follows device values (crystal_kv's end-of-think
marker, thinkv's thought types, skipkv's sentences) used to read them with
`.tolist()` between steps: each read waits for every kernel queued before
it, so the host could not prepare step N+1 while the GPU ran step N
(SGLang's overlap scheduler), and one read per request made it hundreds of
waits a step.

A `HostCopy` starts the copy to pinned host memory where the value is made
(inside the forward, on its stream) and records an event behind it. The
reader takes the values one forward later: by then the GPU has finished the
forward that made them, so nothing waits (if it has not, `values` waits for
that copy only). Taking them after a fixed number of a request's own
forwards, not "whenever landed", keeps a request's decisions the same on
any device and in any batch.
"""

from __future__ import annotations

from typing import Optional

import torch


class HostCopy:
    """One device tensor on its way to the host."""

    def __init__(self, value: torch.Tensor):
        if value.device.type == "cuda":
            self._host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
            self._host.copy_(value, non_blocking=True)
            self._event: Optional[torch.cuda.Event] = torch.cuda.Event()
            self._event.record()
        else:
            self._host, self._event = value.clone(), None  # the producer may write into value later
        self._values: Optional[list] = None

    @property
    def landed(self) -> bool:
        return self._event is None or self._event.query()

    def tensor(self) -> torch.Tensor:
        """The copy on the host (CPU tensor)."""
        if self._event is not None:
            self._event.synchronize()  # this copy only; asked a forward later, it has landed
            self._event = None
        return self._host

    def values(self) -> list:
        """The copied values as a list (read once, then kept)."""
        if self._values is None:
            self._values = self.tensor().tolist()
        return self._values
