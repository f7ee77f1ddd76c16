"""Every deployment setting of ``preheat serve`` and ``preheat warm``, declared once.

Each field of :class:`ServeSettings` is one setting: its name (the command line's ``--name``
unless ``flag`` says otherwise), its default and help text, how the command line types it, where
it applies (``surfaces``: ``load`` for how a model is loaded, ``warm`` for the warm declaration
both commands take, ``serve`` for every option of ``preheat serve``), its serving limit
(``limit``: the range every surface checks) and, for a deployment setting that a platform sets
from its environment, how ``PREHEAT_<NAME>`` is read (``parse``). From it come:

- the click options of ``serve``, ``warm`` and the load options of ``sample`` (``cli.settings_env``);
- :data:`ENV_SETTINGS` and :func:`typed_setting`, the one parser of the ``PREHEAT_*`` variables that
  the command line, Runpod's worker and Ray's replicas read;
- :data:`LIMITS` and :func:`check_limits`, the ranges ``CoreConfig.check`` and Ray's options check.

A new setting is one field here. A command hands its ``ServeSettings`` on (named, typed) instead
of its options one by one; it becomes what the engine and the server take (``warm_set`` here;
``CoreConfig.from_settings`` and ``http_options`` in ``preheat.server.config``), each refusal one
line naming the setting as the user gave it (``name_of``: its flag, or its variable where the
value came from there).

It sits below the server (``preheat sample``'s load options come from it, without the server) and
imports nothing heavy (the parsers are imported when a value is parsed), so ``--help`` stays cheap.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, Iterable, Mapping, Optional

from preheat.errors import InvalidArgumentError, PreheatError

__all__ = ["ServeSettings", "Setting", "SETTINGS", "ENV_SETTINGS", "LIMITS", "DTYPES", "CACHE_LAYERS",
           "RETUNE_IDLE_S", "env_var", "flag_of", "settings_from_env", "typed_setting", "parse_idle_s",
           "check_limits", "samplers_from_text"]

DTYPES = ("float32", "bfloat16", "float16")  # the denoiser dtypes the engine compiles for
CACHE_LAYERS = ("full", "xla", "off")
RETUNE_IDLE_S = 30.0  # the default --retune-idle-s: a lull, not the gap between two requests of a burst

LOAD, WARM, SERVE = frozenset({"load", "warm", "serve"}), frozenset({"warm", "serve"}), frozenset({"serve"})


def env_var(name: str) -> str:
    """The environment variable of setting ``name``: ``max_batch_size`` -> ``PREHEAT_MAX_BATCH_SIZE``."""
    return "PREHEAT_" + name.upper()


def flag_of(setting: str) -> str:
    """The command line's option of ``setting``: ``max_batch_size`` -> ``--max-batch-size``."""
    return "--" + setting.replace("_", "-")


# The parsers of PREHEAT_* text (or of an already typed value: Ray's ``serve run`` args): (value, label) -> typed.

def parse_idle_s(value: Any, label: str = "--retune-idle-s") -> Optional[float]:
    """``--retune-idle-s`` / ``PREHEAT_RETUNE_IDLE_S``: seconds >= 0, or "off" (0 is off too) -> None."""
    text = str(value).strip().lower()
    if text in ("off", "none", "false", "no"):
        return None
    try:
        seconds = float(text)
    except ValueError:
        raise InvalidArgumentError(f"{label} {value!r} must be seconds (a number) or off", argument=label) from None
    if not seconds >= 0 or seconds == float("inf"):
        raise InvalidArgumentError(f"{label} {value!r} must be >= 0 seconds, or off", argument=label)
    return seconds or None


def _text(value: Any, label: str) -> str:
    return str(value)


def _number(kind: type) -> Callable[[Any, str], Any]:
    def parse(value: Any, label: str) -> Any:
        try:
            return kind(value)
        except (TypeError, ValueError):
            raise InvalidArgumentError(f"{label} {value!r} must be {'an int' if kind is int else 'a number'}",
                                       argument=label) from None
    return parse


