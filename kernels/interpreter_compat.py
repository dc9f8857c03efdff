"""Triton's CPU interpreter (TRITON_INTERPRET=1) under NumPy 2.

The interpreter keeps kernel scalars as 1-element arrays and converts them
with int(array) where a kernel uses one as a loop bound (`range(a, b)`);
NumPy 2 refuses int() of a 1-d array. Patched here, only when interpreting,
so the kernels keep the `for` loops the GPU compiler pipelines."""

from __future__ import annotations

import os


def apply() -> None:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("1", "true", "True"):
        return
    from triton.runtime import interpreter

    if getattr(interpreter, "_kvsieve_numpy2_index", False):
        return
    original = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patch_lang_tensor
    interpreter._kvsieve_numpy2_index = True
