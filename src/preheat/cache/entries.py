"""Cache entries: a folder of files plus a manifest, published atomically, verified on read.

An entry is one folder ``<kind-dir>/<key>/``::

    manifest.json      {"schema", "kind", "key", "fields", "files": {name: {"sha256", "size"}}, "created", ...}
    <payload files>    e.g. executable.bin
    stats.json         {"hits", "last_used"}: bookkeeping, not verified, safe to lose
    loading.<host>.<pid>.<start>   present only while a process deserialises the entry

Publishing: the entry is written complete into a sibling temp folder, fsynced, then renamed to
``<key>/`` in one ``rename``. If another process published the same key first, the rename fails
and ours is discarded: exactly one complete entry per key, and no reader ever sees a torn one.

Crash-loop protection: deserialising an executable can kill the process (jax #28908), which no
``try`` catches. A reader drops a ``loading.*`` marker naming its host, pid and process start time
before loading and removes it after. A marker whose process is gone (or whose pid was reused by a
newer process: containers restart as pid 1) means that load crashed: the entry is quarantined.

Replacing (``replace_entry``: a faster executable for the same key, ``preheat.cache.retune``): the
new entry is written complete into a sibling temp folder, then swapped with the old one in one
``renameat2(RENAME_EXCHANGE)``; where the filesystem cannot exchange, the old entry is renamed
aside first, so a reader between the two renames sees a miss (it compiles), never a mix. Killed
at any point, the key holds the old entry, the new one, or nothing; leftovers are ``.tmp-*``
folders, which no reader opens and ``preheat cache prune`` removes.

Quarantine: a bad entry is renamed into ``<root>/quarantine/`` (kept for inspection, pruned by
``preheat cache prune``) and the caller recompiles. It never raises to the user.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import re
import shutil
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

from preheat.files import atomic_write_bytes, fsync_dir, sha256_file
from preheat.errors import CacheEntryError

__all__ = ["Entry", "publish_entry", "replace_entry", "rewrite_manifest", "open_entry", "checked_entry", "quarantine", "iter_entries", "LoadingMarker", "SCHEMA",
           "entry_size", "UNRUNNABLE", "unrunnable_cudnn_calls", "unrunnable"]

SCHEMA = 1
MANIFEST = "manifest.json"
STATS = "stats.json"


@dataclass
class Entry:
    path: Path
    manifest: dict[str, Any]

    @property
    def key(self) -> str:
        return self.manifest["key"]

    def file(self, name: str) -> Path:
        return self.path / name

    def stats(self) -> dict[str, Any]:
        try:
            return json.loads((self.path / STATS).read_text())
        except (OSError, ValueError):
            return {"hits": 0, "last_used": self.manifest.get("created", 0)}

    def record_hit(self) -> None:
        stats = self.stats()
        stats["hits"] = int(stats.get("hits", 0)) + 1
        stats["last_used"] = time.time()
        try:
            # no fsync: a hit count lost to a power cut costs nothing, and this is on the first call's path
            atomic_write_bytes(self.path / STATS, json.dumps(stats).encode(), durable=False)
        except OSError:
            pass  # bookkeeping only


def entry_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def publish_entry(kind_dir: Path, key: str, files: dict[str, bytes], fields: dict[str, Any],
                  extra: dict[str, Any] | None = None) -> tuple[Entry, bool]:
    """Write an entry atomically. Returns (entry, won): won is False when another writer was first."""
    kind_dir.mkdir(parents=True, exist_ok=True)
    final = kind_dir / key
    if (final / MANIFEST).is_file():
        return Entry(final, json.loads((final / MANIFEST).read_text())), False
    tmp = kind_dir / f".tmp-{key}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        manifest = _write_complete(tmp, kind_dir.name, key, files, fields, extra)
        try:
            os.rename(tmp, final)  # atomic publish; fails if `final` exists and is not empty
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            if (final / MANIFEST).is_file():
                return Entry(final, json.loads((final / MANIFEST).read_text())), False
            raise
        fsync_dir(kind_dir)
        return Entry(final, manifest), True
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write_complete(folder: Path, kind: str, key: str, files: dict[str, bytes], fields: dict[str, Any],
                    extra: dict[str, Any] | None) -> dict[str, Any]:
    """Write an entry's payload files and then its manifest into ``folder``, each fsynced."""
    listing = {}
    for name, data in files.items():
        with open(folder / name, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        listing[name] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    manifest = {"schema": SCHEMA, "kind": kind, "key": key, "fields": fields, "files": listing,
                "created": time.time(), **(extra or {})}
    with open(folder / MANIFEST, "w") as f:
        f.write(json.dumps(manifest, indent=1, sort_keys=True))
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(folder)
    return manifest


_AT_FDCWD, _RENAME_EXCHANGE = -100, 2  # <fcntl.h>, <linux/fs.h>


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux ``renameat2(RENAME_EXCHANGE)``, glibc >= 2.28); False
    where the system or the filesystem cannot (the caller then renames in two steps)."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    renameat2.restype = ctypes.c_int
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM):
        return False
    raise OSError(err, os.strerror(err), str(b))


