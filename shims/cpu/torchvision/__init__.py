"""CPU import shim for ``torchvision``, owned by kvsieve (see kvsieve_cpu_shim).

SGLang imports ``torchvision.io.decode_jpeg`` at start-up for image inputs;
kvsieve serves text models, so on CPU these are placeholders. PyPI's
torchvision wheel cannot load beside the CPU build of torch.
"""

import sys

import kvsieve_cpu_shim

IS_KVSIEVE_CPU_SHIM = True
__version__ = "0.0.0+kvsieve.cpu.shim"

kvsieve_cpu_shim.install(sys.modules[__name__])
