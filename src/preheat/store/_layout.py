"""Store paths, source parsing, source ids, snapshot ids and refs (no network, no big I/O)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import posixpath
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator
from urllib.parse import unquote, urlsplit, urlunsplit

from preheat.files import atomic_write_bytes
from preheat.errors import CacheError, InvalidArgumentError

REF_FORMAT = 1
HEX64 = re.compile(r"^[0-9a-f]{64}$")
HF_PATTERNS = ["*.json", "*.safetensors", "*.md", "*.txt"]  # a repository without model_index.json
ONE_FILE_SUFFIXES = (".safetensors", ".gguf")  # hf://org/repo/path/file: a single checkpoint file
TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz")
REMOTE_SCHEMES = ("http://", "https://", "hf://")

_HF_REPO = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?$")
_HF_REVISION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,254}$")
_VARIANT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_SOURCE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def sha256_hex(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def one_line(text: object, limit: int = 300) -> str:
    """``text`` collapsed to one line of at most ``limit`` characters (for error messages)."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def is_tar_name(name: str) -> bool:
    return name.lower().endswith(TAR_SUFFIXES)


def check_relpath(path: str) -> str:
    """A snapshot-relative POSIX path, normalised; ValueError if it could leave the snapshot."""
    if not path or "\x00" in path:
        raise ValueError("empty path or NUL byte")
    if path.startswith("/") or re.match(r"^[A-Za-z]:", path):
        raise ValueError("absolute path")
    if "\\" in path:
        raise ValueError("backslash in path")
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise ValueError("'..' component")
    if not parts:
        raise ValueError("empty path")
    return "/".join(parts)


# ---------------------------------------------------------------------------------------------
# Sources


@dataclass(frozen=True)
class Source:
    """A parsed SOURCE. ``text`` is the canonical form: it alone determines the source id."""

    kind: str  # "hf" | "url" | "local"
    text: str
    given: str
    url: str | None = None  # http(s) URL without the fragment
    sha256: str | None = None  # expected sha256 of the downloaded file (#sha256=...)
    repo_id: str | None = None
    revision: str | None = None
    path: Path | None = None  # absolute local path
    filename: str | None = None  # hf://org/repo/<filename>: that one file of the repository
    variant: str | None = None  # hf:// pipelines: the weight variant pulled ("fp16"); None: the default
    # hf:// pipelines: only these component folders (what a single file lacks); None: every one
    # model_index.json names
    components: tuple[str, ...] | None = None

    @property
    def key(self) -> str:
        """What is stored: the canonical text, plus the variant and the components (a different
        choice of files is a different pull)."""
        parts = ([f"variant={self.variant}"] if self.variant is not None else []) + (
            [f"components={','.join(self.components)}"] if self.components is not None else [])
        return self.text if not parts else f"{self.text}#{'&'.join(parts)}"

    @property
    def id(self) -> str:
        return source_id(self.key)


def is_remote(source: str | os.PathLike[str]) -> bool:
    """True for ``http://``, ``https://`` and ``hf://`` sources (anything else is a local path)."""
    if not isinstance(source, str):
        return False
    return source[:8].lower().startswith(REMOTE_SCHEMES)


def parse_source(source: str | os.PathLike[str], revision: str | None = None, variant: str | None = None,
                 components: Iterable[str] | None = None) -> Source:
    """Parse a SOURCE string; ``InvalidArgumentError`` (one line) if it is malformed.

    ``variant`` selects what an hf:// pipeline pulls; other sources are stored whole, so it does not
    change what they are (the loader picks the variant's files from the folder). ``components``
    (hf:// pipelines only) narrows the pull to those component folders, with no model_index.json:
    what a single file of a published model lacks (``preheat.models.published.needed``)."""
    if isinstance(source, os.PathLike):
        source = os.fspath(source)
    if not isinstance(source, str):
        raise InvalidArgumentError(f"model source must be a string or path, not {type(source).__name__}")
    if not source.strip():
        raise InvalidArgumentError("empty model source")
    m = _SCHEME.match(source)
    scheme = m.group(1).lower() if m else None
    if variant is not None and (not isinstance(variant, str) or not _VARIANT.match(variant)):
        raise InvalidArgumentError(f"invalid weight variant {variant!r}; expected a name such as fp16", argument="variant")
    if scheme == "hf":
        src = _parse_hf(source, revision, variant)
        return src if components is None else _with_components(src, components)
    if components is not None:
        raise InvalidArgumentError(f"components apply only to hf:// pipelines, not {source!r}", argument="components")
    if revision is not None:
        raise InvalidArgumentError(f"a revision applies only to hf:// sources, not {source!r}")
    if scheme in ("http", "https"):
        return _parse_url(source, scheme)
    if scheme == "file":
        parts = urlsplit(source)
        if parts.netloc not in ("", "localhost"):
            raise InvalidArgumentError(f"file:// source {source!r} names a remote host; only local files are supported")
        source = unquote(parts.path)
    elif scheme is not None:
        raise InvalidArgumentError(
            f"unsupported model source scheme {scheme}:// in {source!r}; "
            "use a local folder, an http(s):// URL, or hf://org/repo[@revision]"
        )
    path = Path(os.path.abspath(Path(source).expanduser()))
    return Source(kind="local", text=str(path), given=source, path=path)


