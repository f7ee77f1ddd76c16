"""Collecting what no ref names: snapshots and blobs left by a re-pull of a changed source, a
``force`` pull, or a pull killed before its ref was written.

A pull writes blobs, then its snapshot (hardlinks to the blobs), then its ref, so a blob or a
snapshot that no ref names may belong to a pull in progress. Only those older than ``grace_s``
go, their age taken from both mtime and ctime: hardlinking a blob into a snapshot bumps its ctime,
so a blob a pull just reused is young again. Nothing is collected while any ref is unreadable
(what it names is unknown); ``verify_store`` reports such a ref.

Leftovers of a process killed mid-write (``blobs/.tmp-*`` files, ``blobs/.tmp-tar-*`` staging
folders of a tar extraction, ``snapshots/.tmp-*`` folders being assembled) go too, once nothing in
them has changed for ``grace_s``: a writer still at work keeps touching them.

Folders made from the store's files live beside it (``models/single/<name>``: a single checkpoint
file converted to a diffusers folder, linking the VAE and text encoders of a snapshot;
``models/single-configs/<name>``: its config folder), each naming what it was made from
(``preheat.files.MADE_FROM``). One made from a snapshot no ref names (a re-pull moved its ref)
or from a file that is gone is one no load reaches again (it is found by where its inputs are), so
it goes with them, once older than ``grace_s``: its links would dangle, and a converted
transformer is the largest thing in it. While a ref names its snapshot it stays, and so do the
snapshot's blobs, so a restart reads the converted folder with no fetch and no conversion.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from preheat.files import read_made_from
from preheat.store._layout import HEX64, Store

__all__ = ["collect_orphans"]


def _age(path: Path, now: float) -> float:
    st = path.stat()
    return now - max(st.st_mtime, st.st_ctime)


def _age_tree(path: Path, now: float) -> float:
    """The age of the youngest thing at or under ``path`` (a writer may be filling any of it)."""
    age = _age(path, now)
    if path.is_dir():
        for dirpath, dirnames, filenames in os.walk(path):
            for name in dirnames + filenames:
                try:
                    age = min(age, _age(Path(dirpath) / name, now))
                except OSError:
                    pass
    return age


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def collect_orphans(root: str | os.PathLike[str], *, grace_s: float = 3600.0, now: float | None = None,
                    dry_run: bool = False) -> list[str]:
    """Delete (or, with ``dry_run``, list) the snapshots and blobs of ``<root>/models`` that no
    ref names and that are older than ``grace_s``, and stale ``.tmp-*`` leftovers; returns their
    ``models/``-relative paths."""
    store = Store(Path(root))
    now = time.time() if now is None else now
    snapshots, blobs = set(), set()
    for sid in store.ref_ids():
        ref = store.read_ref(sid)
        if ref is None:
            return []
        snapshots.add(ref.snapshot)
        blobs.update(e.sha256 for e in ref.files)
    old_blobs = []  # aged before any snapshot is removed (that bumps the blobs' ctime)
    if store.blobs.is_dir():
        for p in sorted(store.blobs.iterdir()):
            if HEX64.match(p.name) and p.name not in blobs and p.is_file() and _age(p, now) > grace_s:
                old_blobs.append(p)
    removed = []
    if store.snapshots.is_dir():
        for p in sorted(store.snapshots.iterdir()):
            if HEX64.match(p.name) and p.name not in snapshots and p.is_dir() and _age(p, now) > grace_s:
                if not dry_run:
                    shutil.rmtree(p, ignore_errors=True)
                removed.append(f"snapshots/{p.name}")
    for p in old_blobs:
        if not dry_run:
            p.unlink(missing_ok=True)
        removed.append(f"blobs/{p.name}")
    for p in _derived(store, snapshots, grace_s, now):
        if not dry_run:
            shutil.rmtree(p, ignore_errors=True)
        removed.append(p.relative_to(store.models).as_posix())
    for folder in (store.blobs, store.snapshots):
        if not folder.is_dir():
            continue
        for p in sorted(folder.iterdir()):
            try:
                stale = p.name.startswith(".tmp-") and _age_tree(p, now) > grace_s
            except OSError:  # removed meanwhile by its writer
                continue
            if stale:
                if not dry_run:
                    _remove(p)
                removed.append(f"{folder.name}/{p.name}")
    return removed


_OWN = ("blobs", "snapshots", "refs", "downloads", "locks", "hf")  # the store's own folders under models/


def _inputs(folder: Path) -> list[Path]:
    """What a derived folder was made from: its record, or (a folder made before records were
    written) the targets of its links."""
    recorded = read_made_from(folder)
    if recorded is not None:
        return recorded
    return [Path(os.path.realpath(p)) for p in folder.rglob("*") if p.is_symlink()]


def _derived(store: Store, live: set[str], grace_s: float, now: float) -> list[Path]:
    """The folders under ``models/<kind>/`` (not the store's own) that name their inputs and were
    made from a snapshot no ref names (``live``: those that one does) or from a file that is gone,
    older than ``grace_s``; and stale ``.tmp-*`` folders there (a conversion killed mid-write)."""
    out = []
    snapshots = store.snapshots.resolve() if store.snapshots.is_dir() else store.snapshots
    kinds = sorted(p for p in store.models.iterdir() if p.is_dir() and p.name not in _OWN) if store.models.is_dir() else []
    for kind in kinds:
        for folder in sorted(kind.iterdir()):
            try:
                if not folder.is_dir() or folder.is_symlink() or _age(folder, now) <= grace_s:
                    continue
                if folder.name.startswith(".tmp-"):
                    if _age_tree(folder, now) > grace_s:
                        out.append(folder)
                    continue
                if any(not p.exists() or (p.is_relative_to(snapshots) and p.relative_to(snapshots).parts[0] not in live)
                       for p in _inputs(folder)):
                    out.append(folder)
            except OSError:  # removed meanwhile
                continue
    return out
