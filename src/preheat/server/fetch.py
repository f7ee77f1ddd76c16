"""One guarded fetch for every URL a request names: a LoRA's ``http(s)://`` / ``hf://`` source
(:meth:`Fetcher.lora`, into the store) and an image or mask (:meth:`Fetcher.image`, bytes, never
stored). Nothing a client names is fetched any other way.

Every fetch, through :class:`Fetcher`:

* goes to the addresses the policy admits (``--lora-url-allow(-private)``; public ones only by
  default), each connection checked at connect time, redirects included (``store._http``);
* connects within ``connect_timeout_s`` and ends within ``deadline_s`` of the request asking for
  it, waiting for a slot included (each read waits at most what is left, so a slow drip ends too);
* is refused past its size cap: from ``Content-Length`` before the body, and while it streams;
* holds one of ``per_host`` slots of its host and one of ``max_fetches`` in all; at most
  ``max_waiting`` more wait for a slot, the rest are refused at once ("busy"). Stalled hosts can
  therefore hold only the fetch slots: local LoRA files and entries already stored or held never
  take a slot (:meth:`Fetcher.stored` is checked first, off this pool: ``Core.parse_async``);
* runs once per URL at a time: a second request for a URL being fetched waits for the first;
* leaves nothing behind when it fails or is refused: its partial file is removed and nothing is
  published to the store (a LoRA is checked to be a safetensors file before it is published);
* is counted: fetches in flight and waiting, bytes, refusals by reason, seconds by outcome.

``hf://`` sources take a slot and are fetched once at a time, but huggingface_hub keeps its own
timeouts: the deadline and the size cap apply to ``http(s)://`` downloads.
"""

from __future__ import annotations

import concurrent.futures
import json
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar
from urllib.parse import urlsplit

from preheat.errors import FetchError, ModelFormatError, PreheatError

__all__ = ["FetchConfig", "Fetcher", "default_fetcher", "CONNECT_TIMEOUT_S", "DEADLINE_S", "MAX_LORA_BYTES", "MAX_IMAGE_BYTES",
           "PER_HOST", "MAX_FETCHES"]

CONNECT_TIMEOUT_S = 10.0
DEADLINE_S = 120.0
MAX_LORA_BYTES = 2 << 30
MAX_IMAGE_BYTES = 32 << 20
PER_HOST = 2
MAX_FETCHES = 4
MAX_WAITING = 32

T = TypeVar("T")


@dataclass(frozen=True)
class FetchConfig:
    """The limits of every fetch a request causes (``preheat serve --fetch-*``, ``--max-*-bytes``)."""

    connect_timeout_s: float = CONNECT_TIMEOUT_S
    deadline_s: float = DEADLINE_S  # from the request asking to the last byte, slot wait included
    max_lora_bytes: int = MAX_LORA_BYTES
    max_image_bytes: int = MAX_IMAGE_BYTES
    per_host: int = PER_HOST  # fetches at once from one host
    max_fetches: int = MAX_FETCHES  # fetches at once in all
    max_waiting: int = MAX_WAITING  # fetches waiting for a slot; more are refused at once
    policy: Any = None  # server.webhooks.WebhookPolicy: which addresses; None = public ones only

    def __post_init__(self) -> None:
        from preheat.errors import InvalidArgumentError

        for name in ("connect_timeout_s", "deadline_s"):
            if not getattr(self, name) > 0:
                raise InvalidArgumentError(f"{name} {getattr(self, name)} must be > 0", argument=name)
        for name in ("max_lora_bytes", "max_image_bytes", "per_host", "max_fetches"):
            if getattr(self, name) < 1:
                raise InvalidArgumentError(f"{name} {getattr(self, name)} must be >= 1", argument=name)
        if self.max_waiting < 0:
            raise InvalidArgumentError(f"max_waiting {self.max_waiting} must be >= 0", argument="max_waiting")