def _names(value: Any, label: str) -> tuple[str, ...]:
    items = value.split(",") if isinstance(value, str) else list(value)
    return tuple(str(v).strip() for v in items if str(v).strip())


def _inputs(value: Any, label: str) -> Any:  # the names are checked against the family at set-up (warm.resolve)
    from preheat.families.offer import parse_offered

    return parse_offered(value)


def _input_values(value: Any, label: str) -> Any:  # typed and checked against the family at set-up (warm.resolve)
    from preheat.warm import parse_input_values

    if isinstance(value, str):
        return parse_input_values(value, label)
    pairs = value.items() if isinstance(value, Mapping) else value  # Ray's typed args: {name: [values]}
    return tuple((str(k), tuple(v) if isinstance(v, (list, tuple)) else (v,)) for k, v in pairs)


def _sizes(value: Any, label: str) -> Any:
    from preheat.warm import parse_sizes

    return parse_sizes(value, label) if isinstance(value, str) else tuple(tuple(int(x) for x in s) for s in value)


def _devices(value: Any, label: str) -> Any:
    from preheat.sharding import parse_devices

    return parse_devices(value, label) if isinstance(value, str) else value


def _lora_ranks(value: Any, label: str) -> Any:
    from preheat.warm import parse_lora_ranks

    return parse_lora_ranks(value if isinstance(value, str) else ",".join(map(str, value)), label)


def _on_off(value: Any, label: str) -> bool:
    from preheat.env import on_off

    try:
        return on_off(value, label)
    except ValueError as err:
        raise InvalidArgumentError(str(err), argument=label) from None


@dataclass(frozen=True)
class Setting:
    """One setting's declaration (the field of :class:`ServeSettings` that holds it gives ``name``
    and ``default``)."""

    help: str = ""
    type: type = str  # the command line's type (text where the value has a syntax of its own: --sizes)
    surfaces: frozenset[str] = SERVE
    flag: Optional[str] = None  # the long option, where not --<name>
    choices: tuple[str, ...] = ()
    bounds: Optional[tuple[Optional[int], Optional[int]]] = None  # the command line's range (click refuses)
    metavar: Optional[str] = None
    limit: Optional[tuple[float, Optional[float]]] = None  # the serving limit every surface checks (check_limits)
    parse: Optional[Callable[[Any, str], Any]] = None  # a deployment setting: how PREHEAT_<NAME> is read
    is_flag: bool = False
    negation: Optional[str] = None  # a --x/--no-x pair's second flag
    multiple: bool = False
    folder: bool = False  # an existing folder
    argument: bool = False  # the positional MODEL
    name: str = ""
    default: Any = None

    @property
    def option(self) -> str:
        return self.flag or flag_of(self.name)


def setting(default: Any = None, help: str = "", **declared: Any) -> Any:
    """A field of :class:`ServeSettings` declaring one setting (see :class:`Setting`)."""
    return field(default=default, metadata={"setting": Setting(help=help, **declared)})