def replace_entry(kind_dir: Path, key: str, files: dict[str, bytes], fields: dict[str, Any],
                  extra: dict[str, Any] | None = None) -> Entry:
    """Put a new entry in place of ``key``'s (see the module docstring: one exchange, else a
    miss between two renames, never a mix of old and new files)."""
    kind_dir.mkdir(parents=True, exist_ok=True)
    final = kind_dir / key
    tmp = kind_dir / f".tmp-{key}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        manifest = _write_complete(tmp, kind_dir.name, key, files, fields, extra)
        if final.is_dir() and _exchange(tmp, final):
            pass  # ``tmp`` now holds the old entry
        elif final.is_dir():
            aside = kind_dir / f".tmp-{key}-{uuid.uuid4().hex[:8]}-old"
            os.rename(final, aside)  # from here until the next rename, the key is a miss
            try:
                os.rename(tmp, final)
            except OSError:
                os.rename(aside, final)  # the old entry back
                raise
            tmp = aside
        else:
            os.rename(tmp, final)
        fsync_dir(kind_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return Entry(final, manifest)


def rewrite_manifest(path: Path, manifest: dict[str, Any]) -> None:
    """Replace an entry's manifest atomically (its payload unchanged: ``files`` must still match)."""
    atomic_write_bytes(path / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())


def open_entry(kind_dir: Path, key: str, expected_fields: dict[str, Any] | None = None) -> Entry | None:
    """The verified entry for ``key``; None when absent. Raises CacheEntryError when it is bad."""
    path = kind_dir / key
    if not path.is_dir():
        return None
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise CacheEntryError(f"entry {key} has no manifest") from None
    except (OSError, ValueError) as exc:
        raise CacheEntryError(f"entry {key} has an unreadable manifest ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("schema") != SCHEMA or manifest.get("key") != key:
        raise CacheEntryError(f"entry {key} has a manifest of another schema or key")
    if expected_fields is not None and manifest.get("fields") != expected_fields:
        diff = diff_fields(manifest.get("fields") or {}, expected_fields)
        raise CacheEntryError(f"entry {key} was built for other settings ({', '.join(diff) or 'fields'})")
    entry = Entry(path, manifest)
    verify_files(entry)
    return entry


def verify_files(entry: Entry) -> None:
    listing = entry.manifest.get("files")
    if not isinstance(listing, dict) or not listing:
        raise CacheEntryError(f"entry {entry.path.name} lists no files")
    for name, meta in listing.items():
        f = entry.path / name
        if "/" in name or name.startswith("."):
            raise CacheEntryError(f"entry {entry.path.name} lists an unsafe file name {name!r}")
        if not f.is_file():
            raise CacheEntryError(f"entry {entry.path.name} is missing {name}")
        if f.stat().st_size != meta.get("size"):
            raise CacheEntryError(f"entry {entry.path.name}: {name} has {f.stat().st_size} bytes, manifest says {meta.get('size')}")
        if sha256_file(f) != meta.get("sha256"):
            raise CacheEntryError(f"entry {entry.path.name}: {name} fails its sha256")


def diff_fields(have: dict[str, Any], want: dict[str, Any], prefix: str = "") -> list[str]:
    """The key fields that differ, as dotted paths into nested fields (``signature.batch``)."""
    out = []
    for k in sorted(set(have) | set(want)):
        a, b = have.get(k), want.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out.extend(diff_fields(a, b, f"{prefix}{k}."))
        elif a != b:
            out.append(f"{prefix}{k}")
    return out


def quarantine(root: Path, path: Path, reason: str) -> Path | None:
    """Move a bad entry aside (atomic rename); returns where it went, None if it was gone already."""
    qdir = root / "quarantine"
    qdir.mkdir(parents=True, exist_ok=True)
    dest = qdir / f"{path.parent.name}-{path.name}-{int(time.time())}-{uuid.uuid4().hex[:6]}"
    try:
        os.rename(path, dest)
    except FileNotFoundError:
        return None
    try:
        (dest / "QUARANTINED").write_text(reason + "\n")
    except OSError:
        pass
    return dest


def iter_entries(kind_dir: Path) -> Iterator[Path]:
    if not kind_dir.is_dir():
        return
    for p in sorted(kind_dir.iterdir()):
        if p.is_dir() and not p.name.startswith("."):
            yield p


# ---------------------------------------------------------------------------------------------
# Crash-loop protection


def _process_start_ticks(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


class LoadingMarker:
    """``with LoadingMarker(entry_dir): load()`` leaves a marker only if the process dies inside."""

    PREFIX = "loading."

    def __init__(self, entry_dir: Path):
        self.entry_dir = entry_dir
        pid = os.getpid()
        self.path = entry_dir / f"{self.PREFIX}{socket.gethostname()}.{pid}.{_process_start_ticks(pid) or 0}"

    def __enter__(self) -> "LoadingMarker":
        # No fsync: the marker must outlive a process that dies while loading, and the page
        # cache does that; a machine that loses power loses only the marker, which then blames
        # no entry. A sync here sat on every warm start's critical path (~10 ms locally, more
        # on a network volume).
        self.path.write_text(str(time.time()))
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass

    @classmethod
    def crashed_loads(cls, entry_dir: Path, stale_after_s: float = 600.0) -> list[str]:
        """Markers left by loads that cannot still be running (their process is gone or reborn).

        Markers from other hosts (a shared volume) cannot be checked by pid; they count as
        crashed once older than ``stale_after_s``.
        """
        host = socket.gethostname()
        dead = []
        for marker in entry_dir.glob(f"{cls.PREFIX}*"):
            try:
                mhost, pid_s, start_s = marker.name[len(cls.PREFIX):].rsplit(".", 2)
                pid, start = int(pid_s), int(start_s)
            except ValueError:
                dead.append(marker.name)
                continue
            if mhost != host:
                try:
                    if time.time() - marker.stat().st_mtime > stale_after_s:
                        dead.append(marker.name)
                except FileNotFoundError:
                    pass
                continue
            if pid == os.getpid() and start == (_process_start_ticks(pid) or 0):
                continue  # our own, in progress (another thread)
            alive_start = _process_start_ticks(pid)
            if alive_start is None or alive_start != start:
                dead.append(marker.name)
        return dead


def checked_entry(kind_dir: Path, key: str, expected_fields: dict[str, Any] | None = None) -> Entry | None:
    """``open_entry``, after checking that no earlier load of this entry crashed its process.

    Raises CacheEntryError for a crashed load or a bad entry: the caller quarantines and recompiles.
    """
    path = kind_dir / key
    if path.is_dir():
        crashed = LoadingMarker.crashed_loads(path)
        if crashed:
            raise CacheEntryError(f"a previous load crashed the process ({crashed[0]})")
    return open_entry(kind_dir, key, expected_fields)


# The manifest field of a ``warm --target`` entry whose executable a GPU will not run, and why.
# XLA's deviceless compile cannot finish a cuDNN call: it leaves each convolution's algorithm
# unchosen (``algo_id`` -1: choosing one is autotuning, which needs the device; the H200 rejected
# such an executable at its first run with CUDNN_STATUS_BAD_PARAM, jax 0.11.2), and it builds no
# graph for a fused attention or cuDNN fusion call (XLA builds those only with the device, and the
# runtime looks the graph up, never builds it: docs/gpu.md). preheat's own deviceless traces avoid
# both (the GPU's description in ``preheat.platforms``); a forced ``PREHEAT_CONV=conv`` or a program that
# asks for cuDNN itself still gets them. A pod quarantines such an entry without loading it and
# compiles its own. Round 11's entries recorded a count of convolutions under the older field.
UNRUNNABLE = "gpu_unrunnable"
_UNCHOSEN_CONVOLUTIONS = "cudnn_convolutions_unchosen"
_UNCHOSEN = re.compile(r'custom_call_target="__cudnn\$conv[^"]*".*?"algo_id":"-1"')
_GRAPH_CALL = re.compile(r'custom_call_target="__cudnn\$(fmha|fusion)')


def unrunnable_cudnn_calls(compiled: Any) -> Optional[str]:
    """Why a GPU executable compiled without its device will not run (its cuDNN calls that the
    compile could not finish), or None."""
    try:
        text = compiled.as_text()
    except Exception:  # an executable that cannot print itself: nothing to say
        return None
    lines = text.splitlines()
    convolutions = sum(1 for line in lines if _UNCHOSEN.search(line))
    graphs = sum(1 for line in lines if _GRAPH_CALL.search(line))
    reasons = ([f"{convolutions} cuDNN convolution(s) with no algorithm chosen"] if convolutions else []) \
        + ([f"{graphs} cuDNN graph call(s) (fused attention or fusion) with no graph built"] if graphs else [])
    return "; ".join(reasons) or None


def unrunnable(manifest: dict[str, Any]) -> Optional[str]:
    """Why the entry of ``manifest`` will not run on its GPU, or None (``UNRUNNABLE``)."""
    reason = manifest.get(UNRUNNABLE)
    if isinstance(reason, str) and reason:
        return reason
    old = manifest.get(_UNCHOSEN_CONVOLUTIONS)
    return f"{old} cuDNN convolution(s) with no algorithm chosen" if old else None
