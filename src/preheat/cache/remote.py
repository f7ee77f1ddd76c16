"""A cache shared by a fleet of pods: compile entries (and weight blobs) in a remote store.

``PREHEAT_CACHE_URL`` names the store (``preheat --cache-url`` sets it):

    s3://bucket/prefix          S3, Cloudflare R2, MinIO, Runpod's S3-compatible volume API (s3fs)
    gs://..., az://..., ...     any other fsspec URL (its fsspec package must be installed)
    /mnt/shared/preheat         a shared folder (a network volume); also file:///mnt/shared/preheat

S3 endpoint and credentials are taken the standard way: ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_PROFILE``, ``AWS_DEFAULT_REGION``,
``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` or fsspec's config (``FSSPEC_S3_ENDPOINT_URL``,
``FSSPEC_S3`` JSON, ``~/.config/fsspec/*.json``; fsspec's config wins over the AWS variables).

Layout under the URL::

    compile/<kind>/<key>/manifest.json          the local manifest (+ signature), published LAST
    compile/<kind>/<key>/objects/<sha256>       payload files, content-addressed
    blobs/<sha256>                              weight blobs (``mirror_get`` / ``mirror_put``)

Reading (``fetch``, on a local miss): the manifest is read, checked (schema, kind, key, simple
file names, 64-hex sha256s, size cap) and, with a signing key, its HMAC verified; each payload
object is downloaded into a local temp folder and its sha256 and size checked against the
manifest; then the folder is published into the local root with the same atomic rename as a local
write. A reader trusts nothing else: no manifest, no entry.

Writing (``push``, after a local compile): payload objects first, each under its own sha256,
then the manifest. On object stores one PUT is atomic; on a shared folder every file is written
under a temp name and renamed. Because payloads are content-addressed, two pods that compile the
same key at once (serialized executables need not be byte-identical) each upload their own bytes,
and whichever manifest lands last points at bytes that are complete: no manifest ever names
another writer's payload. Objects are never deleted by readers or writers (an overwritten
manifest leaves an orphan object; ``RemoteStore.verify`` reports entries, not orphans).

Trust: with ``PREHEAT_CACHE_SIGNING_KEY`` set, pushed manifests are signed and fetched ones must
verify (unsigned or badly signed entries are refused, logged, recompiled locally and the push
replaces them). Without a key, remote compile entries are used only with
``PREHEAT_TRUST_REMOTE_CACHE=1``; otherwise the store is not used for compile entries (fetch or
push) and a warning says why. Weight blobs need no trust setting: they are named by their sha256,
which the caller knows from a trusted source, and verified on download.

Failure: every remote operation runs under a hard deadline (``PREHEAT_CACHE_REMOTE_TIMEOUT``
seconds, default 5, per request; a download gets that plus one second per MB). A store that is
down, slow or refuses access costs at most one deadline: the process logs a warning, compiles
locally, and skips the store for ``DOWN_COOLDOWN_S`` seconds. Nothing here raises to the caller
except ``InvalidArgumentError`` for a malformed kind, key or blob name passed in by code.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, TypeVar

from preheat.cache.atomic import fsync_dir
from preheat.cache.entries import MANIFEST, SCHEMA, STATS, LoadingMarker, sha256_file
from preheat.cache.signing import ENV_KEY, key_id, sign, signing_key_from_env, verify
from preheat.errors import CacheEntryError, InvalidArgumentError

__all__ = ["RemoteStore", "FsspecStore", "LocalDirStore", "RemoteError", "remote_from_env", "open_store",
           "default_store", "mirror_get", "mirror_put", "child_env", "describe", "ENV_URL", "ENV_TRUST", "ENV_TIMEOUT"]

log = logging.getLogger("preheat.cache")

ENV_URL = "PREHEAT_CACHE_URL"
ENV_TRUST = "PREHEAT_TRUST_REMOTE_CACHE"
ENV_TIMEOUT = "PREHEAT_CACHE_REMOTE_TIMEOUT"
DEFAULT_TIMEOUT_S = 5.0
DOWN_COOLDOWN_S = 60.0
MIN_THROUGHPUT_BPS = 1_000_000  # a download's deadline grows by 1 s per MB
MAX_MANIFEST_BYTES = 1 << 20  # a manifest is a few KB; a bigger one is refused unread

KINDS = ("jax", "torch")
KEY_RE = re.compile(r"[0-9a-f]{32}")  # compile keys: key_of() = 32 hex digits, nothing else
SHA_RE = re.compile(r"[0-9a-f]{64}")
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
_RESERVED = (MANIFEST, STATS)
_TRUE = ("1", "true", "yes", "on")

T = TypeVar("T")


class RemoteError(Exception):
    """The store could not be reached or answered with an error (internal; never escapes)."""


# ---------------------------------------------------------------------------------------------
# Validation: nothing from outside becomes part of a path unchecked


def check_kind_key(kind: str, key: str) -> None:
    if kind not in KINDS:
        raise InvalidArgumentError(f"cache kind {kind!r} is not one of {', '.join(KINDS)}")
    if not isinstance(key, str) or not KEY_RE.fullmatch(key):
        raise InvalidArgumentError(f"cache key {key!r} is not 32 lowercase hex digits")


def check_blob_name(name: str) -> None:
    if not isinstance(name, str) or not SHA_RE.fullmatch(name):
        raise InvalidArgumentError(f"blob name {name!r} is not a sha256 (64 lowercase hex digits)")


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


def _timeout_from_env() -> float:
    raw = os.environ.get(ENV_TIMEOUT, "")
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise InvalidArgumentError(f"{ENV_TIMEOUT}={raw!r} is not a number of seconds") from None
    if not value > 0:
        raise InvalidArgumentError(f"{ENV_TIMEOUT}={raw!r} must be positive")
    return value


def _short(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:200]}" if text else type(exc).__name__


def _sha256_and_size(path: Path) -> tuple[str, int]:
    return sha256_file(path), path.stat().st_size


# ---------------------------------------------------------------------------------------------
# The store


class RemoteStore:
    """The protocol (fetch / push / mirror) over five primitives that subclasses implement.

    Primitives take paths relative to the store's base, with "/" separators, already validated:
    ``_read(rel, limit) -> bytes | None`` (at most ``limit`` bytes), ``_get_file(rel, local)`` (FileNotFoundError when absent),
    ``_put_file(local, rel)`` and ``_put_bytes(data, rel)`` (each atomic as readers see it),
    ``_exists(rel)`` and ``_list(rel) -> names`` (empty when absent).
    """

    def __init__(self, url: str, *, timeout: float | None = None, signing_key: bytes | None | str = "env",
                 trust: bool | None = None):
        self.url = url
        self.timeout = _timeout_from_env() if timeout is None else float(timeout)
        self.signing_key = signing_key_from_env() if signing_key == "env" else signing_key  # type: ignore[assignment]
        if isinstance(self.signing_key, str):
            self.signing_key = self.signing_key.encode()
        self.trust = (os.environ.get(ENV_TRUST, "").lower() in _TRUE) if trust is None else trust
        self._down_until = 0.0
        self._down_reason = ""
        self._refused: set[tuple[str, str]] = set()
        self._warned: set[str] = set()
        self._local = threading.local()
        self._lock = threading.Lock()

    # -------------------------------------------------------------- primitives (subclasses)

    def _read(self, rel: str, limit: int | None = None) -> bytes | None:
        raise NotImplementedError

    def _get_file(self, rel: str, local: Path) -> None:
        raise NotImplementedError

    def _put_file(self, local: Path, rel: str) -> None:
        raise NotImplementedError

    def _put_bytes(self, data: bytes, rel: str) -> None:
        raise NotImplementedError

    def _exists(self, rel: str) -> bool:
        raise NotImplementedError

    def _list(self, rel: str) -> list[str]:
        raise NotImplementedError

    def _prepare(self) -> None:
        """Local set-up (imports, client objects) done before a deadline starts; no network."""

    def warm_up(self) -> None:
        """Start the local set-up (importing s3fs alone takes ~0.5 s) in the background, so it
        overlaps with model loading instead of delaying the first fetch. Touches no network."""

        def work() -> None:
            try:
                self._prepare()
            except Exception:  # noqa: BLE001 - reported by the first real call
                pass

        threading.Thread(target=work, name="preheat-remote-warm-up", daemon=True).start()

    # -------------------------------------------------------------- status

    @property
    def last(self) -> str:
        """What the calling thread's last fetch / push / mirror call did, in a few words:
        hit, miss, refused: ..., unreachable: ..., disabled: ..., pushed, exists, failed: ..."""
        return getattr(self._local, "last", "")

    def _set(self, status: str) -> str:
        self._local.last = status
        return status

    def _warn_once(self, tag: str, msg: str, *args: Any) -> None:
        with self._lock:
            if tag in self._warned:
                return
            self._warned.add(tag)
        log.warning(msg, *args)

    def compile_policy(self) -> str | None:
        """None when compile entries may be used; else why not."""
        if self.signing_key is None and not self.trust:
            return (f"neither {ENV_KEY} nor {ENV_TRUST}=1 is set, so entries from {self.url} cannot be "
                    "trusted (set a signing key shared by the fleet, or trust the store explicitly)")
        return None

    def _down(self) -> str | None:
        if time.monotonic() < self._down_until:
            return self._down_reason
        return None

    def _mark_down(self, reason: str) -> None:
        with self._lock:
            self._down_until = time.monotonic() + DOWN_COOLDOWN_S
            self._down_reason = reason
        log.warning("preheat cache: remote store %s is unavailable (%s); compiling locally, not using it for %.0f s",
                    self.url, reason, DOWN_COOLDOWN_S)

    def _bounded(self, fn: Callable[..., T], *args: Any, deadline_s: float | None = None) -> T:
        """Run ``fn(*args)`` with a hard deadline. FileNotFoundError passes through; everything
        else (timeouts, connection errors, access denied) becomes RemoteError."""
        deadline_s = self.timeout * 2 if deadline_s is None else deadline_s
        self._prepare()
        box: dict[str, Any] = {}
        done = threading.Event()

        def work() -> None:
            try:
                box["value"] = fn(*args)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
                box["error"] = exc
            finally:
                done.set()

        # A daemon thread: if the store hangs past every socket timeout, the caller moves on and
        # the process can still exit (the abandoned thread's upload never gets its manifest).
        threading.Thread(target=work, name="preheat-remote", daemon=True).start()
        if not done.wait(deadline_s):
            raise RemoteError(f"no answer within {deadline_s:.1f} s")
        if "error" in box:
            err = box["error"]
            if isinstance(err, FileNotFoundError):
                raise err
            if isinstance(err, RemoteError):
                raise err
            raise RemoteError(_short(err)) from err
        return box["value"]

    # -------------------------------------------------------------- compile entries

    @staticmethod
    def _entry_rel(kind: str, key: str) -> str:
        return f"compile/{kind}/{key}"

    def _read_manifest(self, kind: str, key: str) -> bytes | None:
        return self._bounded(self._read, f"{self._entry_rel(kind, key)}/{MANIFEST}", MAX_MANIFEST_BYTES + 1)

    def _check_remote_manifest(self, raw: bytes, kind: str, key: str) -> dict[str, Any]:
        if len(raw) > MAX_MANIFEST_BYTES:
            raise CacheEntryError(f"manifest is over {MAX_MANIFEST_BYTES} bytes")
        try:
            manifest = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            raise CacheEntryError(f"manifest is not JSON ({type(exc).__name__})") from None
        from preheat.cache.manage import max_bytes

        check_manifest(manifest, kind, key, max_total=max_bytes())
        if self.signing_key is not None:
            verify(manifest, self.signing_key)
        return manifest

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

    def _guarded(self, what: str, fn: Callable[..., T], *args: Any, default: T) -> T:
        """Belt and braces: a start-up never fails because of the shared store. Anything not
        handled below (a bug, an odd exception from a filesystem package) is logged and treated
        as a miss; only InvalidArgumentError (bad input from code) propagates."""
        try:
            return fn(*args)
        except InvalidArgumentError:
            raise
        except Exception as exc:  # noqa: BLE001
            log.warning("preheat cache: remote %s failed unexpectedly (%s); continuing without the store", what,
                        _short(exc))
            self._set(f"failed: {_short(exc)}")
            return default

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
                sha, size = _sha256_and_size(dest)
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
                if _sha256_and_size(entry_dir / name) != (meta["sha256"], meta["size"]):
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
                if _sha256_and_size(dest) != (meta["sha256"], meta["size"]):
                    return {"ok": False, "problem": f"{name} does not match its manifest"}
        return {"ok": True, "problem": ""}

    # -------------------------------------------------------------- weight blobs

    def mirror_get(self, name: str, local_path: str | os.PathLike[str]) -> bool:
        """Download blob ``name`` (its sha256) to ``local_path`` (atomically, verified). True on a hit;
        False when absent, unreachable or corrupt (the caller then downloads from the origin)."""
        return self._guarded("mirror get", self._mirror_get, name, local_path, default=False)

    def _mirror_get(self, name: str, local_path: str | os.PathLike[str]) -> bool:
        check_blob_name(name)
        down = self._down()
        if down:
            self._set(f"unreachable: {down}")
            return False
        local_path = Path(local_path)
        local_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = local_path.parent / f".{local_path.name}.mirror-{uuid.uuid4().hex[:8]}"
        try:
            # No size is known up front: the deadline allows a large checkpoint at the slowest rate.
            self._bounded(self._get_file, f"blobs/{name}", tmp, deadline_s=max(self.timeout * 2, 3600.0))
            sha = sha256_file(tmp)
            if sha != name:
                log.warning("preheat cache: mirrored blob %s from %s has sha256 %s; ignoring it", name[:12], self.url,
                            sha[:12])
                self._set("refused: sha256 mismatch")
                return False
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, local_path)
            fsync_dir(local_path.parent)
        except FileNotFoundError:
            self._set("miss")
            return False
        except RemoteError as err:
            self._mark_down(str(err))
            self._set(f"unreachable: {err}")
            return False
        except OSError as exc:
            log.warning("preheat cache: could not write mirrored blob to %s: %s", local_path, exc)
            self._set(f"failed: {_short(exc)}")
            return False
        finally:
            try:
                tmp.unlink()
            except FileNotFoundError:
                pass
        self._set("hit")
        return True

    def mirror_put(self, name: str, local_path: str | os.PathLike[str]) -> None:
        """Upload ``local_path`` as blob ``name`` unless the store has it. The file's sha256 must be
        ``name`` (checked first; InvalidArgumentError otherwise). Never raises for store problems;
        ``last`` says what happened."""
        self._guarded("mirror put", self._mirror_put, name, local_path, default=None)

    def _mirror_put(self, name: str, local_path: str | os.PathLike[str]) -> None:
        check_blob_name(name)
        local_path = Path(local_path)
        down = self._down()
        if down:
            self._set(f"unreachable: {down}")
            return
        try:
            if sha256_file(local_path) != name:
                raise InvalidArgumentError(f"{local_path} does not have sha256 {name}")
            if self._bounded(self._exists, f"blobs/{name}"):
                self._set("exists")
                return
            size = local_path.stat().st_size
            self._bounded(self._put_file, local_path, f"blobs/{name}",
                          deadline_s=self.timeout * 2 + size / MIN_THROUGHPUT_BPS)
        except RemoteError as err:
            self._mark_down(str(err))
            self._set(f"failed: {err}")
            return
        except FileNotFoundError as err:
            log.warning("preheat cache: not mirroring %s: %s", local_path, err)
            self._set(f"failed: {_short(err)}")
            return
        self._set("pushed")


# ---------------------------------------------------------------------------------------------
# Implementations


class LocalDirStore(RemoteStore):
    """A shared folder (network volume, NFS): plain files, every write a temp file + rename."""

    def __init__(self, path: str | os.PathLike[str], **kw: Any):
        self.base = Path(path).expanduser().absolute()
        super().__init__(str(self.base), **kw)

    def _path(self, rel: str) -> Path:
        return self.base.joinpath(*rel.split("/"))

    def _read(self, rel: str, limit: int | None = None) -> bytes | None:
        try:
            with open(self._path(rel), "rb") as f:
                return f.read(-1 if limit is None else limit)
        except FileNotFoundError:
            return None

    def _get_file(self, rel: str, local: Path) -> None:
        shutil.copyfile(self._path(rel), local)

    def _write_atomic(self, dest: Path, write: Callable[[Any], None]) -> None:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.parent / f".tmp-{dest.name}-{uuid.uuid4().hex[:8]}"
        try:
            with open(tmp, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, dest)
        except BaseException:
            try:
                tmp.unlink()
            except FileNotFoundError:
                pass
            raise
        fsync_dir(dest.parent)

    def _put_file(self, local: Path, rel: str) -> None:
        def write(f: Any) -> None:
            with open(local, "rb") as src:
                shutil.copyfileobj(src, f, 1 << 20)

        self._write_atomic(self._path(rel), write)

    def _put_bytes(self, data: bytes, rel: str) -> None:
        self._write_atomic(self._path(rel), lambda f: f.write(data))

    def _exists(self, rel: str) -> bool:
        return self._path(rel).is_file()

    def _list(self, rel: str) -> list[str]:
        p = self._path(rel)
        return [c.name for c in p.iterdir() if c.is_dir() and not c.name.startswith(".")] if p.is_dir() else []


class FsspecStore(RemoteStore):
    """Any fsspec URL; ``s3://`` gets bounded connect/read timeouts and few retries (s3fs)."""

    def __init__(self, url: str, **kw: Any):
        super().__init__(url.rstrip("/"), **kw)
        self._fs: Any = None
        self._base = ""
        self._fs_lock = threading.Lock()

    def fs(self) -> Any:
        if self._fs is not None:
            return self._fs
        with self._fs_lock:
            return self._make_fs()

    def _make_fs(self) -> Any:
        if self._fs is None:
            try:
                import fsspec
                import fsspec.config
            except ImportError:
                raise RemoteError("fsspec is not installed (pip install 'preheat[remote]')") from None
            protocol = self.url.split("://", 1)[0] if "://" in self.url else "file"
            kwargs: dict[str, Any] = {"skip_instance_cache": True}
            if protocol in ("s3", "s3a"):
                conf = fsspec.config.conf.get("s3", {})
                endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
                if endpoint and "endpoint_url" not in conf:
                    kwargs["endpoint_url"] = endpoint
                config = {"connect_timeout": self.timeout, "read_timeout": self.timeout,
                          "retries": {"max_attempts": 2, "mode": "standard"}}
                kwargs["config_kwargs"] = {**config, **conf.get("config_kwargs", {})}
            try:
                fs, base = fsspec.core.url_to_fs(self.url, **kwargs)
            except ImportError as exc:
                raise RemoteError(f"{protocol}:// needs a package that is not installed ({exc})") from None
            if protocol in ("s3", "s3a"):
                fs.retries = 2  # s3fs's own retry loop (default 5, with backoff) on top of botocore's
            self._fs, self._base = fs, base.rstrip("/")
        return self._fs

    def _prepare(self) -> None:
        self.fs()

    def _p(self, rel: str) -> str:
        self.fs()
        return f"{self._base}/{rel}"

    def _local_fs(self) -> bool:
        return "file" in (self.fs().protocol if isinstance(self.fs().protocol, tuple) else (self.fs().protocol,))

    def _read(self, rel: str, limit: int | None = None) -> bytes | None:
        try:
            if limit is None:
                return self.fs().cat_file(self._p(rel))
            return self.fs().cat_file(self._p(rel), start=0, end=limit)
        except FileNotFoundError:
            return None

    def _get_file(self, rel: str, local: Path) -> None:
        self.fs().get_file(self._p(rel), str(local))

    def _put_file(self, local: Path, rel: str) -> None:
        if self._local_fs():  # a folder: write aside, then rename (one PUT is atomic on object stores)
            tmp = self._p(f"{rel}.tmp-{uuid.uuid4().hex[:8]}")
            self.fs().makedirs(tmp.rsplit("/", 1)[0], exist_ok=True)
            self.fs().put_file(str(local), tmp)
            self.fs().mv(tmp, self._p(rel))
        else:
            self.fs().put_file(str(local), self._p(rel))

    def _put_bytes(self, data: bytes, rel: str) -> None:
        if self._local_fs():
            tmp = self._p(f"{rel}.tmp-{uuid.uuid4().hex[:8]}")
            self.fs().makedirs(tmp.rsplit("/", 1)[0], exist_ok=True)
            self.fs().pipe_file(tmp, data)
            self.fs().mv(tmp, self._p(rel))
        else:
            self.fs().pipe_file(self._p(rel), data)

    def _exists(self, rel: str) -> bool:
        fs = self.fs()
        if hasattr(fs, "invalidate_cache"):
            fs.invalidate_cache(self._p(rel))
        return bool(fs.exists(self._p(rel)))

    def _list(self, rel: str) -> list[str]:
        fs = self.fs()
        if hasattr(fs, "invalidate_cache"):
            fs.invalidate_cache()
        try:
            listing = fs.ls(self._p(rel), detail=True)
        except FileNotFoundError:
            return []
        return [item["name"].rstrip("/").rsplit("/", 1)[-1] for item in listing if item.get("type") == "directory"]


