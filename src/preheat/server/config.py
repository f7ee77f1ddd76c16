"""What a server is asked to be (``CoreConfig``: the warm declaration plus the serving-only
limits) and how it gets its pipeline (``load_pipeline``), kept apart from the core's threads so
that the Ray and Runpod surfaces can build and check a configuration without the batcher.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Optional

from preheat.errors import InvalidArgumentError
from preheat.settings import (ENV_SETTINGS, LIMITS, RETUNE_IDLE_S, SETTINGS, ServeSettings, check_limits, env_var,
                              flag_of, parse_idle_s, settings_from_env, typed_setting)
from preheat.warm import GUIDANCE_MODES, SettingNames, WarmSet

# the declaration's tables and parsers (``preheat.settings``), where the config's readers import them
__all__ = ["CoreConfig", "SettingNames", "load_pipeline", "check_backend", "http_options", "fetch_config",
           "address_policy", "log_to_stderr", "ENV_SETTINGS", "env_var", "settings_from_env", "typed_setting", "RETUNE_IDLE_S", "parse_idle_s", "LIMITS",
           "check_limits"]


def _default(name: str) -> Any:
    """The declared default of setting ``name`` (``preheat.settings``), which a config field shares."""
    return SETTINGS[name].default


@dataclass
class CoreConfig:
    model: Optional[str] = None  # a diffusers folder; None = the built-in model
    backend: str = _default("backend")
    compile: str = _default("compile")  # torch backend: none, inductor, aot or regional (preheat.torch.compile)
    dtype: str = _default("dtype")
    variant: Optional[str] = None  # weight files *.VARIANT.safetensors
    cache: Optional[str] = None  # compile cache layers: "full" (None), "xla" or "off"
    weights_dtype: Optional[str] = None  # jax: the denoiser's weights stored in this dtype (int8, float8_e4m3fn)
    weights_layers: str = _default("weights_layers")  # jax: which layers weights_dtype stores
    encoders_on: str = _default("encoders_on")  # jax: text encoders streamed from host memory ("offload") or run on the host's CPU
    config: Optional[str] = None  # ``model`` a single .safetensors file, read with this folder's configs
    controlnet: Optional[str] = None  # jax: a ControlNetModel folder beside the UNet (preheat.load(controlnet=...))
    refiner: Optional[str] = None  # jax: an SDXL refiner folder that takes over part-way (preheat.load(refiner=...))
    progress: bool = True  # the programs report each step (streamed step events); off: as `warm --target` compiles
    max_batch_size: int = _default("max_batch_size")
    devices: Any = None  # jax: "all", a count or device ids; None = preheat.load's default (all)
    fsdp: int = _default("fsdp")  # jax: the devices each weight is split over (1: copied to each)
    batch_wait_ms: float = _default("batch_wait_ms")
    max_queue: int = _default("max_queue")  # predictions waiting (not running); more -> QueueFull
    max_steps: int = _default("max_steps")
    max_guidance: float = 50.0
    samplers: tuple[str, ...] = ()  # offered (and warmed) samplers; () = the model's default only
    sizes: tuple[tuple[int, int], ...] = ()  # text-to-image: served (width, height); () = the model's default
    # offered (and warmed) optional data inputs (a negative prompt, an image, a mask: WarmSet.inputs);
    # None = those the family offers by default (all but FLUX.1's negative prompt); () = the required ones only
    # (a text-only server). Others are refused.
    inputs: Optional[tuple[str, ...]] = None
    # served values of static inputs besides the size (WarmSet.input_values: max_sequence_length=256,512);
    # () = each one's default only. Others are refused.
    input_values: tuple[tuple[str, tuple[Any, ...]], ...] = ()
    keep_finished: int = 1000  # finished predictions kept for GET / PUT retries
    guidance: tuple[str, ...] = GUIDANCE_MODES  # warmed guidance modes ("on" only where the model can guide)
    push_grace_s: float = _default("push_grace_s")  # at close(), how long background uploads to the store may take
    lora_ranks: tuple[int, ...] = ()  # LoRA rank buckets warmed (preheat.lora.BUCKETS); others compile on first use
    max_loras: int = _default("max_loras")  # LoRAs held ready (read, factors on the device), least recently used out
    lora_dir: Optional[str] = None  # requests' local LoRA files only from under this folder (None: no local files)
    lora_urls: Any = None  # server.webhooks.WebhookPolicy for requests' http(s) LoRA URLs (None: public only)
    fetch: Any = None  # server.fetch.FetchConfig: timeouts, size caps, slots of those fetches (None: defaults)
    max_image_pixels: Optional[int] = None  # width x height of a request's image (None: image_input's 4096²)
    # on a GPU, executables served from entries compiled without autotuning (`warm --target`) are
    # compiled again, autotuned, after this long without a request, and swapped if faster (None: off)
    retune_idle_s: Optional[float] = RETUNE_IDLE_S
    # how the user named the settings a set-up message names (``preheat.warm.resolve``): the command
    # line's options unless the surface read them elsewhere (Runpod: ``PREHEAT_INPUTS``). Where a
    # value came from is not what the server is: configs that differ only here are equal.
    names: SettingNames = field(default=SettingNames(), compare=False)

    def check(self) -> None:
        """The limits in range and ``lora_dir`` a folder here, or one line naming the setting as the
        user gave it (``names``). A server checks this before it loads anything: a LoRA folder that
        is not there would otherwise fail every request that names a file, not the start."""
        name_of = functools.partial(getattr, self.names)  # a setting's name as the user gave it
        check_limits({name: getattr(self, name) for name in LIMITS}, name_of)
        if self.lora_dir is not None and not Path(self.lora_dir).is_dir():
            label = name_of("lora_dir")
            raise InvalidArgumentError(f"{label} {self.lora_dir!r} is not a folder here", argument=label)

    def warm_set(self) -> WarmSet:
        """The declaration this server warms (the same object ``preheat warm`` compiles)."""
        from preheat.lora import check_lora_ranks

        return WarmSet(**{**_declared(self), "lora_ranks": check_lora_ranks(self.lora_ranks)})

    @classmethod
    def from_settings(cls, settings: ServeSettings, warm: WarmSet, names: SettingNames,
                      name_of: Callable[[str], str] = flag_of) -> "CoreConfig":
        """The server ``settings`` describe, warming ``warm`` (``settings.warm_set``): each serving
        setting that is a field here, typed; ``names``: how its set-up messages name the settings.
        A bad address or fetch limit is one line naming its flag."""
        serving = {f.name for f in fields(cls)} & {name for name, s in SETTINGS.items() if "warm" not in s.surfaces}
        serving.discard("retune_idle_s")  # text as given ("30", "off"): parsed below
        return cls.from_warm_set(
            warm, **{name: getattr(settings, name) for name in serving},
            retune_idle_s=parse_idle_s(settings.retune_idle_s, name_of("retune_idle_s")),
            lora_urls=address_policy(settings, "lora_url"), fetch=fetch_config(settings), names=names)

    @classmethod
    def from_warm_set(cls, warm: WarmSet, **options: Any) -> "CoreConfig":
        """A server for the declared set; ``options``: the serving-only fields (queue, limits, ...)."""
        return cls(**{**_declared(warm), **options})  # options' devices and fsdp over the set's


def _declared(source: Any) -> dict[str, Any]:
    """The warm declaration's fields (``WarmSet``'s, every one a field of CoreConfig too) of ``source``
    (a WarmSet or a CoreConfig), each list as the tuple both hold (Ray's typed args give lists)."""
    out = {f.name: getattr(source, f.name) for f in fields(WarmSet)}
    for name in ("samplers", "sizes", "guidance", "lora_ranks", "inputs"):
        out[name] = None if out[name] is None else tuple(out[name])
    return out


def address_policy(settings: ServeSettings, kind: str = "webhook") -> Any:
    """The address policy of webhooks (``kind`` "webhook") or of requests' URLs ("lora_url");
    a bad CIDR names its flag."""
    from preheat.server.webhooks import WebhookPolicy, WebhookRefused

    try:
        return WebhookPolicy(allow_private=getattr(settings, f"{kind}_allow_private"),
                             allow=tuple(getattr(settings, f"{kind}_allow")))
    except WebhookRefused as err:
        raise InvalidArgumentError(f"{flag_of(kind + '_allow')}: {err}") from None


def fetch_config(settings: ServeSettings) -> Any:
    """The limits of the fetches requests cause; a bad one fails in one line naming its flag."""
    from preheat.server.fetch import FetchConfig

    flags = {"connect_timeout_s": "fetch_connect_timeout_s", "deadline_s": "fetch_deadline_s",
             "max_lora_bytes": "max_lora_bytes", "max_image_bytes": "max_image_bytes",
             "per_host": "fetch_per_host", "max_fetches": "max_fetches"}
    try:
        return FetchConfig(**{key: getattr(settings, name) for key, name in flags.items()})
    except InvalidArgumentError as err:
        flag = flag_of(flags[err.argument]) if err.argument in flags else err.argument
        raise InvalidArgumentError(f"{flag} {str(err).split(' ', 1)[1]}", argument=err.argument) from None


def http_options(settings: ServeSettings, token: Optional[str]) -> dict[str, Any]:
    """``preheat.server.serve.serve``'s keywords beside the config: the HTTP server's limits."""
    if settings.max_header_bytes < 1024 or settings.max_headers < 8:
        raise InvalidArgumentError(f"--max-header-bytes {settings.max_header_bytes} must be >= 1024 and "
                                   f"--max-headers {settings.max_headers} >= 8")
    return dict(host=settings.host, port=settings.port, grace_s=settings.grace_s, token=token,
                log_level=settings.log_level, webhooks=address_policy(settings),
                max_body_bytes=settings.max_body_bytes, header_timeout_s=settings.header_timeout_s,
                body_timeout_s=settings.body_timeout_s, max_header_bytes=settings.max_header_bytes,
                max_headers=settings.max_headers, keep_alive_on_failure=settings.keep_alive_on_failure)


def log_to_stderr(level: str) -> None:
    """The server's log lines (``preheat.server``) to stderr at ``level`` (info, ...), timestamped, once
    per process however often it is asked (``preheat serve``, each Ray replica)."""
    import logging
    import sys

    logger = logging.getLogger("preheat.server")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s preheat: %(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
    logger.setLevel(level.upper())
    logger.propagate = False


def check_backend(config: Any, weights_dtype: str = "--weights-dtype") -> None:
    """What applies to one backend only, given for another (``--compile`` is torch's, ``--weights-dtype``
    jax's: named ``weights_dtype``, as the user gave it), or an unknown backend: one line, before anything loads."""
    if config.backend not in ("jax", "torch"):
        raise InvalidArgumentError(f"unknown backend {config.backend!r}; use jax or torch")
    if config.compile != "none" and config.backend != "torch":
        raise InvalidArgumentError(f"--compile {config.compile} applies to --backend torch")
    if config.weights_dtype is not None and config.backend != "jax":
        raise InvalidArgumentError(f"{weights_dtype} applies to --backend jax", argument=weights_dtype)


def load_pipeline(config: CoreConfig) -> Any:
    """The engine for ``config.backend``; a one-line ``InvalidArgumentError`` for an unusable backend."""
    check_backend(config)
    if config.backend == "jax":
        import preheat
        from preheat.warm import load_keywords, prefetch_calls

        # the warm-up's executables load while the weights are read
        return preheat.load(config.model, **load_keywords(config), prefetch=prefetch_calls(config.warm_set()))
    try:
        from preheat.backends.torch import load_torch_pipeline
    except ImportError as err:
        raise InvalidArgumentError(f"--backend torch needs the torch extra ({err})") from None
    from preheat.warm import companions

    return load_torch_pipeline(config.model, dtype=config.dtype, compile=config.compile, variant=config.variant,
                               cache=config.cache, **({} if config.config is None else {"config": config.config}),
                               **companions(config))