def _parse_hf(source: str, revision: str | None, variant: str | None) -> Source:
    rest = source[len("hf://"):]
    repo, at, rev = rest.partition("@")
    repo = repo.rstrip("/")
    filename = None
    parts = repo.split("/")
    if len(parts) > 2:  # hf://org/repo/path/to/file.safetensors (or .gguf): one file
        repo, filename = "/".join(parts[:2]), "/".join(parts[2:])
        try:
            ok = check_relpath(filename) == filename and filename.lower().endswith(ONE_FILE_SUFFIXES)
        except ValueError:
            ok = False
        if not ok:
            raise InvalidArgumentError(f"{source!r}: a path after hf://org/repo/ names one .safetensors or .gguf file "
                                       "of the repository (the weights preheat reads)")
        if variant is not None:
            raise InvalidArgumentError(f"a variant selects a pipeline's weights; {source!r} names one file",
                                       argument="variant")
    if at and not rev:
        raise InvalidArgumentError(f"empty revision after '@' in {source!r}")
    if rev and revision is not None and rev != revision:
        raise InvalidArgumentError(f"conflicting revisions for {source!r}: '@{rev}' and revision={revision!r}")
    rev = rev or revision
    if not _HF_REPO.match(repo) or ".." in repo or "--" in repo:
        raise InvalidArgumentError(f"{source!r} is not a valid Hugging Face source; expected hf://org/repo[@revision]")
    if rev is not None and (not _HF_REVISION.match(rev) or ".." in rev or "//" in rev or rev.endswith("/")):
        raise InvalidArgumentError(f"invalid revision {rev!r} in {source!r}")
    text = f"hf://{repo}" + (f"/{filename}" if filename else "") + (f"@{rev}" if rev else "")
    return Source(kind="hf", text=text, given=source, repo_id=repo, revision=rev, filename=filename, variant=variant)


def _with_components(src: Source, components: Iterable[str]) -> Source:
    """``src`` narrowed to some component folders (sorted, each a plain folder name)."""
    names = tuple(sorted(set(components)))
    bad = [c for c in names if not _VARIANT.match(c)]
    if src.filename is not None or not names or bad:
        why = f"{bad[0]!r} is not a component folder name" if bad else (
            "it names one file" if src.filename is not None else "none given")
        raise InvalidArgumentError(f"components of {src.text}: {why}", argument="components")
    return replace(src, components=names)


def _parse_url(source: str, scheme: str) -> Source:
    parts = urlsplit(source)
    if not parts.hostname:
        raise InvalidArgumentError(f"URL {source!r} has no host")
    expected = None
    if parts.fragment:
        key, eq, value = parts.fragment.partition("=")
        if key != "sha256" or not eq or not HEX64.match(value.lower()):
            raise InvalidArgumentError(f"unsupported URL fragment in {source!r}; the only one understood is #sha256=<64 hex digits>")
        expected = value.lower()
    url = urlunsplit((scheme, parts.netloc, parts.path, parts.query, ""))
    return Source(kind="url", text=url, given=source, url=url, sha256=expected)


def source_id(text: str) -> str:
    """A safe file name for a canonical source: readable slug + 16 hex digits of its sha256.

    Only ``[A-Za-z0-9._-]`` appear, the first character is alphanumeric, so it can never be
    ``.``, ``..``, hidden, or contain a path separator, whatever the source string holds.
    """
    scheme, sep, rest = text.partition("://")
    kind = scheme.lower() if sep else "local"
    body = rest if sep else text
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", body)
    slug = re.sub(r"\.{2,}", ".", slug).strip(".-_")[-64:].strip(".-_")
    sid = f"{kind}-{slug or 'source'}-{sha256_hex(text)[:16]}"
    assert _SOURCE_ID.match(sid), sid
    return sid


# ---------------------------------------------------------------------------------------------
# Refs


@dataclass(frozen=True)
class FileEntry:
    path: str
    sha256: str
    size: int


