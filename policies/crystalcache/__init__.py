"""CrystalCache (crystalcache.txt): one index set per request over trunks of
sentences, S1-S6 at the prompt's end and a breath cycle while decoding. See
README.md for which file implements which section."""

from .policy import CrystalCacheParams, CrystalCachePolicy, CrystalCacheState  # noqa: F401  (registers the policy)
