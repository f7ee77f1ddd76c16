"""Writing blobs and publishing snapshots; safe tar extraction; scanning local folders.

Every blob is written to a unique ``blobs/.tmp-*`` file (or is a finished download renamed from
``downloads/``), fsynced, hashed, and only then renamed to ``blobs/<sha256>``. A snapshot is
assembled in ``snapshots/.tmp-*`` and renamed into place when every file is linked. None of this
makes a source "pulled": only its ref does, and the ref is written after all of it.
"""

from __future__ import annotations

import errno
import hashlib
import os
import posixpath
import shutil
import tarfile
import tempfile
import uuid
from pathlib import Path
from typing import BinaryIO, Iterable, TypeVar

from preheat.files import fsync_dir, sha256_and_size
from preheat.errors import FetchError, ModelNotFoundError
from preheat.store._layout import FileEntry, Store, check_relpath, one_line, snapshot_id

CHUNK = 1 << 20
T = TypeVar("T")


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------
# Blobs


def publish_blob(store: Store, tmp: Path, sha: str, size: int, *, check_existing: bool = False) -> Path:
    """Rename a finished, fsynced, hashed file to ``blobs/<sha>`` (or drop it if already there)."""
    final = store.blobs / sha
    try:
        st = final.stat()
    except FileNotFoundError:
        st = None
    if st is not None and st.st_size == size and (not check_existing or sha256_and_size(final)[0] == sha):
        tmp.unlink(missing_ok=True)
        return final
    try:
        os.chmod(tmp, 0o444)  # blobs are immutable; snapshots are hardlinks to them
    except OSError:
        pass
    os.replace(tmp, final)
    fsync_dir(store.blobs)
    return final


def write_blob(store: Store, reader: BinaryIO, *, check_existing: bool = False) -> tuple[str, int]:
    """Stream ``reader`` into a new blob; returns (sha256, size)."""
    fd, name = tempfile.mkstemp(prefix=".tmp-", dir=store.blobs)
    tmp = Path(name)
    try:
        with os.fdopen(fd, "wb") as out:
            sha, size = _copy_hashed(reader, out)
        publish_blob(store, tmp, sha, size, check_existing=check_existing)
        return sha, size
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def adopt_file(store: Store, path: Path, sha: str, size: int, *, check_existing: bool = False) -> None:
    """Move a complete file (already hashed from disk) into blobs; it must be on the same filesystem."""
    _fsync_file(path)
    tmp = store.blobs / f".tmp-{uuid.uuid4().hex}"
    try:
        os.replace(path, tmp)
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
        with open(path, "rb") as fh:
            got = write_blob(store, fh, check_existing=check_existing)
        if got != (sha, size):
            raise FetchError(f"{path} changed while it was being stored") from None
        path.unlink(missing_ok=True)
        return
    publish_blob(store, tmp, sha, size, check_existing=check_existing)


def link_into_blobs(store: Store, path: Path, *, check_existing: bool = False) -> tuple[str, int]:
    """Store an immutable file (a Hugging Face cache blob): hash it, then hardlink it, else copy."""
    real = Path(os.path.realpath(path))
    sha, size = sha256_and_size(real)
    final = store.blobs / sha
    if final.exists() and final.stat().st_size == size and not check_existing:
        return sha, size
    tmp = store.blobs / f".tmp-{uuid.uuid4().hex}"
    try:
        os.link(real, tmp)
    except OSError:
        with open(real, "rb") as fh:
            got = write_blob(store, fh, check_existing=check_existing)
        if got != (sha, size):
            raise FetchError(f"{real} changed while it was being stored") from None
        return sha, size
    try:
        publish_blob(store, tmp, sha, size, check_existing=check_existing)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return sha, size


# ---------------------------------------------------------------------------------------------
# Snapshots


def snapshot_problems(folder: Path, entries: Iterable[FileEntry], *, deep: bool = False) -> list[str]:
    """What is wrong with a snapshot folder (one line each); ``deep`` also checks every sha256."""
    problems = []
    for e in entries:
        f = folder / e.path
        try:
            st = os.stat(f, follow_symlinks=False)
        except OSError:
            problems.append(f"{e.path} is missing")
            continue
        if not (st.st_mode & 0o170000) == 0o100000:
            problems.append(f"{e.path} is not a regular file")
        elif st.st_size != e.size:
            problems.append(f"{e.path} has {st.st_size} bytes, expected {e.size}")
        elif deep:
            got, _ = sha256_and_size(f)
            if got != e.sha256:
                problems.append(f"{e.path} has sha256 {got[:12]}..., expected {e.sha256[:12]}...")
    return problems


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)
        _fsync_file(dst)


