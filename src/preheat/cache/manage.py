"""Looking after the cache root: list, verify, explain, prune, clear, and the size cap.

Layout of the root (``preheat.cache.root`` chooses it)::

    <root>/
      compile/
        jax/<key>/        serialized JAX executables (manifest.json + executable.bin + stats.json)
        torch/<key>/      torch.compile Mega-Cache artifacts and AOTInductor packages
        xla/              JAX's own persistent compilation cache (managed by JAX)
      models/             the weights store (blobs/ refs/ snapshots/), see preheat.store
      quarantine/         entries that failed verification or crashed a load, kept for inspection

The size cap (``PREHEAT_CACHE_MAX_GB``, default 20) covers ``compile/``: after each write the
least-recently-used entries are evicted until the total fits.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from preheat.cache.entries import Entry, entry_size, iter_entries, open_entry, quarantine, unrunnable
from preheat.errors import CacheEntryError, InvalidArgumentError

__all__ = ["EntryInfo", "disk_usage", "list_entries", "verify_entries", "enforce_size_cap", "clear", "prune", "max_bytes",
           "COMPILE_KINDS"]

COMPILE_KINDS = ("jax", "torch")
DEFAULT_MAX_GB = 20.0


def disk_usage(folder: Path, seen: set[tuple[int, int]] | None = None) -> int:
    """Bytes the files under ``folder`` take, each file once: the store's snapshots are hard links
    to its blobs, so counting paths would count their bytes twice. ``seen`` (device, inode)
    pairs are shared across calls, so that a file linked from two folders counts in the first."""
    seen = set() if seen is None else seen
    total = 0
    if not folder.is_dir():
        return 0
    for path in folder.rglob("*"):
        try:
            st = path.lstat()
        except OSError:  # removed while we walk (a prune, a pull's temp file)
            continue
        if not path.is_file() or path.is_symlink() or (st.st_dev, st.st_ino) in seen:
            continue
        seen.add((st.st_dev, st.st_ino))
        total += st.st_size
    return total


def max_bytes() -> int:
    raw = os.environ.get("PREHEAT_CACHE_MAX_GB", str(DEFAULT_MAX_GB))
    try:
        gb = float(raw)
    except ValueError:
        raise InvalidArgumentError(f"PREHEAT_CACHE_MAX_GB={raw!r} is not a number") from None
    return int(gb * 1e9)


@dataclass
class EntryInfo:
    kind: str
    key: str
    path: Path
    size: int
    created: float
    last_used: float
    hits: int
    fields: dict[str, Any]
    target: str = "local"  # the GPU it was compiled for (``warm --target``), or "local": the devices that ran it
    ok: bool | None = None  # set by verify
    problem: str = ""


def target_label(manifest: dict[str, Any]) -> str:
    """An entry's target in a word: "h200 (not autotuned)" for a ``warm --target`` entry, else
    "local"; after a retune (``preheat.cache.retune``: ``preheat warm`` or a server's idle
    retune) its two timings and outcome, or that it failed."""
    target = manifest.get("target")
    label = f"{target.get('name', '?')}" if isinstance(target, dict) else "local"
    tune = manifest.get("retune")
    if isinstance(tune, dict) and "failed" in tune:  # the retune failed: the entry serves as it was
        return f"{label} (not autotuned; retune failed: {tune['failed']})"
    if isinstance(tune, dict):
        times = f"{1e3 * float(tune.get('deviceless_s', 0)):.3g} ms deviceless, " \
                f"{1e3 * float(tune.get('autotuned_s', 0)):.3g} ms autotuned"
        return f"{label} ({'autotuned here' if tune.get('replaced') else 'kept'}: {times})"
    if not isinstance(target, dict):
        return label  # compiled by the devices that run it: autotuned where they autotune
    reason = unrunnable(manifest)
    if reason:
        return f"{label} (not autotuned; will not run: {reason})"
    if target.get("platform") == "tpu":
        return label  # nothing is autotuned on a TPU: the chip's own compile is the same program
    return label + (" (not autotuned)" if manifest.get("autotuned") is False else "")


def list_entries(root: Path) -> list[EntryInfo]:
    out = []
    for kind in COMPILE_KINDS:
        for path in iter_entries(root / "compile" / kind):
            try:
                manifest = json.loads((path / "manifest.json").read_text())
            except (OSError, ValueError):
                manifest = {}
            entry = Entry(path, manifest)
            stats = entry.stats()
            out.append(EntryInfo(kind=kind, key=path.name, path=path, size=entry_size(path),
                                 created=float(manifest.get("created", 0)), last_used=float(stats.get("last_used", 0)),
                                 hits=int(stats.get("hits", 0)), fields=manifest.get("fields", {}),
                                 target=target_label(manifest)))
    return out


def verify_entries(root: Path, *, quarantine_bad: bool = False) -> list[EntryInfo]:
    """Check every entry's manifest and sha256s (without loading anything)."""
    infos = list_entries(root)
    for info in infos:
        try:
            open_entry(info.path.parent, info.key)
            info.ok = True
        except CacheEntryError as err:
            info.ok, info.problem = False, str(err)
            if quarantine_bad:
                quarantine(root, info.path, str(err))
    return infos


def enforce_size_cap(root: Path, keep: set[str] = frozenset(), limit: int | None = None) -> list[str]:
    """Evict least-recently-used compile entries until the total is under the cap."""
    limit = max_bytes() if limit is None else limit
    infos = sorted(list_entries(root), key=lambda e: e.last_used or e.created)
    total = sum(e.size for e in infos)
    evicted = []
    for info in infos:
        if total <= limit:
            break
        if info.key in keep:
            continue
        shutil.rmtree(info.path, ignore_errors=True)
        total -= info.size
        evicted.append(info.key)
    return evicted


def prune(root: Path, older_than_days: float | None = None) -> list[str]:
    """Remove quarantined entries, leftover temp folders, and (optionally) entries unused for N days."""
    removed = []
    q = root / "quarantine"
    if q.is_dir():
        for p in q.iterdir():
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
            removed.append(f"quarantine/{p.name}")
    for kind in COMPILE_KINDS:
        kdir = root / "compile" / kind
        if kdir.is_dir():
            for p in kdir.glob(".tmp-*"):
                if time.time() - p.stat().st_mtime > 3600:  # an interrupted write, not one in progress
                    shutil.rmtree(p, ignore_errors=True)
                    removed.append(f"{kind}/{p.name}")
    if older_than_days is not None:
        cutoff = time.time() - older_than_days * 86400
        for info in list_entries(root):
            if (info.last_used or info.created) < cutoff:
                shutil.rmtree(info.path, ignore_errors=True)
                removed.append(f"{info.kind}/{info.key}")
    return removed


def clear(root: Path) -> int:
    """Delete every compile entry and JAX's own cache (weights are kept)."""
    n = 0
    for sub in ("jax", "torch", "xla"):
        d = root / "compile" / sub
        if d.is_dir():
            n += sum(1 for _ in d.iterdir())
            shutil.rmtree(d, ignore_errors=True)
    return n
