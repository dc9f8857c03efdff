"""R-KV (the baseline) and SkipKV (skipkv-slides.txt), which builds on R-KV's
scores. See README.md for which file implements which part."""

from .rkv import RKVBase, RKVParams, RKVPolicy  # noqa: F401  (registers rkv)
from .policy import SkipKVParams, SkipKVPolicy, SkipKVState  # noqa: F401  (registers skipkv)