def build_snapshot(store: Store, entries: list[FileEntry], *, deep: bool = False) -> Path:
    """Publish ``snapshots/<id>`` from blobs (already written); returns its path."""
    snap = snapshot_id(entries)
    final = store.snapshot_dir(snap)
    if final.is_dir() and not snapshot_problems(final, entries, deep=deep):
        return final
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=store.snapshots))
    try:
        dirs = {tmp}
        for e in entries:
            dst = tmp / e.path
            dst.parent.mkdir(parents=True, exist_ok=True)
            dirs.add(dst.parent)
            _link_or_copy(store.blobs / e.sha256, dst)
        for d in sorted(dirs, key=lambda p: len(p.parts), reverse=True):
            fsync_dir(d)
        if final.exists():  # a damaged snapshot: move it aside, then replace it
            trash = store.snapshots / f".trash-{uuid.uuid4().hex}"
            try:
                os.rename(final, trash)
            except FileNotFoundError:
                trash = None
        else:
            trash = None
        try:
            os.rename(tmp, final)
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            # another process published the same snapshot meanwhile
            if snapshot_problems(final, entries, deep=deep):
                raise FetchError(f"snapshot {final} is damaged and in use by another process; retry the pull") from None
            shutil.rmtree(tmp, ignore_errors=True)
        fsync_dir(store.snapshots)
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


# ---------------------------------------------------------------------------------------------
# Tar archives


def _refuse(label: str, why: str) -> FetchError:
    return FetchError(f"refusing to extract {label}: {why}")


def _check_member(m: tarfile.TarInfo, label: str) -> tuple[str, str | None] | None:
    """(snapshot path, link target or None for a regular file) of one member; None for a folder.

    Refused: absolute names, ``..`` components, links whose target is absolute or outside the
    archive, device files and fifos. Nothing here needs the members that come later."""
    if m.isdir() and all(part in ("", ".") for part in m.name.split("/")):
        return None
    try:
        rel = check_relpath(m.name)
    except ValueError as exc:
        raise _refuse(label, f"member {m.name!r} has an unsafe name ({exc}; path traversal)") from None
    if m.isdir():
        return None
    if m.isreg():
        return rel, None
    if m.issym():
        if m.linkname.startswith("/"):
            raise _refuse(label, f"symlink {m.name!r} points to absolute path {m.linkname!r} (path traversal)")
        target = posixpath.normpath(posixpath.join(posixpath.dirname(rel), m.linkname))
        if target == ".." or target.startswith("../"):
            raise _refuse(label, f"symlink {m.name!r} -> {m.linkname!r} points outside the archive (path traversal)")
        return rel, target
    if m.islnk():
        try:
            return rel, check_relpath(m.linkname)
        except ValueError as exc:
            raise _refuse(label, f"hard link {m.name!r} -> {m.linkname!r} points outside the archive ({exc}; path traversal)") from None
    raise _refuse(label, f"member {m.name!r} is a device, fifo or other special file")


def _resolve_tar(regular: dict[str, T], links: dict[str, str], label: str) -> list[tuple[str, T]]:
    """(snapshot path, regular member) for every file, once the whole archive has been seen.

    Links inside the archive become copies of their target (snapshots hold files only); a link to
    anything but a file in the archive is refused. A single top-level folder is stripped; hidden
    entries are skipped; a path that is both a file and a folder is refused."""
    files = dict(regular)
    for rel, target in links.items():
        seen = {rel}
        while target in links and target not in seen:
            seen.add(target)
            target = links[target]
        if target not in regular:
            raise _refuse(label, f"link {rel!r} does not point to a file in the archive")
        files[rel] = regular[target]
    if not files:
        raise FetchError(f"archive {label} holds no files")
    paths = sorted(files)
    tops = {p.split("/", 1)[0] for p in paths}
    if len(tops) == 1 and all("/" in p for p in paths):
        top = tops.pop() + "/"
        files = {p[len(top):]: m for p, m in files.items()}
    # hidden entries (macOS ._* AppleDouble files, .git, .cache) are skipped, as for local folders
    files = {p: m for p, m in files.items() if not any(part.startswith(".") for part in p.split("/"))}
    if not files:
        raise FetchError(f"archive {label} holds no files (hidden entries are skipped)")
    _check_no_file_dir_clash(files, label)
    return sorted(files.items())


def _table_add(regular: dict[str, T], links: dict[str, str], checked: tuple[str, str | None] | None, value: T) -> None:
    """Record one member; a later member of the same name replaces an earlier one (as tar does)."""
    if checked is None:
        return
    rel, target = checked
    if target is None:
        regular[rel] = value
        links.pop(rel, None)
    else:
        links[rel] = target
        regular.pop(rel, None)


