"""HTTP(S) downloads into ``downloads/<sha256(url)[:32]>.incomplete``, resumable, with a progress bar.

* A partial file is continued with ``Range: bytes=N-`` (plus ``If-Range`` with the ETag or
  Last-Modified seen first, kept in ``<name>.incomplete.json``). A ``206`` whose range starts at N
  is appended; a ``200`` means the server ignored the range (or the file changed): restart at 0.
* ``416`` with ``Content-Range: bytes */N`` equal to what we hold means the file was complete.
* ``Content-Length`` / ``Content-Range`` totals are checked; a connection cut or stalled (socket
  timeout) is resumed in-process, up to ``retries`` times without progress, then it fails with a
  one-line ``FetchError`` and the ``.incomplete`` stays for the next pull to continue.
* Nothing here writes a blob or a ref; the caller hashes the finished file from disk.
* A download a client asked for (a server's per-request LoRA URL) runs under
  :func:`address_check`: every connection, redirects included, resolves its host once, has each
  address checked, and connects to the checked address, so a second DNS answer cannot move it.
* ... and under :func:`download_limits` (``preheat.server.fetch`` sets both): a connect timeout,
  a total deadline (each read waits at most what is left of it, so a slow drip ends on time too),
  a size cap checked against ``Content-Length`` / ``Content-Range`` before the body and against
  the bytes while they stream, and no resume: a download that fails for any reason removes its
  partial file, so a refused download leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import contextvars
import http.client
import ipaddress
import json
import os
import re
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple, Optional

from preheat._version import __version__
from preheat.files import atomic_write_bytes
from preheat.errors import FetchError
from preheat.store._layout import Store, one_line, sha256_hex

DEFAULT_TIMEOUT_S = 30.0
DEFAULT_RETRIES = 3
READ_SIZE = 256 * 1024
BACKOFF_S = 0.5  # first wait after a failed attempt that made no progress; doubles, at most 8 s


def timeout_s() -> float:
    try:
        return float(os.environ.get("PREHEAT_HTTP_TIMEOUT", DEFAULT_TIMEOUT_S))
    except ValueError:
        return DEFAULT_TIMEOUT_S


def partial_paths(store: Store, url: str) -> tuple[Path, Path]:
    key = sha256_hex(url)[:32]
    return store.downloads / f"{key}.incomplete", store.downloads / f"{key}.incomplete.json"


def discard_partial(store: Store, url: str) -> None:
    for p in partial_paths(store, url):
        p.unlink(missing_ok=True)


def _read_meta(meta: Path, url: str) -> dict[str, Any] | None:
    try:
        doc = json.loads(meta.read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and doc.get("url") == url else None


def _content_range(value: str | None) -> tuple[int | None, int | None, int | None]:
    """``bytes a-b/N`` -> (a, b, N); ``bytes */N`` -> (None, None, N); N may be None (``*``)."""
    m = re.match(r"^\s*bytes\s+(?:(\d+)-(\d+)|\*)/(\d+|\*)\s*$", value or "")
    if not m:
        return None, None, None
    a, b, n = m.groups()
    return (int(a) if a else None, int(b) if b else None, int(n) if n and n != "*" else None)


def _short(exc: BaseException) -> str:
    reason = getattr(exc, "reason", None)
    return one_line(str(reason if reason is not None else exc) or type(exc).__name__)


class _Bar:
    """A rich progress bar on stderr, or nothing."""

    def __init__(self, enabled: bool, label: str) -> None:
        self.progress = None
        self.task = None
        self.started = False
        from preheat.terminal import shown

        if enabled and shown():  # a terminal only: a log file or a pipe gets no redraws
            from rich.console import Console
            from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                                       TransferSpeedColumn)

            self.progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(),
                                     TransferSpeedColumn(), TimeRemainingColumn(), console=Console(stderr=True))
            self.task = self.progress.add_task(label, total=None)

    def __enter__(self) -> "_Bar":
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.progress is not None and self.started:
            self.progress.stop()

    def set(self, completed: int, total: int | None) -> None:
        """Called once a response arrives: the bar appears only then (not for a refused connection)."""
        if self.progress is not None:
            if not self.started:
                self.progress.start()
                self.started = True
            self.progress.update(self.task, completed=completed, total=total)

    def advance(self, n: int) -> None:
        if self.progress is not None:
            self.progress.advance(self.task, n)


# (host, address) -> None, raising FetchError to refuse: set by address_check for this context only.
_ADDRESS_CHECK: contextvars.ContextVar[Optional[Callable[[str, Any], None]]] = contextvars.ContextVar(
    "preheat_address_check", default=None)


class DownloadLimits(NamedTuple):
    """What a download a client asked for must keep to."""

    connect_timeout_s: float  # each TCP connect (redirects included)
    deadline: float  # time.monotonic() by which the whole download (every retry and redirect) ends
    max_bytes: Optional[int]  # the body's size cap; None = none
    on_bytes: Optional[Callable[[int], None]] = None  # called with each chunk's size (metrics)

    def left_s(self) -> float:
        return self.deadline - time.monotonic()


_LIMITS: contextvars.ContextVar[Optional[DownloadLimits]] = contextvars.ContextVar("preheat_download_limits",
                                                                                  default=None)


@contextlib.contextmanager
def download_limits(limits: DownloadLimits) -> Iterator[None]:
    """Downloads started inside (this thread or task) keep to ``limits`` and never resume."""
    token = _LIMITS.set(limits)
    try:
        yield
    finally:
        _LIMITS.reset(token)


@contextlib.contextmanager
def address_check(check: Callable[[str, Any], None]) -> Iterator[None]:
    """Downloads started inside (this thread or task) connect only where ``check(host, ip)``
    does not raise; ``check`` raises a one-line :class:`FetchError` to refuse."""
    token = _ADDRESS_CHECK.set(check)
    try:
        yield
    finally:
        _ADDRESS_CHECK.reset(token)


def _checked_create_connection(check: Callable[[str, Any], None],
                               connect_timeout_s: Optional[float] = None) -> Callable[..., socket.socket]:
    """``socket.create_connection`` that resolves once, checks every address, then connects to
    the checked addresses in order (never resolving again); with ``connect_timeout_s``, the
    connect waits that long and the socket then reads with the caller's timeout."""

    def create(address: tuple[str, int], timeout: Any = socket._GLOBAL_DEFAULT_TIMEOUT,  # type: ignore[attr-defined]
               source_address: Any = None, *args: Any, **kw: Any) -> socket.socket:
        host, port = address[0], address[1]
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        for info in infos:
            check(host, ipaddress.ip_address(str(info[4][0]).split("%")[0]))
        error: OSError = OSError(f"no address for {host}")
        for info in infos:  # as socket.create_connection, over the addresses already checked
            try:
                if connect_timeout_s is None:
                    return socket.create_connection((info[4][0], port), timeout, source_address)
                try:
                    sock = socket.create_connection((info[4][0], port), connect_timeout_s, source_address)
                except socket.timeout:
                    raise FetchError(f"cannot connect to {host}: no answer within {connect_timeout_s:g}s",
                                     reason="deadline") from None
                sock.settimeout(timeout)
                return sock
            except OSError as exc:
                error = exc
        raise error

    return create