def address_check(policy: Any) -> Callable[[str, Any], None]:
    """The address check of a fetch a client asked for: as for webhooks, public addresses only
    unless the policy admits more."""
    from preheat.server.webhooks import WebhookPolicy

    policy = policy if policy is not None else WebhookPolicy()

    def check(host: str, ip: Any) -> None:
        why = policy.refusal(host, ip)
        if why is not None:
            raise FetchError(f"{why}; LoRA and image URLs are fetched from public addresses only (see --lora-url-allow-private "
                             "and --lora-url-allow)", reason="address")

    return check


def check_safetensors(path: Path) -> None:
    """A downloaded LoRA is a safetensors file (its header parses) before the store publishes it."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            (n,) = struct.unpack("<Q", head) if len(head) == 8 else (-1,)
            size = path.stat().st_size
            if not 2 <= n <= min(size - 8, 100 << 20):
                raise ValueError("no safetensors header")
            header = json.loads(f.read(n))
            if not isinstance(header, dict):
                raise ValueError("its header is not a JSON object")
    except (OSError, ValueError, struct.error) as err:
        raise ModelFormatError(f"the download is not a safetensors file ({err})") from None


def _store_source(source: str) -> str:
    """What the store pulls for a LoRA source: ``hf://org/repo/file.safetensors[@rev]`` is the
    repository ``hf://org/repo[@rev]`` (``preheat.lora`` then picks the file); URLs as they are."""
    if not source.lower().startswith("hf://"):
        return source
    repo, at, rev = source[len("hf://"):].partition("@")
    parts = repo.strip("/").split("/")
    return "hf://" + "/".join(parts[:2]) + at + rev if len(parts) > 2 else source


def _read_download(url: str) -> bytes:
    """``url``'s body, through the store's downloads folder (so that the guards of ``store._http``
    apply), removed once read."""
    from preheat.cache.root import resolve_root
    from preheat.store._http import discard_partial, download
    from preheat.store._layout import Store

    store = Store(resolve_root().path)
    store.ensure()
    try:
        return download(store, url, progress=False).read_bytes()
    finally:
        discard_partial(store, url)


_DEFAULT: Optional["Fetcher"] = None
_DEFAULT_LOCK = threading.Lock()


