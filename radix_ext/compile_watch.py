"""Which Triton kernels compile while serving, and for how long.

A compile mid-serving stalls every request of the engine for seconds (the
kernels' specializations: kernels/decode_attention.py). The step log
(radix_ext/step_log.py) puts the compiles of each forward on its line, so a
slow step names its cause. Triton's JIT hooks (`triton.knobs.runtime`) are
called before and after each compile in this process; a Triton without
them leaves the watch empty."""

from __future__ import annotations

import time

#: Characters of a compile's specialization key kept in the step log.
KEY_CHARS = 1000


class CompileWatch:
    def __init__(self):
        self.started: dict = {}  # (kernel, key) -> perf_counter at the compile's start
        self.done: list[dict] = []  # compiles finished since the last take()
        self.installed = False

    def install(self) -> "CompileWatch":
        try:
            from triton import knobs
        except ImportError:  # an older Triton: nothing to watch with
            return self
        runtime = knobs.runtime
        before, after = runtime.jit_cache_hook, runtime.jit_post_compile_hook

        def on_start(**kwargs):
            self.started[self._name(kwargs)] = time.perf_counter()
            return before(**kwargs) if before else None

        def on_end(**kwargs):
            name = self._name(kwargs)
            t0 = self.started.pop(name, None)
            # The key names the variant (argument types, which pointers and
            # integers were specialized, constexprs): what made it new.
            self.done.append({"kernel": name[0], "s": round(time.perf_counter() - t0, 3) if t0 else None,
                              "key": name[1][:KEY_CHARS]})
            return after(**kwargs) if after else None

        runtime.jit_cache_hook, runtime.jit_post_compile_hook = on_start, on_end
        self.installed = True
        return self

    @staticmethod
    def _name(kwargs) -> tuple:
        fn = kwargs.get("fn")
        return (getattr(fn, "name", str(fn)), str(kwargs.get("key")))

    def take(self) -> list[dict]:
        """The compiles finished since the last call."""
        done, self.done = self.done, []
        return done