@dataclass(frozen=True)
class ServeSettings:
    """``preheat serve``'s settings as given (``warm`` gives the ``warm`` ones, the rest keep their
    defaults): text where a value has a syntax of its own (``sizes``: ``512x512,768x512``), parsed by
    the methods below with one-line errors."""

    # the warm declaration (`warm`, `serve`): how the model is loaded ...
    model: Optional[str] = setting(surfaces=WARM, argument=True, parse=_text)
    dtype: str = setting("float32", "The denoiser's dtype.", surfaces=LOAD, choices=DTYPES, parse=_text)
    weights_dtype: Optional[str] = setting(
        None, "Store the denoiser's weights in DTYPE (int8 with per-channel scales, or float8_e4m3fn), upcast to "
              "--dtype at use (JAX backend; default: all in --dtype).", surfaces=LOAD, metavar="DTYPE", parse=_text)
    weights_layers: str = setting(
        "layerwise", "With --weights-dtype: diffusers' layerwise-casting layers, or every Linear (AdaLN modulation "
                     "too; FLUX.1-dev 0.51x of bf16).", surfaces=LOAD, choices=("layerwise", "linear"), parse=_text)
    encoders_on: str = setting(
        "device", "The text encoders: on the device; offload: in host memory, each block streamed to the device "
                  "while prompts are encoded (FLUX.1's T5-XXL beside its transformer on a 16 GB chip); host "
                  "(FLUX.1): in host memory, run on the host's CPU (JAX backend).",
        surfaces=LOAD, choices=("device", "host", "offload"), parse=_text)
    variant: Optional[str] = setting(None, "Weight files *.VARIANT.safetensors (e.g. fp16).", surfaces=LOAD,
                                     parse=_text)
    cache: Optional[str] = setting(None, "Compile cache layers (default: full).", surfaces=LOAD, choices=CACHE_LAYERS,
                                   parse=_text)
    config: Optional[str] = setting(
        None, "MODEL is a single .safetensors file in an original layout (LDM SD 1.x/2.x, SGM SDXL, BFL FLUX.1, MMDiT "
              "SD3) or a FLUX.1 GGUF file: the diffusers folder or repository whose configs and tokenizers read it; a "
              "folder of only the component folders it lacks; or a published model's name (stable-diffusion-2-1-base: "
              "the 512 px epsilon SD 2.1). Without it the published model is inferred and what the file lacks is "
              "pulled from its repository (a GGUF file needs it) (JAX backend).",
        surfaces=LOAD, metavar="FOLDER|hf://ORG/REPO|NAME", parse=_text)
    controlnet: Optional[str] = setting(
        None, "A diffusers ControlNetModel folder run beside the UNet (SD 1.x/2.x, SDXL): the model then takes "
              "--control-image and the ControlNet's scale and step window.", surfaces=LOAD, metavar="FOLDER",
        parse=_text)
    refiner: Optional[str] = setting(
        None, "An SDXL refiner folder that takes over from an SDXL base part-way (the ensemble of experts): the model "
              "then takes --denoising-end (0.8) and the refiner's --aesthetic-score.", surfaces=LOAD,
        metavar="FOLDER", parse=_text)
    # ... and what is compiled
    max_batch_size: int = setting(8, "Largest engine batch; buckets 1, 2, 4 ... up to it are compiled.", type=int,
                                  surfaces=WARM, limit=(1, 1024), parse=_number(int))
    samplers: Optional[str] = setting(
        None, "Samplers offered (each compiled; a server refuses others). Default: the model's own.", surfaces=WARM,
        metavar="A,B,...", parse=_names)
    sizes: Optional[str] = setting(
        None, "Text-to-image: sizes served (each compiled; a server refuses others). Default: the model's.",
        surfaces=WARM, metavar="WxH,...", parse=_sizes)
    guidance: str = setting("off,on", "Guidance modes compiled ('on' only where the model can guide).",
                            surfaces=WARM, metavar="off,on", parse=_names)
    inputs: Optional[str] = setting(
        None, "Optional inputs offered (each variant compiled; a server refuses others): of the model's "
              "negative_prompt, image, mask_image; none = the required ones only (text-to-image). Default: all the "
              "model declares but FLUX.1's negative_prompt (true CFG: name it to offer it).",
        surfaces=WARM, metavar="A,B,...|none", parse=_inputs)
    input_values: Optional[str] = setting(
        None, "Static inputs' served values besides the size (each compiled; the first what a request without it "
              "gets; a server refuses others): max_sequence_length=256,512 for FLUX.1's and SD3's T5 prompt. "
              "Default: each one's default.", surfaces=WARM, metavar="NAME=A,B;...", parse=_input_values)
    lora_ranks: Optional[str] = setting(
        None, "LoRA rank buckets compiled besides no LoRA (of 16, 32, 64, 128): a LoRA whose rank fits one then "
              "runs with no compile. Default: none.", surfaces=WARM, metavar="16,32,...", parse=_lora_ranks)
    devices: Optional[str] = setting(
        None, "JAX: the devices each batch is split over (default all; $PREHEAT_DEVICES); buckets are then "
              "multiples of their count, and programs are compiled for these devices.", surfaces=WARM,
        metavar="all|N|ID,ID,...", parse=_devices)
    progress: Optional[bool] = setting(
        None, "Programs that report each step (a server's streamed step events; default on, off with --target: a "
              "GPU compiled for without a GPU cannot call the host). A server and its warm job must agree: `serve "
              "--no-progress` runs what `warm --target` compiled.", type=bool, surfaces=WARM, negation="--no-progress",
        parse=_on_off)
    fsdp: int = setting(
        1, "JAX: split each weight over F of the devices instead of copying it to each (for models that do not fit "
           "one device); F divides the device count.", type=int, surfaces=WARM, bounds=(1, None), metavar="F",
        parse=_number(int))

    # the server's own (`serve`)
    host: str = setting("127.0.0.1", "Interface to bind (loopback unless told).")
    port: int = setting(8000, "Port (0 = any free port, printed at start).", type=int, bounds=(0, 65535))
    backend: str = setting("jax", choices=("jax", "torch"))
    compile: str = setting("none", "--backend torch: eager, torch.compile, AOTInductor or regional (the repeated "
                                   "blocks).", choices=("none", "inductor", "aot", "regional"))
    batch_wait_ms: float = setting(10.0, "How long the oldest request waits for others to share its batch.",
                                   type=float, limit=(0, None), parse=_number(float))
    max_queue: int = setting(64, "Predictions allowed to wait; beyond it, 409 (Cog) / 429 (OpenAI) with Retry-After.",
                             type=int, limit=(1, None), parse=_number(int))
    max_steps: int = setting(200, "Largest num_inference_steps accepted.", type=int, limit=(1, None),
                             parse=_number(int))
    max_loras: int = setting(8, "LoRAs held ready (read, factors on the device), least recently used out; see "
                                "/metrics.", type=int, limit=(1, None), parse=_number(int))
    lora_dir: Optional[str] = setting(
        None, "Requests may name local LoRA files (lora_weights) under DIR only; without it, only http(s):// and "
              "hf:// sources.", folder=True, metavar="DIR", parse=_text)
    grace_s: float = setting(30.0, "On SIGTERM, how long in-flight predictions may take to finish.", type=float)
    push_grace_s: float = setting(30.0, "At shutdown, how long uploads to PREHEAT_CACHE_URL (run in the background) "
                                        "may take.", type=float)
    retune_idle_s: str = setting(
        "30", "On a GPU: after this long without a request, executables served from entries compiled without "
              "autotuning (warm --target) are compiled again, autotuned, in the background, timed against the served "
              "ones between requests, and swapped in (and their entries replaced) when faster. 0 or off: never.",
        metavar="SECONDS|off", parse=parse_idle_s)
    max_body_bytes: int = setting(1 << 20, "Largest request body (any transfer encoding); beyond it, 413.", type=int)
    header_timeout_s: float = setting(10.0, "A request's headers must arrive within this; else the connection is "
                                            "closed.", type=float)
    body_timeout_s: float = setting(30.0, "A request's body must arrive within this; else 408.", type=float)
    webhook_allow_private: bool = setting(
        False, "Let webhooks go to loopback/private/link-local addresses (never metadata ones).", is_flag=True)
    webhook_allow: tuple[str, ...] = setting(
        (), "Let webhooks go to this host, address or CIDR whatever it is (repeat).", multiple=True,
        metavar="HOST|CIDR")
    lora_url_allow_private: bool = setting(
        False, "Let requests' LoRA and image URLs be fetched from loopback/private/link-local addresses (never "
               "metadata ones).", is_flag=True)
    lora_url_allow: tuple[str, ...] = setting(
        (), "Let requests' LoRA and image URLs be fetched from this host, address or CIDR whatever it is (repeat).",
        multiple=True, metavar="HOST|CIDR")
    keep_alive_on_failure: bool = setting(
        False, "If the model cannot be set up, stay up answering SETUP_FAILED on /health-check (as Cog does) instead "
               "of exiting 1.", is_flag=True)
    fetch_connect_timeout_s: float = setting(
        10.0, "A URL a request names (lora_weights): its host must accept the connection within this.", type=float)
    fetch_deadline_s: float = setting(
        120.0, "... and the whole download (waiting for a fetch slot included) must end within this; else 422.",
        type=float)
    max_lora_bytes: int = setting(2 << 30, "Largest LoRA download (Content-Length, and the bytes as they stream); "
                                           "beyond it, 422.", type=int)
    max_image_bytes: int = setting(32 << 20, "Largest image or mask a request names by URL.", type=int)
    max_image_pixels: int = setting(
        4096 * 4096, "Largest width x height of a request's image or mask, read from the file's header before any "
                     "pixel is decoded (PIL's decompression-bomb limit follows it); beyond it, 422.", type=int,
        limit=(1, None), parse=_number(int))
    fetch_per_host: int = setting(2, "Downloads at once from one host (more wait for a slot, within "
                                     "--fetch-deadline-s).", type=int)
    max_fetches: int = setting(4, "Downloads at once in all. Local LoRA files and ones already stored never wait "
                                  "for these.", type=int)
    max_header_bytes: int = setting(64 << 10, "A request's headers in all (request line included); beyond it, 431 "
                                              "and the connection closed.", type=int)
    max_headers: int = setting(100, "Header lines per request; beyond it, 431 and the connection closed.", type=int)
    log_level: str = setting("info", choices=("debug", "info", "warning", "error"))
    # on Ray Serve (`serve --ray`)
    on_ray: bool = setting(False, "Serve on Ray Serve (the ray extra): replicas of this server behind Serve's proxy; "
                                  "PREHEAT_CACHE_URL and its credentials reach every replica.", flag="--ray",
                           is_flag=True)
    address: Optional[str] = setting(None, "--ray: the cluster to deploy on (default: start one on this machine).",
                                     metavar="auto|ray://HOST:PORT")
    replicas: int = setting(1, "--ray: replicas.", type=int)
    gpus_per_replica: float = setting(0.0, "--ray: GPUs each replica takes (1, or a pod's count; 0 on CPU).",
                                      type=float)

    def warm_set(self, name_of: Callable[[str], str] = flag_of) -> Any:
        """The ``WarmSet`` the declaration describes (one-line errors for bad values, naming each
        setting as ``name_of`` says the user gave it). A ``random:NAME`` model stays as given:
        ``preheat.load`` writes its folder, and ``warm.resolve`` serves a tiny one at its tiny size
        by default, on every surface alike."""
        from preheat.families.offer import parse_offered
        from preheat.lora import check_lora_ranks
        from preheat.sharding import parse_devices
        from preheat.warm import WarmSet, parse_input_values, parse_lora_ranks, parse_sizes

        check_limits({"max_batch_size": self.max_batch_size}, name_of)
        guidance = tuple(dict.fromkeys(g.strip().lower() for g in self.guidance.split(",") if g.strip()))
        if not guidance or any(g not in ("off", "on") for g in guidance):
            raise InvalidArgumentError(f"{name_of('guidance')} {self.guidance!r} must be off, on or off,on")
        ranks = check_lora_ranks(parse_lora_ranks(self.lora_ranks, name_of("lora_ranks")))
        samplers = samplers_from_text(self.samplers, name_of("samplers"))
        sizes = parse_sizes(self.sizes, name_of("sizes"))
        devices = parse_devices(self.devices, name_of("devices"))
        return WarmSet(model=self.model, dtype=self.dtype, max_batch_size=self.max_batch_size, samplers=samplers,
                       sizes=sizes, guidance=guidance, lora_ranks=tuple(ranks), devices=devices, fsdp=self.fsdp,
                       variant=self.variant, cache=self.cache, weights_dtype=self.weights_dtype,
                       weights_layers=self.weights_layers, encoders_on=self.encoders_on,
                       progress=True if self.progress is None else self.progress,
                       config=self.config, controlnet=self.controlnet, refiner=self.refiner,
                       inputs=parse_offered(self.inputs),
                       input_values=parse_input_values(self.input_values, name_of("input_values")))

    def check_serving(self, name_of: Callable[[str], str] = flag_of) -> None:
        """The server's limits (the core's, then the HTTP server's), or one line naming the first bad one."""
        check_limits({name: getattr(self, name) for name in LIMITS}, name_of)
        for name, low, strict in (("grace_s", 0, False), ("header_timeout_s", 0, True), ("body_timeout_s", 0, True),
                                  ("max_body_bytes", 1, False)):
            value = getattr(self, name)
            if value < low or (strict and value == low):
                raise InvalidArgumentError(f"{flag_of(name)} {value} must be {'>' if strict else '>='} {low}")
        if self.push_grace_s < 0:
            raise InvalidArgumentError(f"--push-grace-s {self.push_grace_s} must be >= 0")
        parse_idle_s(self.retune_idle_s, name_of("retune_idle_s"))


