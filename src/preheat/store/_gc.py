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
or from a store file that is gone is one no load reaches again (it is found by where its inputs
are), so it goes with them, once older than ``grace_s``: its links would dangle, and a converted
transformer is the largest thing in it. While a ref names its snapshot it stays, and so do the
snapshot's blobs, so a restart reads the converted folder with no fetch and no conversion.

One whose source was rewritten in place (the same path, another size or mtime than its record
saw: ``preheat.files.changed_inputs``) is stale: the folders are named by their inputs' path, size
and mtime, so the next load converts the new content into another folder and no load reaches
this one; it goes with the next gc, once older than ``grace_s``, saying which source changed.
(A rewrite that keeps both size and mtime, such as ``cp -p`` of a same-sized file, goes unseen:
hashing every source at every gc would read gigabytes.) The config folder's JSON and tokenizer
files name a conversion by their content, and are recorded with their sha256: an edited config
makes it stale the same way ("its config file ... changed"), a config touched or copied with the
same bytes does not (the next load reads the same folder). So does a recorded config file, or a
weights file of the config folder, deleted while the rest of its config folder is there ("its config
file ... was removed", "its config folder's weights file ... was removed": the folder is mounted, so
the file is gone, not away; ``preheat.files.removed_from_config``); with every one of them gone
too, the folder may be on an unmounted drive, and is kept as a missing source below.

A dead or stale folder younger than ``grace_s`` says so, and when it goes (``Derived.kept_until``:
"...; kept until <time> UTC"): its state is what it is whatever its age; only its collection waits.

A source *outside* the cache root (the user's ``/mnt/models/x.safetensors``) that is missing may
only be unmounted: as huggingface_hub's cache never deletes behind its user's back, its conversion
is kept (``derived_folders`` says why) until ``drop_missing_sources=True`` (``preheat cache prune
--drop-missing-sources``) removes it; the drive mounted again, the next load reads it with no
conversion. Whether a source is inside is where its path is, not whether it exists.

    derived_folders(root)   every folder made from the store's files: kept or collected, and why
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import NamedTuple

from preheat.files import Removed, Seen, changed_inputs, read_made_from, removed_from_config
from preheat.store._layout import HEX64, Store

__all__ = ["collect_orphans", "derived_folders", "Derived"]


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
                    dry_run: bool = False, drop_missing_sources: bool = False) -> list[str]:
    """Delete (or, with ``dry_run``, list) the snapshots and blobs of ``<root>/models`` that no
    ref names and that are older than ``grace_s``, stale ``.tmp-*`` leftovers, and the folders made
    from them (``derived_folders``; with ``drop_missing_sources``, also those whose source outside
    the cache root is missing); returns their ``models/``-relative paths."""
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
    for d in _derived(store, snapshots, grace_s, now):
        if d.collect or (drop_missing_sources and d.state == "missing-source"):
            if not dry_run:
                shutil.rmtree(d.folder, ignore_errors=True)
            removed.append(d.name)
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


class Derived(NamedTuple):
    """A folder made from the store's files (``models/<kind>/<name>``), and what gc does with it."""

    folder: Path
    name: str  # its models/-relative path: "single/<name>"
    state: str  # live | dead | changed-source | missing-source | in-progress | stale-tmp
    why: str  # one line, for `preheat cache ls` and `prune`
    kept_until: float | None = None  # a dead or stale folder still in its grace period: collected from then

    @property
    def collect(self) -> bool:
        """Collected by every prune (a missing outside source only when asked: ``collect_orphans``),
        once out of its grace period."""
        return self.state in ("dead", "changed-source", "stale-tmp") and self.kept_until is None


def derived_folders(root: str | os.PathLike[str], *, grace_s: float = 3600.0,
                    now: float | None = None) -> list[Derived]:
    """Every folder made from the store's files, with what ``collect_orphans`` does with it and why
    (nothing is read but records, links and stat); [] while a ref is unreadable, as gc then collects
    nothing."""
    store = Store(Path(root))
    live = set()
    for sid in store.ref_ids():
        ref = store.read_ref(sid)
        if ref is None:
            return []
        live.add(ref.snapshot)
    return _derived(store, live, grace_s, time.time() if now is None else now)


def _utc(t: float) -> str:
    return time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(t))


def _when(seen: Seen) -> str:
    if seen.sha256 is not None:  # named by its content: a config file
        return f"sha256 {seen.sha256[:12]}"
    return f"{seen.size:,d} B, mtime {_utc(seen.mtime_ns / 1e9)} UTC"


