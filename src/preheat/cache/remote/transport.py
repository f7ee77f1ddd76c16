"""The transport: ``RemoteStore`` (the compile-entry protocol and the weights mirror over five
primitives) and its two implementations, a shared folder (``LocalDirStore``) and any fsspec URL
(``FsspecStore``; s3fs for ``s3://``)."""

from __future__ import annotations

import os
import shutil
import threading
import uuid
from pathlib import Path
from typing import Any, Callable

from preheat.files import fsync_dir
from preheat.cache.remote.compile_entries import CompileEntries
from preheat.cache.remote.mirror import WeightsMirror
from preheat.cache.remote.policy import RemoteError
from preheat.cache.remote.prune import RemotePrune

__all__ = ["RemoteStore", "LocalDirStore", "FsspecStore"]


class RemoteStore(CompileEntries, WeightsMirror, RemotePrune):
    """The protocol (fetch / push / mirror / prune) over primitives that subclasses implement.

    Primitives take paths relative to the store's base, with "/" separators, already validated:
    ``_read(rel, limit) -> bytes | None`` (at most ``limit`` bytes), ``_get_file(rel, local)`` (FileNotFoundError when absent),
    ``_put_file(local, rel)`` and ``_put_bytes(data, rel)`` (each atomic as readers see it),
    ``_exists(rel)`` and ``_list(rel) -> names`` (empty when absent); for prune also
    ``_files(rel) -> {name: (size, mtime)}`` (plain files directly under ``rel``) and ``_delete(rel)``.
    """


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

    def _files(self, rel: str) -> dict[str, tuple[int, float]]:
        p = self._path(rel)
        out = {}
        for c in (p.iterdir() if p.is_dir() else ()):
            if c.is_file() and not c.name.startswith("."):
                st = c.stat()
                out[c.name] = (st.st_size, st.st_mtime)
        return out

    def _delete(self, rel: str) -> None:
        try:
            self._path(rel).unlink()
        except FileNotFoundError:
            pass


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

    def _listing(self, rel: str) -> list[dict[str, Any]]:
        """``ls`` of one folder, fresh (fsspec caches listings), [] when it does not exist."""
        fs = self.fs()
        if hasattr(fs, "invalidate_cache"):
            fs.invalidate_cache()
        try:
            return fs.ls(self._p(rel), detail=True)
        except FileNotFoundError:
            return []

    def _list(self, rel: str) -> list[str]:
        return [item["name"].rstrip("/").rsplit("/", 1)[-1] for item in self._listing(rel)
                if item.get("type") == "directory"]

    def _files(self, rel: str) -> dict[str, tuple[int, float]]:
        out = {}
        for item in self._listing(rel):
            name = item["name"].rstrip("/").rsplit("/", 1)[-1]
            if item.get("type") != "file" or ".tmp-" in name or name.startswith("."):
                continue
            out[name] = (int(item.get("size") or 0), _mtime(item))
        return out

    def _delete(self, rel: str) -> None:
        try:
            self.fs().rm_file(self._p(rel))
        except FileNotFoundError:
            pass


def _mtime(item: dict[str, Any]) -> float:
    """A listing entry's modification time in epoch seconds (s3: LastModified; folders: mtime)."""
    for field in ("LastModified", "last_modified", "mtime", "updated", "created"):
        value = item.get(field)
        if value is None:
            continue
        if hasattr(value, "timestamp"):
            return float(value.timestamp())
        try:
            return float(value)
        except (TypeError, ValueError):
            continue
    return float("inf")  # unknown: treated as just written, so never deleted
