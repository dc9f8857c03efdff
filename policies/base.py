"""What every compression policy is: a name, a parameter model, a behaviour.

One small class per policy (kvsieve's registry follows kvpress's
one-class-per-press style). A policy sees only tensors and token ids; it never
touches SGLang objects. The lifecycle hooks arrive with the compressed region
(radix_ext); here a policy is what the API validates and the engine receives.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel, ConfigDict


class PolicyParams(BaseModel):
    """Base of every policy's parameter model: unknown fields are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class Policy:
    """Base class of a compression policy.

    Subclasses set `name`, `Params` (a PolicyParams subclass with defaults and
    bounds) and `compresses` (False only for `full`, which keeps SGLang's own
    KV path untouched).
    """

    name: ClassVar[str]
    Params: ClassVar[type[PolicyParams]] = PolicyParams
    compresses: ClassVar[bool] = True
    #: Whether `budget` / `budget_ratio` mean anything for this policy.
    takes_budget: ClassVar[bool] = True
    description: ClassVar[str] = ""
