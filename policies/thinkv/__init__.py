"""ThinKV (thinkv.txt): thought-typed segments annealed at each transition,
k-means keeping representative tokens. See README.md for which file
implements which section."""

from .policy import ThinKVParams, ThinKVPolicy, ThinKVState  # noqa: F401  (registers the policy)