#: every setting's declaration, by name, in the order the command line lists them
SETTINGS: dict[str, Setting] = {f.name: replace(f.metadata["setting"], name=f.name, default=f.default)
                                for f in fields(ServeSettings)}

# The settings a deployment sets from its environment, each as ``PREHEAT_<NAME>``: the command line,
# Runpod's handler and Ray's replicas read this one table, so none misses a setting another takes.
ENV_SETTINGS: tuple[str, ...] = tuple(name for name, s in SETTINGS.items() if s.parse is not None)

# Each serving limit's range (low, high; None: no bound), checked by every place that sets them
# (``preheat serve``, Ray's options, and every CoreConfig a Core is built from, which is where
# Runpod's PREHEAT_* variables land), so no surface lets through what another refuses.
LIMITS: dict[str, tuple[float, Optional[float]]] = {
    name: s.limit for name, s in SETTINGS.items() if s.limit is not None}


def check_limits(values: Mapping[str, Any], name_of: Callable[[str], str] = str) -> None:
    """Each of ``values``' LIMITS settings in its range (None: the default), or one line naming the
    first that is not as the user gave it (``name_of(setting)``: a flag, a variable)."""
    for name, (low, high) in LIMITS.items():
        value = values.get(name)
        if value is None or (value >= low and (high is None or value <= high)):
            continue
        label = name_of(name)
        span = f">= {low}" if high is None else f"in {low}..{high}"
        raise InvalidArgumentError(f"{label} {value} must be {span}", argument=label)