def snapshot_id(entries: list[FileEntry]) -> str:
    """sha256 of the sorted ``[[path, sha256], ...]`` list, as compact JSON."""
    listing = sorted([e.path, e.sha256] for e in entries)
    return sha256_hex(json.dumps(listing, separators=(",", ":")))


@dataclass
class Ref:
    source_id: str
    source: str
    kind: str
    snapshot: str
    files: list[FileEntry]
    created: str
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> bytes:
        doc = {
            "format": REF_FORMAT,
            "source": self.source,
            "kind": self.kind,
            "snapshot": self.snapshot,
            "created": self.created,
            **self.extra,
            "files": [{"path": e.path, "sha256": e.sha256, "size": e.size} for e in self.files],
        }
        return (json.dumps(doc, indent=2) + "\n").encode()


def parse_ref(source_id_: str, raw: bytes) -> Ref:
    """A Ref from its JSON; ValueError (one line) if anything in it is malformed or unsafe."""
    try:
        doc = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"not valid JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != REF_FORMAT:
        raise ValueError(f"not a format-{REF_FORMAT} ref")
    snap = doc.get("snapshot")
    if not isinstance(snap, str) or not HEX64.match(snap):
        raise ValueError("bad snapshot id")
    files = doc.get("files")
    if not isinstance(files, list) or not files:
        raise ValueError("no files listed")
    entries = []
    for f in files:
        if not isinstance(f, dict):
            raise ValueError("bad file entry")
        path, sha, size = f.get("path"), f.get("sha256"), f.get("size")
        if not isinstance(path, str) or not isinstance(sha, str) or not HEX64.match(sha):
            raise ValueError("bad file entry")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ValueError(f"bad size for {path}")
        if check_relpath(path) != path:
            raise ValueError(f"unsafe path {path!r}")
        entries.append(FileEntry(path, sha, size))
    if snapshot_id(entries) != snap:
        raise ValueError("snapshot id does not match its file list")
    extra = {k: v for k, v in doc.items() if k not in ("format", "source", "kind", "snapshot", "created", "files")}
    return Ref(source_id_, str(doc.get("source", "")), str(doc.get("kind", "")), snap, entries,
               str(doc.get("created", "")), extra)


# ---------------------------------------------------------------------------------------------
# The store


class Store:
    """Paths of one store: ``<root>/models/{blobs,snapshots,refs,downloads,locks,hf}``."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.models = self.root / "models"
        self.blobs = self.models / "blobs"
        self.snapshots = self.models / "snapshots"
        self.refs = self.models / "refs"
        self.downloads = self.models / "downloads"
        self.locks = self.models / "locks"
        self.hf = self.models / "hf"

    def ensure(self) -> None:
        for d in (self.blobs, self.snapshots, self.refs, self.downloads, self.locks):
            try:
                d.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise CacheError(f"cannot create store folder {d}: {exc.strerror or exc}") from None

    def snapshot_dir(self, snap: str) -> Path:
        return self.snapshots / snap

    def ref_path(self, sid: str) -> Path:
        if not _SOURCE_ID.match(sid):
            raise ValueError(f"unsafe source id {sid!r}")
        return self.refs / sid

    def read_ref(self, sid: str) -> Ref | None:
        """The ref of ``sid``, or None when absent or unreadable (``verify_store`` reports the latter)."""
        try:
            raw = self.ref_path(sid).read_bytes()
        except OSError:
            return None
        try:
            return parse_ref(sid, raw)
        except ValueError:
            return None

    def write_ref(self, ref: Ref) -> None:
        atomic_write_bytes(self.ref_path(ref.source_id), ref.to_json())

    def ref_ids(self) -> list[str]:
        try:
            names = os.listdir(self.refs)
        except OSError:
            return []
        return sorted(n for n in names if _SOURCE_ID.match(n) and (self.refs / n).is_file())

    @contextlib.contextmanager
    def lock(self, sid: str, on_wait: Callable[[], None] | None = None) -> Iterator[None]:
        """Serialise pulls of one source across processes (best effort: ``flock``).

        Correctness does not rest on it (blobs, snapshots and refs are published atomically); it
        stops two processes from appending to the same ``.incomplete`` download.
        """
        import fcntl

        fd = os.open(self.locks / f"{sid}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if on_wait is not None:
                    on_wait()
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError:
                pass  # no locks on this filesystem
            yield
        finally:
            os.close(fd)


def url_filename(url: str) -> str:
    """The last path segment of a URL, as a safe single file name."""
    name = posixpath.basename(unquote(urlsplit(url).path))
    try:
        name = check_relpath(name)
    except ValueError:
        name = ""
    if not name or "/" in name:
        raise InvalidArgumentError(f"cannot tell a file name from URL {url!r}; it must end in /<file name>")
    return name
