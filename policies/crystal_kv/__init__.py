"""Crystal-KV (crystal-kv.txt): attention-based LRFU per (layer, kv head) and
adaptive head budgets. See README.md for which file implements which section."""

from .policy import CrystalKVParams, CrystalKVPolicy, CrystalKVState, hits_of  # noqa: F401  (registers the policy)