def _any_address(host: str, ip: Any) -> None:
    """The check of a download that keeps to limits but has no address policy."""


def _checked_opener(check: Callable[[str, Any], None],
                    connect_timeout_s: Optional[float] = None) -> urllib.request.OpenerDirector:
    """A urllib opener whose HTTP and HTTPS connections (redirects too) go through ``check``."""
    create = _checked_create_connection(check, connect_timeout_s)

    def checked(cls: type) -> Callable[..., Any]:
        def make(*args: Any, **kw: Any) -> Any:
            conn = cls(*args, **kw)
            conn._create_connection = create  # the TCP connection only: TLS still checks the host's name
            return conn
        return make

    class HTTPHandler(urllib.request.HTTPHandler):
        def http_open(self, req: Any) -> Any:
            return self.do_open(checked(http.client.HTTPConnection), req)

    class HTTPSHandler(urllib.request.HTTPSHandler):
        def https_open(self, req: Any) -> Any:
            kw = {"context": self._context}  # type: ignore[attr-defined]
            if hasattr(self, "_check_hostname"):  # Python < 3.12
                kw["check_hostname"] = self._check_hostname
            return self.do_open(checked(http.client.HTTPSConnection), req, **kw)

    return urllib.request.build_opener(HTTPHandler, HTTPSHandler)


