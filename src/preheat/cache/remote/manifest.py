"""The manifest format a remote store holds: what ``compile/<kind>/<key>/manifest.json`` must look
like before a reader trusts it (schema, kind, key, simple file names, 64-hex sha256s, size caps)
and, with a signing key, its HMAC signature (``preheat.cache.signing``).

Nothing from outside becomes part of a path unchecked.
"""

from __future__ import annotations

import json
import re
from typing import Any

from preheat.cache.entries import MANIFEST, SCHEMA, STATS, LoadingMarker
from preheat.cache.signing import verify
from preheat.errors import CacheEntryError, InvalidArgumentError

__all__ = ["KINDS", "KEY_RE", "SHA_RE", "NAME_RE", "REF_RE", "MAX_MANIFEST_BYTES", "check_kind_key",
           "check_blob_name", "check_ref_name", "check_file_name", "check_manifest", "check_remote_manifest",
           "parse_blob_ref"]

MAX_MANIFEST_BYTES = 1 << 20  # a manifest is a few KB; a bigger one is refused unread

KINDS = ("jax", "torch")
KEY_RE = re.compile(r"[0-9a-f]{32}")  # compile keys: key_of() = 32 hex digits, nothing else
SHA_RE = re.compile(r"[0-9a-f]{64}")
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
REF_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,199}")  # a weights source id (preheat.store's source_id)
REF_FORMAT = 1
_RESERVED = (MANIFEST, STATS)


def check_kind_key(kind: str, key: str) -> None:
    if kind not in KINDS:
        raise InvalidArgumentError(f"cache kind {kind!r} is not one of {', '.join(KINDS)}")
    if not isinstance(key, str) or not KEY_RE.fullmatch(key):
        raise InvalidArgumentError(f"cache key {key!r} is not 32 lowercase hex digits")


def check_blob_name(name: str) -> None:
    if not isinstance(name, str) or not SHA_RE.fullmatch(name):
        raise InvalidArgumentError(f"blob name {name!r} is not a sha256 (64 lowercase hex digits)")


def check_ref_name(name: str) -> None:
    if not isinstance(name, str) or not REF_RE.fullmatch(name):
        raise InvalidArgumentError(f"weights ref name {name!r} is not a source id ([A-Za-z0-9._-], at most 200)")


def parse_blob_ref(raw: bytes) -> set[str]:
    """The blobs a ``refs/<id>.json`` record names; ValueError if it is not a well-formed record."""
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"not JSON ({type(exc).__name__})") from None
    blobs = doc.get("blobs") if isinstance(doc, dict) and doc.get("format") == REF_FORMAT else None
    if not isinstance(blobs, list) or not all(isinstance(b, str) and SHA_RE.fullmatch(b) for b in blobs):
        raise ValueError(f"not a format-{REF_FORMAT} weights ref")
    return set(blobs)


def check_file_name(name: Any) -> None:
    if (not isinstance(name, str) or not NAME_RE.fullmatch(name) or name in _RESERVED
            or name.startswith(LoadingMarker.PREFIX) or name.startswith(".")):
        raise CacheEntryError(f"manifest lists an unsafe file name {name!r}")


def check_manifest(manifest: Any, kind: str, key: str, max_total: int | None = None) -> dict[str, Any]:
    """Structural checks of a manifest read from the store (signature is checked separately)."""
    if not isinstance(manifest, dict):
        raise CacheEntryError("manifest is not a JSON object")
    if manifest.get("schema") != SCHEMA:
        raise CacheEntryError(f"manifest has schema {manifest.get('schema')!r}, expected {SCHEMA}")
    if manifest.get("kind") != kind or manifest.get("key") != key:
        raise CacheEntryError(f"manifest is for {manifest.get('kind')!r}/{str(manifest.get('key'))[:40]!r}, not {kind}/{key}")
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        raise CacheEntryError("manifest lists no files")
    total = 0
    for name, meta in files.items():
        check_file_name(name)
        if not isinstance(meta, dict) or not isinstance(meta.get("sha256"), str) or not SHA_RE.fullmatch(meta["sha256"]):
            raise CacheEntryError(f"manifest entry for {name} has no valid sha256")
        size = meta.get("size")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise CacheEntryError(f"manifest entry for {name} has no valid size")
        total += size
    if max_total is not None and total > max_total:
        raise CacheEntryError(f"entry is {total} bytes, over the local cache cap of {max_total}")
    return manifest


def check_remote_manifest(raw: bytes, kind: str, key: str, signing_key: bytes | None) -> dict[str, Any]:
    """Parse and check a manifest read from the store: size cap, JSON, structure (``check_manifest``
    against the local cache's size cap) and, when ``signing_key`` is given, its signature."""
    if len(raw) > MAX_MANIFEST_BYTES:
        raise CacheEntryError(f"manifest is over {MAX_MANIFEST_BYTES} bytes")
    try:
        manifest = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise CacheEntryError(f"manifest is not JSON ({type(exc).__name__})") from None
    from preheat.cache.manage import max_bytes

    check_manifest(manifest, kind, key, max_total=max_bytes())
    if signing_key is not None:
        verify(manifest, signing_key)
    return manifest

