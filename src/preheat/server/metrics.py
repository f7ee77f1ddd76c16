"""Prometheus metrics, each set in its own ``CollectorRegistry`` (never the global one), so that
several cores and apps can live in one process (tests, the bench)."""

from __future__ import annotations

from typing import Any, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

__all__ = ["CoreMetrics", "HttpMetrics", "Forward", "LoraMetrics", "FetchMetrics"]

COMPILE_PHASES = ("traffic",)  # programs compiled after READY (warm-up's are preheat_warmup_programs)
PREDICTION_STATUSES = ("succeeded", "failed", "canceled")  # Cog's final statuses (predictions.TERMINAL)
CACHE_LAYERS = ("memory", "aot", "xla", "none")  # where an executable came from (preheat.timings)
RETUNE_OUTCOMES = ("replaced", "kept", "failed", "canceled")  # an idle retune's end (preheat.cache.retune)
_IMAGE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class CoreMetrics:
    """What the batching engine does: batches, queue, compiles, warm-up and its cache layers."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.predictions = Counter("preheat_predictions", "Predictions that reached a final status", ["status"], registry=r)
        self.batches = Counter("preheat_batches", "Engine calls made by the batching worker", registry=r)
        self.batch_images = Histogram("preheat_batch_images", "Real (unpadded) images per engine call",
                                      buckets=_IMAGE_BUCKETS, registry=r)
        self.batch_requests = Histogram("preheat_batch_requests", "Predictions merged into one engine call",
                                        buckets=_IMAGE_BUCKETS, registry=r)
        self.padded_images = Counter("preheat_padded_images", "Dummy images added to fill a compiled bucket", registry=r)
        self.batch_seconds = Histogram("preheat_batch_seconds", "Wall time of one engine call (incl. encoding)",
                                       buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_depth = Gauge("preheat_queue_depth", "Predictions waiting for a batch", registry=r)
        self.running = Gauge("preheat_running", "Predictions in the engine call now running", registry=r)
        self.compiles = Counter("preheat_compiles", "Programs not found in memory (compiled or loaded from the "
                                "compile cache), by phase", ["phase"], registry=r)
        self.warmup_programs = Counter("preheat_warmup_programs", "Programs prepared at start-up, by where the "
                                       "executable came from (memory|aot|xla = cache hit, none = compiled)",
                                       ["cache_layer"], registry=r)
        self.warmup_seconds = Gauge("preheat_warmup_seconds", "Start-up time per compiled bucket",
                                    ["bucket", "sampler", "guided", "cache_layer"], registry=r)
        self.ready = Gauge("preheat_ready", "1 when set-up succeeded and the server accepts predictions", registry=r)
        self.setup_seconds = Gauge("preheat_setup_seconds", "Model load + warm-up time", registry=r)
        self.retunes = Counter("preheat_retunes", "Idle retunes of entries compiled without autotuning, by outcome "
                               "(replaced: the autotuned compile was faster and now serves; kept; failed; canceled)",
                               ["outcome"], registry=r)
        self.retunes_waiting = Gauge("preheat_retunes_waiting", "Served executables from not-autotuned entries not "
                                     "yet retuned (0 where the backend does not autotune)", registry=r)
        # every labelled series a scrape can expect exists from the start, at zero (a dashboard's
        # rate() needs the zero; a series that appears only on the first compile has no "before")
        for phase in COMPILE_PHASES:
            self.compiles.labels(phase=phase)
        for status in PREDICTION_STATUSES:
            self.predictions.labels(status=status)
        for layer in CACHE_LAYERS:
            self.warmup_programs.labels(cache_layer=layer)
        for outcome in RETUNE_OUTCOMES:
            self.retunes.labels(outcome=outcome)

    def watch_retune(self, retuner: Any) -> None:
        """``preheat_retunes_waiting`` reads a ``preheat.cache.retune.IdleRetuner`` at each scrape."""
        self.retunes_waiting.set_function(lambda: retuner.waiting)

    def watch_loras(self, runtime: Any) -> None:
        """Expose a ``preheat.lora.LoraRuntime``'s LRU counts (once per registry). The runtime, not
        its cache, is watched: another server on the same pipeline (``hold``) replaces the cache."""
        if not getattr(self, "_loras", None):
            self._loras = LoraMetrics(runtime)
            self.registry.register(self._loras)
        self._loras.runtime = runtime


class FetchMetrics:
    """The fetches of URLs that requests name (``preheat.server.fetch``), in the core's registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.in_flight = Gauge("preheat_fetches_in_flight", "URL fetches holding a slot now", registry=r)
        self.waiting = Gauge("preheat_fetches_waiting", "URL fetches waiting for a slot now", registry=r)
        self.bytes = Counter("preheat_fetch_bytes", "Bytes downloaded for URLs that requests name", registry=r)
        self.refusals = Counter("preheat_fetch_refusals", "URL fetches refused or failed, by reason (address, size, "
                                "deadline, busy, invalid, http, network)", ["reason"], registry=r)
        self.seconds = Histogram("preheat_fetch_seconds", "Time a URL fetch held its slot, by outcome (ok|refused)",
                                 ["outcome"], buckets=_LATENCY_BUCKETS, registry=r)


class LoraMetrics(Collector):
    """The LRU of LoRAs held ready (``--max-loras``): lookups that found the LoRA held (hits), that
    read it (misses), LoRAs let go to make room (evictions), and how many are held now."""

    def __init__(self, runtime: Any) -> None:
        self.runtime = runtime

    def collect(self) -> Iterable:
        c = self.runtime.cache  # the LRU held now (a fresh one after a hold: a counter reset)
        for name, value, text in (("hits", c.hits, "LoRA requests whose LoRA was held ready"),
                                  ("misses", c.misses, "LoRA requests whose LoRA was read (and checked) first"),
                                  ("evictions", c.evictions, "LoRAs let go to make room (least recently used)")):
            yield CounterMetricFamily(f"preheat_lora_cache_{name}", text, value=value)
        yield GaugeMetricFamily("preheat_lora_cache_loras", "LoRAs held ready now", value=len(c))
        yield GaugeMetricFamily("preheat_lora_cache_max_loras", "LoRAs that can be held (--max-loras)", value=c.max_size)


class HttpMetrics:
    """Per-app HTTP metrics; the app's registry also forwards its core's metrics."""

    def __init__(self, core_registry: CollectorRegistry | None = None) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("preheat_http_requests", "HTTP requests by route, method and status code",
                                ["route", "method", "code"], registry=r)
        self.latency = Histogram("preheat_http_request_seconds", "HTTP request latency by route",
                                 ["route", "method"], buckets=_LATENCY_BUCKETS, registry=r)
        if core_registry is not None:
            r.register(Forward(core_registry))


class Forward(Collector):
    """Expose another registry's metrics through this one."""

    def __init__(self, source: CollectorRegistry) -> None:
        self.source = source

    def collect(self) -> Iterable:
        return self.source.collect()

    def describe(self) -> Iterable:
        return []
