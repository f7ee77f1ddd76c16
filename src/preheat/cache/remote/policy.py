"""Trust and failure policy shared by every store operation: which compile entries may be used
(``PREHEAT_CACHE_SIGNING_KEY`` or ``PREHEAT_TRUST_REMOTE_CACHE``), a hard deadline on each request
(``PREHEAT_CACHE_REMOTE_TIMEOUT``), a cooldown after the store fails, and the per-thread ``last``
status. ``StorePolicy`` also declares the transport primitives that ``transport`` implements."""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, TypeVar

from preheat.cache.signing import ENV_KEY, signing_key_from_env
from preheat.env import CACHE_URL_ENV, env_flag
from preheat.errors import InvalidArgumentError

__all__ = ["StorePolicy", "RemoteError", "ENV_URL", "ENV_TRUST", "ENV_TIMEOUT", "DEFAULT_TIMEOUT_S",
           "DOWN_COOLDOWN_S", "MIN_THROUGHPUT_BPS"]

log = logging.getLogger("preheat.cache")

ENV_URL = CACHE_URL_ENV
ENV_TRUST = "PREHEAT_TRUST_REMOTE_CACHE"
ENV_TIMEOUT = "PREHEAT_CACHE_REMOTE_TIMEOUT"
DEFAULT_TIMEOUT_S = 5.0
DOWN_COOLDOWN_S = 60.0
MIN_THROUGHPUT_BPS = 1_000_000  # a download's deadline grows by 1 s per MB

T = TypeVar("T")


class RemoteError(Exception):
    """The store could not be reached or answered with an error (internal; never escapes)."""



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


class StorePolicy:
    """The state and rules every store operation shares: timeout, signing key and trust, the
    cooldown after a failure, the ``last`` status, and the transport primitives subclasses implement.

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
        self.trust = env_flag(ENV_TRUST) if trust is None else trust
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
