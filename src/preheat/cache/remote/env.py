"""Construction and module-level helpers: the store for a URL, the one named by
``PREHEAT_CACHE_URL`` (one per process), the mirror helpers the weights store calls, and the
environment and one-line description other commands use."""

from __future__ import annotations

import os
import threading
from typing import Any

from preheat.cache.remote.policy import ENV_TRUST, ENV_URL
from preheat.cache.remote.transport import FsspecStore, LocalDirStore, RemoteStore
from preheat.cache.signing import ENV_KEY, key_id
from preheat.errors import InvalidArgumentError

__all__ = ["open_store", "remote_from_env", "default_store", "mirror_get", "mirror_put", "child_env", "describe"]


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


def mirror_put(name: str, local_path: str | os.PathLike[str], *, ref: str | None = None, source: str = "") -> None:
    """Share blob ``local_path`` (whose sha256 is ``name``) with the fleet, recorded as used by
    source id ``ref`` when given; no-op without a store."""
    store = default_store()
    if store is not None:
        store.mirror_put(name, local_path, ref=ref, source=source)


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