# ---------------------------------------------------------------------------------------------
# Construction and module-level helpers


def open_store(url: str, **kw: Any) -> RemoteStore:
    """The store for ``url``: a plain path or file:// URL is a shared folder, anything else fsspec."""
    if not url:
        raise InvalidArgumentError("the cache URL is empty")
    if url.startswith("file://"):
        return LocalDirStore(url[len("file://"):], **kw)
    if "://" not in url:
        return LocalDirStore(url, **kw)
    return FsspecStore(url, **kw)


def remote_from_env(warm_up: bool = True) -> RemoteStore | None:
    """The store named by ``PREHEAT_CACHE_URL``, or None. Touches no network; ``warm_up`` starts
    the client's imports in the background (see ``RemoteStore.warm_up``)."""
    url = os.environ.get(ENV_URL, "").strip()
    if not url:
        return None
    store = open_store(url)
    if warm_up:
        store.warm_up()
    return store


_default: tuple[str, RemoteStore | None] | None = None
_default_lock = threading.Lock()


def default_store() -> RemoteStore | None:
    """``remote_from_env()``, one instance per process (per URL), shared by the mirror helpers."""
    global _default
    url = os.environ.get(ENV_URL, "").strip()
    with _default_lock:
        if _default is None or _default[0] != url:
            _default = (url, remote_from_env())
        return _default[1]