def settings_from_env(env: Mapping[str, str], names: Iterable[str] = ENV_SETTINGS) -> dict[str, str]:
    """The settings of ``names`` that ``env`` gives (set and not blank), as text keyed by name."""
    return {name: env[env_var(name)] for name in names if env.get(env_var(name), "").strip()}


def typed_setting(name: str, value: Any, label: Optional[str] = None) -> Any:
    """A deployment setting (:data:`ENV_SETTINGS`) from text (an environment variable, ``serve run
    key=value``) or an already typed value, as its declaration's ``parse`` reads it. A malformed
    one is a one-line InvalidArgumentError naming ``label`` (default ``name``: what the user wrote)."""
    label = label or name
    if value is None:
        return None
    try:
        return (SETTINGS[name].parse or _text)(value, label)
    except PreheatError:
        raise
    except (TypeError, ValueError) as err:  # a typed value of the wrong shape (Ray's serve run args)
        raise InvalidArgumentError(f"{label} {value!r}: {err}", argument=label) from None


def samplers_from_text(text: Optional[str], label: str = "--samplers") -> tuple[str, ...]:
    """``--samplers a,b`` -> ("a", "b"); unknown names fail in one line naming ``label``."""
    from preheat.errors import SchedulerConfigError
    from preheat.samplers import SAMPLERS

    names = tuple(dict.fromkeys(n.strip() for n in (text or "").split(",") if n.strip()))
    for name in names:
        if name not in SAMPLERS:
            raise SchedulerConfigError(f"{label} {name!r} is unknown; choose from {', '.join(SAMPLERS)}")
    return names