def _verdict(inputs: list[Path], inside: Path, snapshots: Path, live: set[str],
             changed: list[tuple[Path, Seen, Seen]], removed: list[Removed]) -> tuple[str, str]:
    """(state, why) of a folder made from ``inputs``: a store input gone or of an unnamed snapshot
    collects it, as does an input rewritten in place (``changed``) or a config or weights file
    deleted from a config folder still there (``removed``); an input outside the cache root that is missing keeps
    it (it may be unmounted)."""
    missing_outside = []
    for p in inputs:
        if p.is_relative_to(snapshots):
            sid = p.relative_to(snapshots).parts[0]
            if sid not in live:
                return "dead", f"made from snapshot {sid[:12]}, which no ref names (a re-pull moved it): no load reaches it"
        if not p.exists():
            if p.is_relative_to(inside):
                return "dead", f"made from {p.relative_to(inside).as_posix()}, which the cache root no longer holds"
            missing_outside.append(p)
    if changed:
        path, then, now = changed[0]
        what = "config file" if then.sha256 is not None else "source"
        return "changed-source", (f"its {what} {path} changed since it was made ({_when(then)} then, {_when(now)} "
                                   "now): the next load converts it again, no load reaches this one")
    if removed:
        path, weights = removed[0]
        what = "config folder's weights file" if weights else "config file"
        return "changed-source", (f"its {what} {path} was removed since it was made (the rest of its "
                                   "config folder is there): no load reaches this one")
    if missing_outside:
        return "missing-source", f"its source {missing_outside[0]} is missing (an unmounted drive?)"
    return "live", "its sources are there and a ref names every snapshot it links"


def _derived(store: Store, live: set[str], grace_s: float, now: float) -> list[Derived]:
    """The folders under ``models/<kind>/`` (not the store's own) that name their inputs, each with
    its verdict (``_verdict``; one made from a folder this gc collects is dead with it: a
    conversion read with a stale config folder), collected once older than ``grace_s``, and ``.tmp-*`` folders
    there (a conversion in progress, or one killed mid-write: stale once nothing in it changed for
    ``grace_s``)."""
    found: list[Derived | tuple[Path, str, list[Path], str, str, float]] = []
    snapshots = store.snapshots.resolve() if store.snapshots.is_dir() else store.snapshots
    inside = store.models.resolve().parent if store.models.is_dir() else store.models.parent  # the cache root
    kinds = sorted(p for p in store.models.iterdir() if p.is_dir() and p.name not in _OWN) if store.models.is_dir() else []
    for kind in kinds:
        for folder in sorted(kind.iterdir()):
            name = folder.relative_to(store.models).as_posix()
            try:
                if not folder.is_dir() or folder.is_symlink():
                    continue
                if folder.name.startswith(".tmp-"):
                    stale = _age(folder, now) > grace_s and _age_tree(folder, now) > grace_s
                    found.append(Derived(folder, name, "stale-tmp" if stale else "in-progress",
                                         f"a conversion killed mid-write (unchanged for over {grace_s:g} s)" if stale
                                         else "a conversion in progress"))
                    continue
                inputs = _inputs(folder)
                state, why = _verdict(inputs, inside, snapshots, live, changed_inputs(folder),
                                      removed_from_config(folder))
                found.append((folder, name, inputs, state, why, _age(folder, now)))
            except OSError:  # removed meanwhile
                continue
    going = {f[0].resolve(): f[1] for f in found  # collected by this gc: past their grace too
             if isinstance(f, tuple) and f[3] in ("dead", "changed-source") and f[5] > grace_s}
    out = []
    for f in found:
        if isinstance(f, Derived):
            out.append(f)
            continue
        folder, name, inputs, state, why, age = f
        if state in ("live", "missing-source"):
            source = next((going[g] for p in inputs for g in going if p.is_relative_to(g)), None)
            if source is not None:
                state, why = "dead", f"made from {source}, which goes too: no load reaches it"
        if state in ("dead", "changed-source") and age <= grace_s:  # stale, but maybe a writer's at work
            until = now - age + grace_s
            out.append(Derived(folder, name, state, f"{why}; kept until {_utc(until)} UTC, "
                               f"{grace_s:g} s after it was made (prune's grace)", until))
            continue
        out.append(Derived(folder, name, state, why))
    return out