def _check_no_file_dir_clash(paths: Iterable[str], label: str) -> None:
    paths = set(paths)
    for p in paths:
        parent = posixpath.dirname(p)
        while parent:
            if parent in paths:
                raise FetchError(f"{label} has both a file and a folder named {parent!r}")
            parent = posixpath.dirname(parent)


def _stage(reader: BinaryIO, tmp: Path) -> tuple[str, int]:
    """Copy ``reader`` to ``tmp`` (fsynced); returns (sha256, size)."""
    with open(tmp, "wb") as out:
        return _copy_hashed(reader, out)


def _copy_hashed(reader: BinaryIO, out: BinaryIO) -> tuple[str, int]:
    """Copy ``reader`` into ``out`` in chunks, hashing as it goes, then fsync; (sha256, size)."""
    h = hashlib.sha256()
    size = 0
    while chunk := reader.read(CHUNK):
        h.update(chunk)
        out.write(chunk)
        size += len(chunk)
    out.flush()
    os.fsync(out.fileno())
    return h.hexdigest(), size


def extract_tar(store: Store, archive: Path, label: str, *, check_existing: bool = False) -> list[FileEntry]:
    """Blobs for the files of a tar archive (plain, gzip, bzip2 or xz), read in ONE pass.

    The archive is streamed (``r|*``): a compressed archive is decompressed once, and the file is
    never seeked. Each regular member is hashed as it goes by into a private staging folder
    (``blobs/.tmp-tar-*``); links are resolved from the table at the end, with every refusal of
    ``_check_member`` / ``_resolve_tar``. Only then are the needed files published as blobs, so a
    refused or damaged archive leaves nothing in ``blobs/`` (the staging folder is removed; one left
    by a killed process is a ``.tmp-*`` entry that ``collect_orphans`` removes after its grace).
    """
    try:
        fh = open(archive, "rb")
    except OSError as exc:
        raise FetchError(f"cannot open {label} as a tar archive ({one_line(exc)})") from None
    staging = Path(tempfile.mkdtemp(prefix=".tmp-tar-", dir=store.blobs))
    try:
        with fh:
            try:
                tf = tarfile.open(fileobj=fh, mode="r|*")
            except tarfile.ReadError:
                raise FetchError(f"{label} is not a readable tar archive (no tar, gzip, bzip2 or xz header)") from None
            except (tarfile.TarError, EOFError, OSError) as exc:
                raise FetchError(f"cannot open {label} as a tar archive ({one_line(exc)})") from None
            regular: dict[str, tuple[str, int]] = {}  # path -> (sha256, size) of what it held
            links: dict[str, str] = {}
            with tf:
                try:
                    for i, m in enumerate(tf):
                        checked = _check_member(m, label)
                        value: tuple[str, int] = ("", 0)
                        if checked is not None and checked[1] is None:
                            src = tf.extractfile(m)
                            if src is None:  # pragma: no cover - a regular member always has a reader
                                raise FetchError(f"cannot read member {m.name!r} of {label}")
                            with src:
                                sha, size = _stage(src, staging / str(i))
                            if size != m.size:
                                raise FetchError(f"{label} is a damaged tar archive (member {m.name!r} is truncated)")
                            os.replace(staging / str(i), staging / sha)  # identical contents share one file
                            value = (sha, size)
                        _table_add(regular, links, checked, value)
                except (tarfile.TarError, EOFError, OSError) as exc:
                    raise FetchError(f"{label} is a damaged tar archive ({type(exc).__name__}: {one_line(exc)})") from None
        plan = _resolve_tar(regular, links, label)
        for sha, size in sorted({value for _, value in plan}):
            publish_blob(store, staging / sha, sha, size, check_existing=check_existing)
        return [FileEntry(rel, sha, size) for rel, (sha, size) in plan]
    finally:
        shutil.rmtree(staging, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# Local folders


def scan_folder(folder: Path, label: str | None = None) -> list[tuple[str, Path]]:
    """(snapshot path, file) for every file under ``folder``; hidden names (``.git``, ``.cache``)
    are skipped; symlinks are followed (a Hugging Face cache snapshot is made of them)."""
    label = label or str(folder)
    out: list[tuple[str, Path]] = []
    seen_dirs: set[tuple[int, int]] = set()
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=True):
        st = os.stat(dirpath)
        if (st.st_dev, st.st_ino) in seen_dirs:
            dirnames[:] = []
            continue
        seen_dirs.add((st.st_dev, st.st_ino))
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames):
            if name.startswith("."):
                continue
            p = Path(dirpath) / name
            if not p.exists():
                raise ModelNotFoundError(f"{p} is a broken link (in {label})")
            if not p.is_file():
                continue  # sockets, fifos
            rel = p.relative_to(folder).as_posix()
            out.append((check_relpath(rel), p))
    if not out:
        raise ModelNotFoundError(f"folder {label} holds no files")
    return out
