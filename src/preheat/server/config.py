"""What a server is asked to be (``CoreConfig``: the warm declaration plus the serving-only
limits) and how it gets its pipeline (``load_pipeline``), kept apart from the core's threads so
that the Ray and Runpod surfaces can build and check a configuration without the batcher.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from preheat.warm import GUIDANCE_MODES, WarmSet

__all__ = ["CoreConfig", "load_pipeline"]


@dataclass
class CoreConfig:
    model: Optional[str] = None  # a diffusers folder; None = the built-in model
    backend: str = "jax"
    compile: str = "none"  # torch backend: none, inductor, aot or regional (preheat.torch.compile)
    dtype: str = "float32"
    variant: Optional[str] = None  # weight files *.VARIANT.safetensors
    cache: Optional[str] = None  # compile cache layers: "full" (None), "xla" or "off"
    weights_dtype: Optional[str] = None  # jax: the denoiser's weights stored in this dtype (float8_e4m3fn)
    weights_layers: str = "layerwise"  # jax: which layers weights_dtype stores
    config: Optional[str] = None  # jax: ``model`` a single .safetensors file, read with this folder's configs
    progress: bool = True  # the programs report each step (streamed step events); off: as `warm --target` compiles
    max_batch_size: int = 8
    devices: Any = None  # jax: "all", a count or device ids; None = preheat.load's default (all)
    fsdp: int = 1  # jax: the devices each weight is split over (1: copied to each)
    batch_wait_ms: float = 10.0
    max_queue: int = 64  # predictions waiting (not running); more -> QueueFull
    max_steps: int = 200
    max_guidance: float = 50.0
    samplers: tuple[str, ...] = ()  # offered (and warmed) samplers; () = the model's default only
    sizes: tuple[tuple[int, int], ...] = ()  # text-to-image: served (width, height); () = the model's default
    keep_finished: int = 1000  # finished predictions kept for GET / PUT retries
    guidance: tuple[str, ...] = GUIDANCE_MODES  # warmed guidance modes ("on" only where the model can guide)
    push_grace_s: float = 30.0  # at close(), how long background uploads to the store may take
    lora_ranks: tuple[int, ...] = ()  # LoRA rank buckets warmed (preheat.lora.BUCKETS); others compile on first use
    max_loras: int = 8  # LoRAs held ready (read, and their factors on the device), least recently used out
    lora_dir: Optional[str] = None  # requests' local LoRA files only from under this folder (None: no local files)
    lora_urls: Any = None  # server.webhooks.WebhookPolicy for requests' http(s) LoRA URLs (None: public only)
    fetch: Any = None  # server.fetch.FetchConfig: timeouts, size caps, slots of those fetches (None: defaults)
    max_image_pixels: Optional[int] = None  # width x height of a request's image (None: image_input's 4096²)

    def warm_set(self) -> WarmSet:
        """The declaration this server warms (the same object ``preheat warm`` compiles)."""
        from preheat.lora import check_lora_ranks

        return WarmSet(model=self.model, dtype=self.dtype, max_batch_size=self.max_batch_size,
                       samplers=tuple(self.samplers), sizes=tuple(self.sizes), guidance=tuple(self.guidance),
                       devices=self.devices, fsdp=self.fsdp, lora_ranks=check_lora_ranks(self.lora_ranks),
                       variant=self.variant, cache=self.cache, weights_dtype=self.weights_dtype,
                       weights_layers=self.weights_layers, progress=self.progress, config=self.config)

    @classmethod
    def from_warm_set(cls, warm: WarmSet, **options: Any) -> "CoreConfig":
        """A server for the declared set; ``options``: the serving-only fields (queue, limits, ...)."""
        options.setdefault("devices", warm.devices)
        options.setdefault("fsdp", warm.fsdp)
        return cls(model=warm.model, dtype=warm.dtype, variant=warm.variant, cache=warm.cache,
                   weights_dtype=warm.weights_dtype, weights_layers=warm.weights_layers, progress=warm.progress,
                   config=warm.config,
                   max_batch_size=warm.max_batch_size,
                   samplers=tuple(warm.samplers), sizes=tuple(warm.sizes), guidance=tuple(warm.guidance),
                   lora_ranks=tuple(warm.lora_ranks), **options)


def load_pipeline(config: CoreConfig) -> Any:
    """The engine for ``config.backend``; a one-line ``InvalidArgumentError`` for an unusable backend."""
    from preheat.errors import InvalidArgumentError

    if config.backend == "jax":
        if config.compile != "none":
            raise InvalidArgumentError(f"--compile {config.compile} applies to --backend torch")
        import preheat
        from preheat.warm import prefetch_calls

        # the warm-up's executables load while the weights are read
        return preheat.load(config.model, dtype=config.dtype, variant=config.variant, cache=config.cache,
                            weights_dtype=config.weights_dtype, weights_layers=config.weights_layers,
                            **({} if config.config is None else {"config": config.config}),
                            devices=config.devices, fsdp=config.fsdp, prefetch=prefetch_calls(config.warm_set()))
    if config.backend == "torch":
        if config.weights_dtype is not None or config.config is not None:
            raise InvalidArgumentError("--weights-dtype and --config apply to --backend jax",
                                       argument="--weights-dtype" if config.config is None else "--config")
        try:
            from preheat.backends.torch import load_torch_pipeline
        except ImportError as err:
            raise InvalidArgumentError(f"--backend torch needs the torch extra ({err})") from None
        return load_torch_pipeline(config.model, dtype=config.dtype, compile=config.compile, variant=config.variant,
                                   cache=config.cache)
    raise InvalidArgumentError(f"unknown backend {config.backend!r}; use jax or torch")
