"""Policy registry: name -> Policy class."""

from __future__ import annotations

import importlib
import os

from .base import Policy

#: Comma-separated modules whose import registers more policies; set by
#: `kvsieve serve --policy-module` and read in every process (the API server
#: validates kv_policy, SGLang's scheduler runs the policy).
POLICY_MODULES_ENV = "KVSIEVE_POLICY_MODULES"

_POLICIES: dict[str, type[Policy]] = {}


def register_policy(cls: type[Policy]) -> type[Policy]:
    """Class decorator adding a policy to the registry under `cls.name`."""
    name = getattr(cls, "name", None)
    if not name:
        raise TypeError(f"{cls.__qualname__} must set a `name`")
    if name in _POLICIES and _POLICIES[name] is not cls:
        raise ValueError(f"policy {name!r} is already registered by {_POLICIES[name]!r}")
    _POLICIES[name] = cls
    return cls


def get_policy(name: str) -> type[Policy]:
    try:
        return _POLICIES[name]
    except KeyError:
        raise KeyError(name) from None


def policy_names() -> list[str]:
    return sorted(_POLICIES)


def load_policy_modules(modules: str | None = None) -> list[str]:
    """Import the modules named in `modules` (default: $KVSIEVE_POLICY_MODULES);
    their @register_policy classes join the registry. The modules imported."""
    names = [m.strip() for m in (modules if modules is not None else os.environ.get(POLICY_MODULES_ENV, "")).split(",")]
    names = [m for m in names if m]
    for name in names:
        importlib.import_module(name)
    return names
