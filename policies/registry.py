"""Policy registry: name -> Policy class."""

from __future__ import annotations

from .base import Policy

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