def default_fetcher() -> "Fetcher":
    """The fetcher of a caller that has none of its own (``parse_input`` outside a server): the defaults."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            _DEFAULT = Fetcher()
        return _DEFAULT


class Fetcher:
    """The fetches of one server: slots per host and in all, one flight per URL, metrics.
    Blocking calls (:meth:`lora`) run on :attr:`pool`, never on the threads that read local files."""

    def __init__(self, config: FetchConfig = FetchConfig(), metrics: Any = None) -> None:
        self.config = config
        self.metrics = metrics  # server.metrics.FetchMetrics or None
        self._check = address_check(config.policy)
        self._cond = threading.Condition()
        self._hosts: dict[str, int] = {}
        self._running = 0
        self._waiting = 0
        self._flights: dict[tuple[str, str], concurrent.futures.Future] = {}
        # the fetches' own threads: max_fetches run, max_waiting wait; a caller never waits for a thread
        self.pool = concurrent.futures.ThreadPoolExecutor(config.max_fetches + config.max_waiting + 1,
                                                          thread_name_prefix="preheat-fetch")

    # ---------------------------------------------------------------- what a request names

    @staticmethod
    def stored(source: str) -> bool:
        """Whether ``source`` is in the store already (no network: then it takes no slot)."""
        from preheat.store import resolve

        try:
            resolve(_store_source(source), offline=True, progress=False)
        except (PreheatError, OSError, ValueError):
            return False
        return True

    def lora(self, source: str) -> Path:
        """The store's folder for a LoRA URL, pulled under every guard (blocking)."""
        from preheat.store import pull

        source = _store_source(source)
        return self._once("lora", source, self.config.max_lora_bytes,
                          lambda: pull(source, progress=False, check=check_safetensors))

    def image(self, url: str) -> bytes:
        """The bytes of an image or mask a request names by URL (``max_image_bytes``), under every
        guard (blocking). Never stored: the download is read, then removed."""
        if not url.lower().startswith(("http://", "https://")):
            raise self._refused(FetchError(f"cannot fetch {url[:100]!r}: images are fetched from http(s):// URLs only",
                                           reason="invalid"))
        return self._once("image", url, self.config.max_image_bytes, lambda: _read_download(url))

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    # ---------------------------------------------------------------- the guards

    def _once(self, kind: str, url: str, max_bytes: int, work: Callable[[], T]) -> T:
        """``work`` for ``url``, once at a time: a second caller waits for the first's result."""
        deadline = time.monotonic() + self.config.deadline_s
        with self._cond:
            flight = self._flights.get((kind, url))
            owner = flight is None
            if owner:
                flight = self._flights[(kind, url)] = concurrent.futures.Future()
        assert flight is not None
        if not owner:
            try:
                return flight.result(timeout=max(0.0, deadline - time.monotonic()))
            except concurrent.futures.TimeoutError:
                raise self._refused(FetchError(f"cannot fetch {url}: not finished within {self.config.deadline_s:g}s",
                                               reason="deadline")) from None
        try:
            result = self._guarded(url, max_bytes, deadline, work)
        except BaseException as err:
            flight.set_exception(err)
            raise
        else:
            flight.set_result(result)
            return result
        finally:
            with self._cond:
                self._flights.pop((kind, url), None)

    def _guarded(self, url: str, max_bytes: int, deadline: float, work: Callable[[], T]) -> T:
        from preheat.store import DownloadLimits, address_check as store_address_check, download_limits

        host = (urlsplit(url).hostname or "").lower()
        self._take_slot(url, host, deadline)
        start, outcome = time.monotonic(), "ok"
        m = self.metrics
        if m is not None:
            m.in_flight.inc()
        on_bytes = m.bytes.inc if m is not None else None
        try:
            limits = DownloadLimits(self.config.connect_timeout_s, deadline, max_bytes, on_bytes)
            with store_address_check(self._check), download_limits(limits):
                return work()
        except FetchError as err:
            outcome = "refused"
            raise self._refused(err) from None
        except ModelFormatError as err:
            outcome = "refused"
            raise self._refused(FetchError(f"cannot use {url}: {err}", reason="invalid")) from None
        finally:
            with self._cond:
                self._running -= 1
                self._hosts[host] -= 1
                if not self._hosts[host]:
                    del self._hosts[host]
                self._cond.notify_all()
            if m is not None:
                m.in_flight.dec()
                m.seconds.labels(outcome=outcome).observe(time.monotonic() - start)

    def _take_slot(self, url: str, host: str, deadline: float) -> None:
        cfg = self.config

        def free() -> bool:
            return self._running < cfg.max_fetches and self._hosts.get(host, 0) < cfg.per_host

        with self._cond:
            if not free():
                if self._waiting >= cfg.max_waiting:
                    raise self._refused(FetchError(f"cannot fetch {url}: {cfg.max_fetches} fetches are running and "
                                                   f"{self._waiting} waiting; retry later", reason="busy"))
                self._waiting += 1
                self._gauge_waiting()
                try:
                    ok = self._cond.wait_for(free, max(0.0, deadline - time.monotonic()))
                finally:
                    self._waiting -= 1
                    self._gauge_waiting()
                if not ok:
                    raise self._refused(FetchError(
                        f"cannot fetch {url}: no fetch slot came free within {cfg.deadline_s:g}s "
                        f"({cfg.per_host} per host, {cfg.max_fetches} in all)", reason="busy"))
            self._running += 1
            self._hosts[host] = self._hosts.get(host, 0) + 1

    def _gauge_waiting(self) -> None:
        if self.metrics is not None:
            self.metrics.waiting.set(self._waiting)

    def _refused(self, err: FetchError) -> FetchError:
        if self.metrics is not None:
            self.metrics.refusals.labels(reason=err.reason or "error").inc()
        return err

    @property
    def in_flight(self) -> int:
        with self._cond:
            return self._running