def mirror_get(name: str, local_path: str | os.PathLike[str]) -> bool:
    """Blob ``name`` (sha256) from the fleet's store into ``local_path``; False when there is no
    store, the blob is absent, or anything failed (the caller downloads from the origin)."""
    store = default_store()
    return store.mirror_get(name, local_path) if store is not None else False


def mirror_put(name: str, local_path: str | os.PathLike[str]) -> None:
    """Share blob ``local_path`` (whose sha256 is ``name``) with the fleet; no-op without a store."""
    store = default_store()
    if store is not None:
        store.mirror_put(name, local_path)


def child_env(cache_url: str) -> dict[str, str]:
    """Environment for a child process that should use ``cache_url`` (e.g. the coldstart bench's
    "remote warm" row). A signing key in this process's environment is inherited; without one the
    child is told to trust the store, since the bench writes and reads it itself."""
    env = {ENV_URL: cache_url}
    if not os.environ.get(ENV_KEY):
        env[ENV_TRUST] = "1"
    return env


def describe() -> str:
    """One line for ``preheat doctor`` / ``cache info``: the store and its trust mode."""
    store = remote_from_env()
    if store is None:
        return f"no remote cache ({ENV_URL} unset)"
    why = store.compile_policy()
    mode = (f"signed (key id {key_id(store.signing_key)})" if store.signing_key is not None
            else "trusted without signatures" if store.trust else f"not used for compile entries: {why}")
    return f"{store.url}: {mode}; timeout {store.timeout:g} s"
