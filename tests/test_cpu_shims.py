"""The CPU import shims kvsieve owns (sgl_kernel, torchvision)."""

import os
import subprocess
import sys

import pytest


def test_placeholders_import_and_fail_loudly():
    import sgl_kernel
    from sgl_kernel.flash_attn import flash_attn_varlen_func
    from sgl_kernel.scalar_type import scalar_types

    assert sgl_kernel.IS_KVSIEVE_CPU_SHIM
    assert not scalar_types.uint4  # a missing feature reads as absent
    with pytest.raises(NotImplementedError, match="sgl_kernel.flash_attn.flash_attn_varlen_func"):
        flash_attn_varlen_func(None)
    from torchvision.io import decode_jpeg

    with pytest.raises(NotImplementedError, match="torchvision.io.decode_jpeg"):
        decode_jpeg(b"")


def test_sglang_takes_the_native_path_on_cpu():
    # In a fresh interpreter, as SGLang's scheduler process is: no sgl_kernel
    # torch op is registered, so the AMX (forward_cpu) path is off.
    code = (
        "import torch; from sglang.srt.utils.common import cpu_has_amx_support, is_cpu;"
        "assert is_cpu(); assert not cpu_has_amx_support();"
        "assert not hasattr(torch.ops.sgl_kernel, 'convert_weight_packed'); print('native')"
    )
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("native")
