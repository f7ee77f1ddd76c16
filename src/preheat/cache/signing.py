"""Signed cache manifests: HMAC-SHA256 over a canonical JSON of the manifest.

A shared (remote) cache is written by many pods; a reader must not load an executable that
someone else could have swapped. With ``PREHEAT_CACHE_SIGNING_KEY`` set, every manifest pushed
carries::

    "signature": {"alg": "hmac-sha256", "key_id": "<16 hex>", "mac": "<64 hex>"}

``mac`` is HMAC-SHA256(key, canonical(manifest without "signature")), where canonical is
``json.dumps(sort_keys=True, separators=(",", ":"), ensure_ascii=True)``. The manifest lists the
sha256 of every payload file and its own kind and key, so the signature covers the payload bytes
and binds the entry to its key (a signed manifest copied under another key is refused because
its ``key`` field no longer matches).

``key_id`` (first 16 hex of sha256 of the key) only makes refusals explain themselves ("signed
with another key"); it reveals nothing usable about the key.

The key is the UTF-8 bytes of the variable's value; use a long random string, e.g.
``python -c "import secrets; print(secrets.token_hex(32))"``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
from typing import Any

from preheat.errors import CacheEntryError

__all__ = ["SignatureError", "signing_key_from_env", "canonical", "key_id", "sign", "verify", "ALG", "ENV_KEY"]

log = logging.getLogger("preheat.cache")

ALG = "hmac-sha256"
ENV_KEY = "PREHEAT_CACHE_SIGNING_KEY"
SIGNATURE_FIELD = "signature"
_MIN_KEY_BYTES = 16


class SignatureError(CacheEntryError):
    """A manifest is unsigned, signed with another key, or its signature does not verify."""


def signing_key_from_env() -> bytes | None:
    raw = os.environ.get(ENV_KEY, "")
    if not raw:
        return None
    key = raw.encode()
    if len(key) < _MIN_KEY_BYTES:
        log.warning("preheat cache: %s is only %d bytes; use at least 32 random bytes", ENV_KEY, len(key))
    return key


def canonical(manifest: dict[str, Any]) -> bytes:
    body = {k: v for k, v in manifest.items() if k != SIGNATURE_FIELD}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def key_id(key: bytes) -> str:
    return hashlib.sha256(b"preheat-key-id:" + key).hexdigest()[:16]


def sign(manifest: dict[str, Any], key: bytes) -> dict[str, Any]:
    """A copy of ``manifest`` with its signature field set (any old signature is replaced)."""
    mac = hmac.new(key, canonical(manifest), hashlib.sha256).hexdigest()
    return {**{k: v for k, v in manifest.items() if k != SIGNATURE_FIELD},
            SIGNATURE_FIELD: {"alg": ALG, "key_id": key_id(key), "mac": mac}}


def verify(manifest: dict[str, Any], key: bytes) -> None:
    """Raise SignatureError unless ``manifest`` carries a valid signature made with ``key``."""
    sig = manifest.get(SIGNATURE_FIELD)
    if sig is None:
        raise SignatureError("entry is unsigned and a signing key is set")
    if not isinstance(sig, dict) or sig.get("alg") != ALG or not isinstance(sig.get("mac"), str):
        raise SignatureError("entry has a malformed signature")
    if sig.get("key_id") != key_id(key):
        raise SignatureError(f"entry is signed with another key (key id {str(sig.get('key_id'))[:16]!r}, ours {key_id(key)})")
    try:
        body = canonical(manifest)
    except (TypeError, ValueError) as exc:
        raise SignatureError(f"entry manifest cannot be canonicalised ({exc})") from None
    want = hmac.new(key, body, hashlib.sha256).hexdigest()
    if not hmac.compare_digest(want, sig["mac"]):
        raise SignatureError("entry signature does not verify (manifest was changed after signing)")
