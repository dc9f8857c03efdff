"""API keys: `ksv-<key id>-<secret>`. The store keeps the key id, a name and
the secret's SHA-256; the key itself is shown once, at creation, and never
stored or logged. Verification looks the record up by id and compares the
digests in constant time (hmac.compare_digest).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from typing import Mapping, Optional

from .store import KeyRecord

_KEY_RE = re.compile(r"^ksv-([0-9a-f]{12})-([A-Za-z0-9_\-]{20,100})$")


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def new_key(name: str, rate_per_s: Optional[float] = None, burst: Optional[int] = None) -> tuple[str, KeyRecord]:
    """A fresh key and the record to store for it."""
    key_id = secrets.token_hex(6)
    secret = secrets.token_urlsafe(32)
    record = KeyRecord(key_id=key_id, name=name, secret_sha256=_digest(secret), rate_per_s=rate_per_s, burst=burst)
    return f"ksv-{key_id}-{secret}", record


def bearer_token(authorization: Optional[str]) -> Optional[str]:
    """The key of an `Authorization: Bearer <key>` header, if there is one."""
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def verify(presented: Optional[str], keys: Mapping[str, KeyRecord]) -> Optional[KeyRecord]:
    """The record of a valid key, else None."""
    if not presented:
        return None
    match = _KEY_RE.match(presented)
    if match is None:
        return None
    record = keys.get(match.group(1))
    # Digest the secret even when the id is unknown, so both cases cost the same.
    expected = record.secret_sha256 if record is not None else "0" * 64
    ok = hmac.compare_digest(_digest(match.group(2)), expected)
    return record if ok and record is not None else None