@contextlib.contextmanager
def _open(url: str, headers: dict[str, str], timeout: float) -> Iterator[Any]:
    req = urllib.request.Request(url, headers=headers)
    check, limits = _ADDRESS_CHECK.get(), _LIMITS.get()
    if check is None and limits is None:
        resp = urllib.request.urlopen(req, timeout=timeout)  # noqa: S310 - http(s) only, checked by the parser
    else:
        connect = None if limits is None else limits.connect_timeout_s
        resp = _checked_opener(check or _any_address, connect).open(req, timeout=timeout)
    try:
        yield resp
    finally:
        resp.close()


def _read_timeout(resp: Any, seconds: float) -> None:
    """Set the socket timeout of an open ``http.client`` response (its next read waits at most that)."""
    sock = getattr(getattr(getattr(resp, "fp", None), "raw", None), "_sock", None)
    if sock is not None:
        sock.settimeout(seconds)


def _fatal_connect_error(exc: BaseException) -> bool:
    """Errors retrying will not fix: refused connection, unknown host, bad certificate."""
    reason = getattr(exc, "reason", exc)
    return isinstance(reason, (ConnectionRefusedError, socket.gaierror)) or "CERTIFICATE" in str(reason).upper()


def download(store: Store, url: str, *, progress: bool = True, timeout: float | None = None,
             retries: int = DEFAULT_RETRIES, label: str | None = None) -> Path:
    """Download ``url`` to its ``.incomplete`` file, resuming it; returns the finished file.
    Under :func:`download_limits` a failure removes the partial file instead."""
    limits = _LIMITS.get()
    if limits is None:
        return _download(store, url, progress=progress, timeout=timeout, retries=retries, label=label)
    discard_partial(store, url)  # a client's download starts from nothing: no resume of another's bytes
    try:
        return _download(store, url, progress=progress, timeout=timeout, retries=retries, label=label, limits=limits)
    except BaseException:
        discard_partial(store, url)
        raise


def _over(url: str, size: int, limits: DownloadLimits) -> FetchError:
    return FetchError(f"cannot download {url}: {size} bytes is over the {limits.max_bytes}-byte limit", reason="size")


