"""kvsieve: per-request KV-cache compression for reasoning models, served by SGLang."""

import os as _os

__version__ = "0.1.0"
SGLANG_VERSION = "0.5.17"

# In a source checkout this directory holds only this file: pyproject's
# package-dir maps kvsieve.service, .policies, .kernels and .radix_ext to the
# folders beside it. A Python started in the checkout's root (`python -m`,
# `-c`, or a Ray worker, whose sys.path begins with its driver's directory)
# finds this file before the installed package and would not find those
# subpackages; the checkout's root on __path__ makes them import from there.
# An installed kvsieve has them inside this directory and is left alone.
_here = _os.path.dirname(_os.path.abspath(__file__))
_root = _os.path.dirname(_here)
if not _os.path.isdir(_os.path.join(_here, "service")) and _os.path.isfile(
        _os.path.join(_root, "service", "__init__.py")):
    __path__.append(_root)
