"""File I/O shared by every package: atomic writes, sha256 of a file, and the record of what a
derived folder was made from.

Atomic file writes: a unique temp name in the same folder, fsync, ``os.replace``, fsync the folder.

A reader sees either the old file or the complete new one, never a torn one, even if the writer is
killed mid-write. ``flock`` is not used for correctness: it is unreliable on network filesystems
(NFS, Runpod network volumes), where ``rename`` within one folder is still atomic.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import NamedTuple

__all__ = ["atomic_write_bytes", "fsync_dir", "sha256_file", "sha256_and_size", "publish_folder", "MADE_FROM",
           "write_made_from", "read_made_from", "changed_inputs", "removed_from_config", "Removed",
           "Seen"]

CHUNK = 1 << 20  # bytes read at a time while hashing


def fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _read_umask() -> int:
    mask = os.umask(0)  # the only way to read it; done once, at import, before any threads write
    os.umask(mask)
    return mask


_UMASK = _read_umask()


def atomic_write_bytes(path: str | Path, data: bytes, mode: int | None = None, durable: bool = True) -> None:
    """Write ``data`` to ``path`` atomically; ``mode`` defaults to 0666 less the umask.

    ``durable=False`` skips the two fsyncs: readers still see the old bytes or the new ones,
    never a mix, but a power loss may lose the write. For bookkeeping on a hot path (an
    entry's hit count is written on every warm start's first call)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, (0o666 & ~_UMASK) if mode is None else mode)  # mkstemp makes 0600
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            if durable:
                handle.flush()
                os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    if durable:
        fsync_dir(path.parent)


def sha256_and_size(path: str | Path) -> tuple[str, int]:
    """The file's sha256 (hex) and size, read in chunks (weights files are gigabytes)."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(CHUNK):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


def sha256_file(path: str | Path) -> str:
    return sha256_and_size(path)[0]


def publish_folder(tmp: str | Path, out: str | Path, marker: str = "model_index.json") -> None:
    """Rename the finished folder ``tmp`` to ``out`` in one step, so a reader sees all of it or none.

    Two processes may build the same folder at once: the loser's rename fails, which is fine when
    the winner's ``out`` is complete (holds ``marker``); ``tmp`` is the caller's to remove.
    """
    try:
        os.rename(tmp, out)
    except OSError:
        if not (Path(out) / marker).is_file():
            raise


# A folder made from other files and kept beside the weights store (``<root>/models/<kind>/<name>/``:
# a single file converted to a diffusers folder, its config folder) names them here, so that the
# store's garbage collection (``preheat.store.collect_orphans``) collects it with them: a folder
# made from a snapshot no ref names any more is one no load can reach again. Each input's size and
# mtime are recorded beside it, and for an input that names the folder by its content (a config
# folder's JSON and tokenizer files) its sha256 too: the folders are named by their weights' (path,
# size, mtime) and their small files' content, so an input rewritten in place (the same path, new
# content) names another folder, and this one is stale.
MADE_FROM = ".made-from.json"


class Seen(NamedTuple):
    """An input of a made folder as it was when the folder was made (what names the folder)."""

    size: int
    mtime_ns: int
    sha256: str | None = None  # an input named by its content (a config file); None: by where it is


def _seen(path: Path) -> Seen:
    st = path.stat()
    return Seen(st.st_size, st.st_mtime_ns)


def write_made_from(folder: str | Path, inputs: "list[Path]", contents: "list[Path] | tuple[Path, ...]" = (),
                    config_weights: "list[Path] | tuple[Path, ...]" = ()) -> None:
    """Record the files ``folder`` was made from (their resolved paths: a link's target), each with
    its size and mtime (``Seen``); ``contents`` are inputs too, named by their content (a config
    folder's configs and tokenizer files, hashed into the folder's name): their sha256 is recorded,
    so rewriting one with other bytes makes the folder stale, and touching it (the same bytes) does not.
    ``config_weights`` are inputs named by where they are that belong to the same config folder as
    ``contents`` (its weights files): recorded as such, so one deleted while the rest of that folder
    is there reads as removed from it (``removed_from_config``), not as a missing source."""
    by_content = {str(Path(p).resolve()) for p in contents}
    of_config = {str(Path(p).resolve()) for p in config_weights}
    paths = sorted({str(Path(p).resolve()) for p in inputs} | by_content | of_config)
    seen = {p: list(_seen(Path(p))[:2]) for p in paths if os.path.exists(p)}  # (one already gone: nothing to compare)
    sha = {p: sha256_file(p) for p in sorted(by_content) if p in seen}
    (Path(folder) / MADE_FROM).write_text(json.dumps({"inputs": paths, "seen": seen, "sha256": sha,
                                                      "config_weights": sorted(of_config)}, indent=1) + "\n")


def read_made_from(folder: str | Path) -> list[Path] | None:
    """The files ``folder`` was made from; None when it has no (readable) record."""
    try:
        raw = json.loads((Path(folder) / MADE_FROM).read_text())
        return [Path(p) for p in raw["inputs"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def changed_inputs(folder: str | Path) -> list[tuple[Path, Seen, Seen]]:
    """The inputs of ``folder`` that are there but not as its record saw them, as (path, then, now):
    another size or mtime (rewritten in place since), unless the input is named by its content and
    that is unchanged (its sha256, read only then: a config file touched or copied again). [] for
    a folder recorded without sizes and mtimes (made before they were), and for a missing input
    (``read_made_from`` names it)."""
    try:
        raw = json.loads((Path(folder) / MADE_FROM).read_text())
        sha = {Path(p): str(v) for p, v in raw.get("sha256", {}).items()}
        recorded = {Path(p): Seen(*map(int, v), sha.get(Path(p))) for p, v in raw.get("seen", {}).items()}
    except (OSError, ValueError, TypeError, AttributeError):
        return []
    out = []
    for path, then in sorted(recorded.items()):
        try:
            now = _seen(path)
            if now[:2] == then[:2]:
                continue
            if then.sha256 is not None:
                now = now._replace(sha256=sha256_file(path))
                if now.sha256 == then.sha256:
                    continue
        except OSError:  # missing (or gone while read): not a change
            continue
        out.append((path, then, now))
    return out


class Removed(NamedTuple):
    """A recorded file of a made folder's config folder, deleted while the rest of that folder is there."""

    path: Path
    weights: bool  # a weights file (recorded by where it is); False: a config or tokenizer file (by its sha256)


def removed_from_config(folder: str | Path) -> list[Removed]:
    """The inputs of ``folder`` from its config folder (its JSON and tokenizer files, recorded with
    their sha256, and its weights files, recorded as ``config_weights``) that are gone while another
    of them is still there: the file was deleted from a folder that is still mounted, so ``folder``
    was made from a config folder no load reads again (stale), not from one on an unmounted drive
    (every one of them gone: kept, as a missing source is). A record without ``config_weights``
    (made before it was written) names only its config files; [] for one naming neither."""
    try:
        raw = json.loads((Path(folder) / MADE_FROM).read_text())
        files = [Removed(Path(p), False) for p in raw.get("sha256", {})]
        files += [Removed(Path(p), True) for p in raw.get("config_weights", [])]
    except (OSError, ValueError, TypeError, AttributeError):
        return []
    there = [f.path.exists() for f in files]
    return [f for f, ok in zip(files, there) if not ok] if any(there) else []
