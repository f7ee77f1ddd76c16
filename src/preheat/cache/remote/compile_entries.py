"""The compile-entry protocol: ``fetch`` (manifest first, then each payload object verified, then
one atomic rename into the local root), ``push`` (payload objects under their sha256, then the
signed manifest LAST) and ``verify``.

Layout: ``compile/<kind>/<key>/manifest.json`` and ``compile/<kind>/<key>/objects/<sha256>``.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

from preheat.files import fsync_dir, sha256_and_size
from preheat.cache.entries import MANIFEST
from preheat.cache.remote.manifest import (
    KEY_RE,
    KINDS,
    MAX_MANIFEST_BYTES,
    check_kind_key,
    check_manifest,
    check_remote_manifest,
)
from preheat.cache.remote.policy import MIN_THROUGHPUT_BPS, RemoteError, StorePolicy, _short, log
from preheat.cache.signing import sign
from preheat.errors import CacheEntryError

__all__ = ["CompileEntries"]


class CompileEntries(StorePolicy):
    """fetch / push / verify of compile entries over the store's primitives."""

    @staticmethod
    def _entry_rel(kind: str, key: str) -> str:
        return f"compile/{kind}/{key}"

    def _read_manifest(self, kind: str, key: str) -> bytes | None:
        return self._bounded(self._read, f"{self._entry_rel(kind, key)}/{MANIFEST}", MAX_MANIFEST_BYTES + 1)

    def _check_remote_manifest(self, raw: bytes, kind: str, key: str) -> dict[str, Any]:
        return check_remote_manifest(raw, kind, key, self.signing_key)

    def _refuse(self, kind: str, key: str, reason: str) -> None:
        with self._lock:
            self._refused.add((kind, key))
        log.warning("preheat cache: remote entry %s/%s from %s refused (%s); compiling locally", kind, key[:12],
                    self.url, reason)
        self._set(f"refused: {reason}")

    def distrust(self, kind: str, key: str) -> None:
        """A fetched entry failed later (e.g. would not deserialise): the next push replaces it."""
        with self._lock:
            self._refused.add((kind, key))

    def fetch(self, kind: str, key: str, local_kind_dir: Path) -> bool:
        """Pull ``<kind>/<key>`` into ``local_kind_dir/<key>`` (verified, atomically). True on a hit.

        Never raises for store problems; ``last`` says what happened."""
        return self._guarded("fetch", self._fetch, kind, key, local_kind_dir, default=False)

    def _fetch(self, kind: str, key: str, local_kind_dir: Path) -> bool:
        check_kind_key(kind, key)
        why = self.compile_policy()
        if why:
            self._warn_once("policy", "preheat cache: not using remote compile cache: %s", why)
            self._set(f"disabled: {why}")
            return False
        down = self._down()
        if down:
            self._set(f"unreachable: {down}")
            return False
        rel = self._entry_rel(kind, key)
        try:
            raw = self._read_manifest(kind, key)
        except RemoteError as err:
            self._mark_down(str(err))
            self._set(f"unreachable: {err}")
            return False
        if raw is None:
            self._set("miss")
            return False
        try:
            manifest = self._check_remote_manifest(raw, kind, key)
        except CacheEntryError as err:
            self._refuse(kind, key, str(err))
            return False

        local_kind_dir = Path(local_kind_dir)
        local_kind_dir.mkdir(parents=True, exist_ok=True)
        tmp = local_kind_dir / f".tmp-{key}-remote-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            for name, meta in manifest["files"].items():
                dest = tmp / name
                deadline = self.timeout * 2 + meta["size"] / MIN_THROUGHPUT_BPS
                try:
                    self._bounded(self._get_file, f"{rel}/objects/{meta['sha256']}", dest, deadline_s=deadline)
                except FileNotFoundError:
                    self._refuse(kind, key, f"payload object for {name} is missing")
                    return False
                except RemoteError as err:
                    self._mark_down(str(err))
                    self._set(f"unreachable: {err}")
                    return False
                sha, size = sha256_and_size(dest)
                if size != meta["size"] or sha != meta["sha256"]:
                    self._refuse(kind, key, f"{name} does not match its manifest ({size} bytes, sha256 {sha[:12]})")
                    return False
            with open(tmp / MANIFEST, "wb") as f:
                f.write(raw)
                f.flush()
                os.fsync(f.fileno())
            fsync_dir(tmp)
            final = local_kind_dir / key
            try:
                os.rename(tmp, final)
            except OSError:
                if not (final / MANIFEST).is_file():
                    raise
                # another local process published it first: theirs is as good as ours
            fsync_dir(local_kind_dir)
        except OSError as exc:
            log.warning("preheat cache: could not store remote entry %s locally: %s", key[:12], exc)
            self._set(f"failed: {_short(exc)}")
            return False
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        self._set("hit")
        return True

    def push(self, kind: str, entry_dir: Path) -> None:
        """Upload a verified local entry: payload objects, then the (signed) manifest last.

        Skipped when the store already holds an entry for the key that this process accepts
        (and did not refuse). Never raises for store problems; ``last`` says what happened."""
        self._guarded("push", self._push, kind, entry_dir, default=None)

    def _push(self, kind: str, entry_dir: Path) -> None:
        entry_dir = Path(entry_dir)
        key = entry_dir.name
        check_kind_key(kind, key)
        why = self.compile_policy()
        if why:
            self._warn_once("policy", "preheat cache: not using remote compile cache: %s", why)
            self._set(f"disabled: {why}")
            return
        down = self._down()
        if down:
            self._set(f"unreachable: {down}")
            return
        try:
            manifest = check_manifest(json.loads((entry_dir / MANIFEST).read_bytes()), kind, key)
            for name, meta in manifest["files"].items():  # never publish bytes we cannot vouch for
                if sha256_and_size(entry_dir / name) != (meta["sha256"], meta["size"]):
                    raise CacheEntryError(f"local {name} does not match its manifest")
            if self.signing_key is not None:
                manifest = sign(manifest, self.signing_key)
            else:
                manifest = {k: v for k, v in manifest.items() if k != "signature"}
        except (OSError, ValueError, TypeError, RecursionError, CacheEntryError) as exc:
            log.warning("preheat cache: not pushing entry %s: %s", key[:12], exc)
            self._set(f"failed: {_short(exc)}")
            return
        rel = self._entry_rel(kind, key)
        try:
            with self._lock:
                forced = (kind, key) in self._refused
            if not forced:
                existing = self._read_manifest(kind, key)
                if existing is not None:
                    try:
                        self._check_remote_manifest(existing, kind, key)
                        self._set("exists")
                        return
                    except CacheEntryError as err:
                        log.warning("preheat cache: replacing remote entry %s/%s (%s)", kind, key[:12], err)
            for name, meta in manifest["files"].items():
                deadline = self.timeout * 2 + meta["size"] / MIN_THROUGHPUT_BPS
                self._bounded(self._put_file, entry_dir / name, f"{rel}/objects/{meta['sha256']}", deadline_s=deadline)
            body = json.dumps(manifest, indent=1, sort_keys=True).encode()
            self._bounded(self._put_bytes, body, f"{rel}/{MANIFEST}")  # LAST: now readers see the entry
        except RemoteError as err:
            self._mark_down(str(err))
            self._set(f"failed: {err}")
            return
        except FileNotFoundError as err:  # the local entry went away (evicted), or the bucket is missing
            log.warning("preheat cache: could not push entry %s: %s", key[:12], err)
            self._set(f"failed: {_short(err)}")
            return
        with self._lock:
            self._refused.discard((kind, key))
        self._set("pushed")

    def has(self, kind: str, key: str) -> bool | None:
        """Whether the store holds a manifest for ``<kind>/<key>`` (not verified); None when it
        cannot be asked (down, or not trusted for compile entries)."""
        check_kind_key(kind, key)
        if self.compile_policy() or self._down():
            return None
        try:
            return self._bounded(self._exists, f"{self._entry_rel(kind, key)}/{MANIFEST}")
        except RemoteError as err:
            self._mark_down(str(err))
            return None

    def verify(self, kind: str | None = None) -> list[dict[str, Any]]:
        """Check every remote compile entry (manifest, signature when a key is set, every payload's
        sha256) without loading anything: ``[{"kind", "key", "ok", "problem"}]``. Raises
        RemoteError when the store cannot be listed."""
        out: list[dict[str, Any]] = []
        for k in ([kind] if kind else list(KINDS)):
            for key in sorted(self._bounded(self._list, f"compile/{k}")):
                out.append({"kind": k, "key": key, **self._verify_one(k, key)})
        return out

    def _verify_one(self, kind: str, key: str) -> dict[str, Any]:
        if not KEY_RE.fullmatch(key):
            return {"ok": False, "problem": "not a valid key name"}
        rel = self._entry_rel(kind, key)
        raw = self._read_manifest(kind, key)
        if raw is None:
            return {"ok": False, "problem": "no manifest (an unfinished or interrupted push)"}
        try:
            manifest = self._check_remote_manifest(raw, kind, key)
        except CacheEntryError as err:
            return {"ok": False, "problem": str(err)}
        import tempfile

        with tempfile.TemporaryDirectory(prefix="preheat-verify-") as tmp:
            for name, meta in manifest["files"].items():
                dest = Path(tmp) / name
                try:
                    self._bounded(self._get_file, f"{rel}/objects/{meta['sha256']}", dest,
                                  deadline_s=self.timeout * 2 + meta["size"] / MIN_THROUGHPUT_BPS)
                except FileNotFoundError:
                    return {"ok": False, "problem": f"payload object for {name} is missing"}
                if sha256_and_size(dest) != (meta["sha256"], meta["size"]):
                    return {"ok": False, "problem": f"{name} does not match its manifest"}
        return {"ok": True, "problem": ""}

