"""CPU import shim for ``sgl_kernel``, owned by kvsieve (see kvsieve_cpu_shim).

No ``torch.ops.sgl_kernel`` operator is registered, so SGLang's AMX check
(``hasattr(torch.ops.sgl_kernel, "convert_weight_packed")``) is False and every
layer takes its ``forward_native`` path, on AMX CPUs too.
"""

import sys

import kvsieve_cpu_shim

IS_KVSIEVE_CPU_SHIM = True
__version__ = "0.0.0+kvsieve.cpu.shim"

kvsieve_cpu_shim.install(sys.modules[__name__])