def _download(store: Store, url: str, *, progress: bool, timeout: float | None, retries: int, label: str | None,
              limits: Optional[DownloadLimits] = None) -> Path:
    part, meta_path = partial_paths(store, url)
    timeout = timeout_s() if timeout is None else timeout
    base_timeout = timeout

    def time_left() -> float:
        """The socket timeout for the next wait: what is left of the deadline, at most ``timeout``."""
        if limits is None:
            return base_timeout
        left = limits.left_s()
        if left <= 0:
            raise FetchError(f"cannot download {url}: not finished within the deadline", reason="deadline")
        return min(base_timeout, left)
    label = label or url.rsplit("/", 1)[-1] or url
    failures = 0
    best = 0  # the largest partial size reached so far: a retry that does not beat it made no progress

    def retry_or_fail(message: str, made_progress: bool) -> None:
        nonlocal failures
        failures = 0 if made_progress else failures + 1
        if failures > retries:
            raise FetchError(message, reason="network")
        if not made_progress:
            pause = min(BACKOFF_S * 2 ** (failures - 1), 8.0)
            if limits is not None and pause >= limits.left_s():
                raise FetchError(f"{message} (and no time is left for a retry)", reason="deadline")
            time.sleep(pause)

    with _Bar(progress, label) as bar:
        while True:
            meta = _read_meta(meta_path, url)
            have = part.stat().st_size if part.exists() else 0
            if have and meta is None:  # a partial file we know nothing about: start over
                part.unlink()
                have = 0
            headers = {"User-Agent": f"preheat/{__version__}", "Accept-Encoding": "identity"}
            if have:
                headers["Range"] = f"bytes={have}-"
                etag = meta.get("etag") if meta else None
                validator = etag if etag and not etag.startswith("W/") else (meta or {}).get("last_modified")
                if validator:
                    headers["If-Range"] = validator
            try:
                with _open(url, headers, time_left()) as resp:
                    status = resp.status
                    if status == 206:
                        start, _end, total = _content_range(resp.headers.get("Content-Range"))
                        if start != have:  # not the range we asked for: start over
                            part.unlink(missing_ok=True)
                            retry_or_fail(f"cannot download {url}: server answered a range request with the wrong range", False)
                            continue
                        mode = "ab"
                    elif status == 200:
                        length = resp.headers.get("Content-Length")
                        total = int(length) if length and length.isdigit() else None
                        have, mode = 0, "wb"
                    else:
                        raise FetchError(f"cannot download {url}: unexpected HTTP status {status}", reason="http")
                    if limits is not None and limits.max_bytes is not None and total is not None \
                            and total > limits.max_bytes:
                        raise _over(url, total, limits)  # before a byte of the body is read
                    atomic_write_bytes(meta_path, json.dumps({
                        "url": url, "etag": resp.headers.get("ETag"),
                        "last_modified": resp.headers.get("Last-Modified"), "total": total,
                    }).encode())
                    bar.set(have, total)
                    cut = None
                    try:
                        with open(part, mode, buffering=0) as out:
                            size = have
                            while True:
                                if limits is not None:
                                    _read_timeout(resp, time_left())  # a slow drip ends on time
                                try:
                                    chunk = resp.read1(READ_SIZE)
                                except (OSError, http.client.HTTPException) as exc:  # reset, timeout
                                    cut = exc
                                    break
                                if not chunk:
                                    break
                                size += len(chunk)
                                if limits is not None:
                                    if limits.on_bytes is not None:
                                        limits.on_bytes(len(chunk))
                                    if limits.max_bytes is not None and size > limits.max_bytes:
                                        raise _over(url, size, limits)
                                view = memoryview(chunk)
                                while view:
                                    view = view[out.write(view):]
                                bar.advance(len(chunk))
                            os.fsync(out.fileno())
                    except OSError as exc:
                        raise FetchError(f"cannot write {part}: {exc.strerror or exc}") from None
            except urllib.error.HTTPError as exc:
                exc.close()
                if exc.code == 416 and have:
                    _, _, total = _content_range(exc.headers.get("Content-Range"))
                    if total == have and (meta or {}).get("total") in (None, have):
                        break  # we already hold all of it
                    part.unlink(missing_ok=True)
                    retry_or_fail(f"cannot download {url}: server refused to resume (HTTP 416)", False)
                    continue
                message = f"cannot download {url}: HTTP {exc.code} {exc.reason}".rstrip()
                if exc.code >= 500 or exc.code in (408, 429):
                    retry_or_fail(message, False)
                    continue
                raise FetchError(message, reason="http") from None
            except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
                inner = getattr(exc, "reason", None)
                if isinstance(inner, FetchError):  # the address check or the connect timeout, under urllib
                    raise inner from None
                message = f"cannot download {url}: {_short(exc)}"
                if _fatal_connect_error(exc):
                    raise FetchError(message, reason="network") from None
                retry_or_fail(message, False)
                continue
            size = part.stat().st_size
            if total is not None and size > total:
                discard_partial(store, url)
                raise FetchError(f"cannot download {url}: server sent {size} bytes, more than the {total} it announced")
            if cut is not None or (total is not None and size < total):
                what = f"got {size} of {total} bytes" if total is not None else f"got {size} bytes"
                why = f" ({_short(cut)})" if cut is not None else ""
                made_progress = size > best
                best = max(best, size)
                retry_or_fail(f"download of {url} was cut short{why}: {what}; run the pull again to resume", made_progress)
                continue
            break
    return part
