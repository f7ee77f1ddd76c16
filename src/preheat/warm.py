"""What "warm" means for a model, written once: the declaration (``WarmSet``), the programs it
covers (``signatures``), and how one is compiled (``run_signature``) or looked up (``status``).

``preheat warm`` compiles the set ahead of time (a Docker build step, CI, a one-off job against
the fleet store); ``preheat serve`` warms up the same set before READY (``Core`` calls
``resolve`` and ``signatures``), so the two agree and a pod's first request never compiles.

A signature is one serving program: sampler x guidance (off, and on when the model can guide)
x batch bucket x served size (models that take more than their native one) x each variant of
the family's data inputs that warm-up must compile, of those the set offers (``WarmSet.inputs``;
``InputSpec.warm``: negative prompts given or not, guided only; an image given or not, a mask
with it -- a server offering no image warms no image programs, and refuses an image -- the image a placeholder of the
served size, so that the VAE encoder is compiled for every size a request can reach) x each served
value of the other static inputs (``WarmSet.input_values``: a T5 prompt's length) x LoRA (none, and each declared rank bucket: ``lora_ranks``). The step count
is runtime data, so each is compiled with ``steps=1``; a LoRA bucket with a LoRA of zeros
(``LoraTargets.zeros`` in ``preheat.lora``), since any LoRA of the bucket is data of the same program.

It sits above the engine (it drives ``Pipeline.generate`` and ``prepare``) and below the surfaces
that declare a set (``preheat warm``, ``preheat serve``); ``preheat.cache`` only stores what it compiles.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Any, Callable, NamedTuple, Optional

from preheat.errors import InvalidArgumentError

__all__ = ["WarmSet", "WarmSignature", "buckets_for", "bucket_for", "served_call", "ServedCall", "resolve", "load_keywords",
           "signatures", "run_signature", "status", "programs", "prefetch_calls", "warm", "offered_inputs", "OfferedInputs", "SettingNames",
           "parse_sizes", "parse_lora_ranks", "parse_input_values"]

GUIDANCE_MODES = ("off", "on")


def _entries(text: Optional[str], sep: str = ",") -> list[str]:
    """The non-blank entries of a ``sep``-separated list as given (``None``: none), stripped."""
    return [item.strip() for item in (text or "").split(sep) if item.strip()]


def parse_sizes(text: Optional[str], name: str = "--sizes") -> tuple[tuple[int, int], ...]:
    """``512x512,768x512`` -> ((512, 512), (768, 512)): ``preheat serve --sizes`` and Runpod's
    ``PREHEAT_SIZES``. A malformed entry fails in one line naming ``name`` (what the user wrote)."""
    out = []
    for item in _entries((text or "").lower()):
        w, sep, h = item.partition("x")
        if not sep or not w.isdigit() or not h.isdigit() or int(w) <= 0 or int(h) <= 0:
            raise InvalidArgumentError(f"{name} {item!r} must be WIDTHxHEIGHT, e.g. 512x512", argument=name)
        out.append((int(w), int(h)))
    return tuple(dict.fromkeys(out))


def parse_lora_ranks(text: Optional[str], name: str = "--lora-ranks") -> tuple[int, ...]:
    """``16,32`` -> (16, 32): ``--lora-ranks`` and Runpod's ``PREHEAT_LORA_RANKS`` (that each is a
    rank bucket is ``preheat.lora.check_lora_ranks``'s to say). A malformed entry fails in one line."""
    for item in _entries(text):
        if not item.isdigit():
            raise InvalidArgumentError(f"{name} {item!r} must be rank buckets, e.g. 16,32")
    return tuple(dict.fromkeys(int(item) for item in _entries(text)))


def parse_input_values(text: Optional[str], name: str = "--input-values") -> tuple[tuple[str, tuple[str, ...]], ...]:
    """``max_sequence_length=256,512`` (entries split by ``;``) -> (("max_sequence_length", ("256",
    "512")),): ``--input-values`` and ``PREHEAT_INPUT_VALUES``, the served values of a model's
    static inputs. The names and values are typed and checked against the family at set-up
    (``resolve``); a malformed entry, or a name given twice, fails here in one line naming ``name``."""
    out: dict[str, tuple[str, ...]] = {}
    for item in _entries(text, ";"):
        key, sep, values = item.partition("=")
        key = key.strip()
        listed = tuple(dict.fromkeys(_entries(values)))
        if not sep or not key or not listed:
            raise InvalidArgumentError(f"{name} {item!r} must be NAME=VALUE,..., e.g. max_sequence_length=256,512",
                                       argument=name)
        if key in out:
            raise InvalidArgumentError(f"{name} names {key} twice; list its values once: {key}=A,B", argument=name)
        out[key] = listed
    return tuple(out.items())


def buckets_for(max_batch_size: int, devices: int = 1) -> tuple[int, ...]:
    """Compiled batch sizes: the device count times powers of two below max, then max rounded up
    to a multiple of the device count, so that every device gets a slice of every batch
    (1, 2, 4, 8 for 8 on one device; 1, 2, 4, 6 for 6; 4, 8 for 8 on four; 4, 8 for 6 on four)."""
    if max_batch_size < 1 or devices < 1:
        raise ValueError("max_batch_size and devices must be >= 1")
    out, b = [], devices
    while b < max_batch_size:
        out.append(b)
        b *= 2
    out.append(-(-max_batch_size // devices) * devices)
    return tuple(out)


def bucket_for(buckets: tuple[int, ...], n: int) -> int:
    """The compiled batch a server pads ``n`` images to: the smallest bucket that holds them."""
    for b in buckets:
        if b >= n:
            return b
    raise InvalidArgumentError(f"{n} images exceed the largest batch bucket {buckets[-1]} (max_batch_size): a server "
                               "never runs them as one batch", argument="n")


class ServedCall(NamedTuple):
    """How a server (or ``preheat warm``) built from one ``WarmSet`` runs ``n`` images: what
    ``cache explain --as-server`` keys, so that a served entry is a hit, not the "nearest"."""
    bucket: int  # the batch the call is padded to (``bucket_for``)
    inputs: dict[str, Any]  # ``generate``/``prepare`` keywords beyond the request's own (the step reports)


def served_call(pipe: Any, warm_set: "WarmSet", n: int) -> ServedCall:
    """The server's call for ``n`` images of ``pipe``: padded to its bucket, with the step reports
    its programs carry when ``warm_set.progress`` (a static switch: another program without them)."""
    return ServedCall(bucket_for(buckets_for(warm_set.max_batch_size, pipe.device_count), n),
                      progress_inputs(pipe, warm_set.progress))


def progress_inputs(pipe: Any, progress: bool) -> dict[str, Any]:
    """The keyword that selects the program reporting each step, as a server streams them
    (``preheat.server.batching.Batcher.run``); none where the switch is off or the pipeline cannot report."""
    if not (progress and pipe.reports_progress):
        return {}
    from preheat.progress import ignore

    return {"progress": ignore}


# the second model folders ``preheat.load`` takes beside the model (``load_options.COMPANION_MODELS``): every
# surface's settings carry them under these names
COMPANIONS = ("controlnet", "refiner")


def companions(settings: Any) -> dict[str, str]:
    """The second model folders ``settings`` (a WarmSet, a server's CoreConfig, a CLI call's options)
    names, as ``preheat.load`` keywords: only those given."""
    return {name: getattr(settings, name) for name in COMPANIONS if getattr(settings, name) is not None}


def load_keywords(declared: Any) -> dict[str, Any]:
    """The ``preheat.load`` keywords (beside the model and ``prefetch``) of a declaration (a WarmSet,
    a server's CoreConfig): what a warm job and a server load alike, so that their programs agree."""
    return dict(dtype=declared.dtype, variant=declared.variant, cache=declared.cache, devices=declared.devices,
                fsdp=declared.fsdp, weights_dtype=declared.weights_dtype, weights_layers=declared.weights_layers,
                encoders_on=declared.encoders_on, **({} if declared.config is None else {"config": declared.config}),
                **companions(declared))


@dataclass(frozen=True)
class WarmSet:
    """The declared set: model, dtype, batch buckets (from ``max_batch_size``), samplers (() =
    the model's default), sizes (text-to-image; () = the model's default), guidance modes and
    devices (``preheat.load(devices=..., fsdp=...)``: a program is compiled for its devices and
    weight placement, so a warm job and a server must use the same ones; None = load's default)."""

    model: Optional[str] = None  # a diffusers folder or store source; None = the built-in model
    dtype: str = "float32"
    max_batch_size: int = 8
    samplers: tuple[str, ...] = ()
    sizes: tuple[tuple[int, int], ...] = ()
    guidance: tuple[str, ...] = GUIDANCE_MODES  # "off" and/or "on" ("on" only where the model can guide)
    devices: Any = None  # "all", a count or device ids; None = preheat.load's default ($PREHEAT_DEVICES or all)
    fsdp: int = 1  # the devices each weight is split over (preheat.load(fsdp=...)): part of every program
    lora_ranks: tuple[int, ...] = ()  # LoRA rank buckets (``preheat.lora.BUCKETS``) warmed besides no LoRA
    # the served values of static inputs other than the size (``families.offer.static_inputs``: a T5
    # prompt's max_sequence_length), each value its own programs, the first what a request without it
    # gets: ((name, values), ...); () = each one's default only. Text values (``--input-values``) are
    # typed by the family's declaration at ``resolve``.
    input_values: tuple[tuple[str, tuple[Any, ...]], ...] = ()
    # the optional data inputs offered (``families.offer.optional_inputs``: a negative prompt, an
    # image, a mask): each is its own programs, so a text-only server offers () and warms none of
    # theirs; None = every one the family offers by default (``families.offer.default_offered``: all but
    # FLUX.1's negative prompt). Required inputs (the prompt) are always offered.
    inputs: Optional[tuple[str, ...]] = None
    variant: Optional[str] = None  # weight files *.VARIANT.safetensors (preheat.load(variant=...))
    cache: Optional[str] = None  # compile cache layers: "full" (None), "xla" or "off" (preheat.load(cache=...))
    weights_dtype: Optional[str] = None  # the denoiser's weights stored in this dtype (preheat.load(weights_dtype=...))
    weights_layers: str = "layerwise"  # which layers weights_dtype stores (preheat.load(weights_layers=...))
    encoders_on: str = "device"  # FLUX.1's text encoders on the host's CPU: "host" (preheat.load(encoders_on=...))
    config: Optional[str] = None  # ``model`` a single file: the folder whose configs read it (preheat.load(config=...))
    controlnet: Optional[str] = None  # a ControlNetModel folder beside the UNet (preheat.load(controlnet=...))
    refiner: Optional[str] = None  # an SDXL refiner folder that takes over part-way (preheat.load(refiner=...))
    # the loop reports each step to the host (a server's step events; ``preheat.progress``): a static
    # switch, so a server and its warm job must agree. A deviceless GPU compile cannot hold the host
    # callback (lowering it needs the GPU's runtime), so ``warm --target`` declares it off.
    progress: bool = True

    def __post_init__(self) -> None:
        # that each is one of preheat.lora.BUCKETS is checked by the surfaces (check_lora_ranks)
        object.__setattr__(self, "lora_ranks", tuple(sorted(set(self.lora_ranks))))  # smallest first (bucket_for)
        if self.inputs is not None:  # the names are checked against the family in resolve()
            object.__setattr__(self, "inputs", tuple(dict.fromkeys(self.inputs)))
        # the text form, a mapping (Python, Ray's typed args) or pairs; values in order, each once
        pairs = parse_input_values(self.input_values) if isinstance(self.input_values, str) else \
            self.input_values.items() if isinstance(self.input_values, dict) else self.input_values
        object.__setattr__(self, "input_values", tuple((str(name), tuple(dict.fromkeys(values)))
                                                       for name, values in pairs))
        bad = [g for g in self.guidance if g not in GUIDANCE_MODES]
        if bad or not self.guidance:
            raise InvalidArgumentError(f"guidance {bad or '()'} must be among {', '.join(GUIDANCE_MODES)}")
        if self.max_batch_size < 1:
            raise InvalidArgumentError(f"max_batch_size {self.max_batch_size} must be >= 1")

    @property
    def buckets(self) -> tuple[int, ...]:
        return buckets_for(self.max_batch_size)


@dataclass(frozen=True)
class WarmSignature:
    sampler: str
    guidance: float  # the guidance keyword its call passes (1.0: off, where the scale is CFG's)
    guided: bool  # its programs run classifier-free guidance (a CFG scale > 1; FLUX.1's true CFG)
    bucket: int
    size: Optional[tuple[int, int]]  # (width, height); None where the model makes one size only
    given: tuple[tuple[str, Any], ...] = ()  # the data inputs of this variant (``InputSpec.warm``)
    lora: Optional[int] = None  # the LoRA rank bucket; None: no LoRA
    variant: tuple[str, ...] = ()  # the inputs this variant gives beyond the base one (for describe)
    progress: bool = True  # the program reports each step (``WarmSet.progress``)

    def describe(self) -> str:
        size = f" {self.size[0]}x{self.size[1]}" if self.size else ""
        extra = "".join(f" +{name}" for name in self.variant)
        lora = f" LoRA rank {self.lora}" if self.lora else ""
        return (f"{self.sampler} batch {self.bucket}{size}{extra}{lora} "
                f"guidance {self.guidance if self.guided else 'off'}")


def _specs(pipe: Any) -> tuple[Any, ...]:
    return tuple(pipe.family.input_specs(pipe))


def _sized(pipe: Any) -> bool:
    """Whether the model serves more than its native size (width and height are then static choices)."""
    multiple, high, fixed = pipe.family.size_rule(pipe)
    return not fixed


class SettingNames(NamedTuple):
    """How the user named each setting that a set-up message names, so that the message says
    what they wrote: the command line's options by default (``preheat warm`` / ``serve``, whose
    server also answers Cog's routes); Runpod's worker reads ``PREHEAT_INPUTS`` (``by(env_var)``),
    a Ray deployment its ``serve run`` args or the environment, whichever it was given."""

    inputs: str = "--inputs"
    sizes: str = "--sizes"
    max_steps: str = "--max-steps"
    # a server's limits (``preheat.server.config.CoreConfig.check``)
    max_batch_size: str = "--max-batch-size"
    batch_wait_ms: str = "--batch-wait-ms"
    max_queue: str = "--max-queue"
    max_loras: str = "--max-loras"
    max_image_pixels: str = "--max-image-pixels"
    lora_dir: str = "--lora-dir"
    input_values: str = "--input-values"  # the declaration's, with inputs and sizes (last: positions kept)
    samplers: str = "--samplers"  # `cache explain --as-server`'s refusal of a sampler the server does not serve

    @classmethod
    def by(cls, name_of: Callable[[str], str]) -> "SettingNames":
        """Every setting named ``name_of(setting)`` (``preheat.server.config.env_var``: ``PREHEAT_SIZES``)."""
        return cls(*(name_of(setting) for setting in cls._fields))


def resolve(pipe: Any, warm_set: WarmSet, names: SettingNames = SettingNames()) -> WarmSet:
    """The set with the model's defaults filled in (samplers, sizes, the offered inputs); an
    unusable size, or an input the family does not declare, fails here, in one line, before
    anything compiles. The line names the setting as the user gave it (``names``: the command
    line's ``--inputs`` unless the surface read it elsewhere, as Runpod's ``PREHEAT_INPUTS``)."""
    from preheat.families.offer import check_input_values, check_offered

    inputs = check_offered(pipe.family.name, _specs(pipe), warm_set.inputs, names.inputs)
    input_values = check_input_values(pipe.family.name, _specs(pipe), warm_set.input_values, names.input_values)

    samplers = tuple(warm_set.samplers) or (pipe.defaults["sampler"],)
    sizes = tuple(warm_set.sizes)
    if _sized(pipe) and not sizes:
        from preheat.model_source import random_defaults

        tiny = random_defaults(warm_set.model)[0]  # a tiny random:NAME model: its tiny size, not its family's
        sizes = (tiny,) if tiny is not None else pipe.family.served_sizes(pipe)  # else the family's buckets
    placeholder = tuple(sorted(pipe.family.warm_inputs(pipe, guided=False)[0].items()))
    for size in sizes:  # a size the model cannot make fails here (a pixel model's too), never silently
        try:
            pipe.check(1, **_size_inputs(size), steps=1, **given_inputs(pipe, placeholder, size))
        except InvalidArgumentError as err:
            raise InvalidArgumentError(f"{names.sizes} {size[0]}x{size[1]}: {err}",
                                       argument="sizes") from None
    if warm_set.lora_ranks and pipe.lora_runtime is None:
        raise InvalidArgumentError(f"LoRA rank buckets {', '.join(map(str, warm_set.lora_ranks))} are declared, "
                                   f"but LoRAs are not supported for a {pipe.family.name} model")
    return replace(warm_set, samplers=samplers, sizes=sizes, inputs=inputs, input_values=input_values)


def signatures(pipe: Any, warm_set: WarmSet) -> list[WarmSignature]:
    """Every program of a resolved set (see the module docstring for the product): the input
    variants only of the offered inputs (``WarmSet.inputs``)."""
    from preheat.families.offer import offered_specs

    sizes: tuple[Optional[tuple[int, int]], ...] = warm_set.sizes if _sized(pipe) else (None,)
    buckets = buckets_for(warm_set.max_batch_size, pipe.device_count)  # every device gets a slice
    base = pipe.family.warm_inputs(pipe, guided=False)[0]
    offered = {s.name for s in offered_specs(_specs(pipe), warm_set.inputs)}
    out = []
    modes = _guidance_modes(pipe, warm_set)
    variants = {guided: [v for v in pipe.family.warm_inputs(pipe, guided=guided) if _runs(pipe, g, v, guided)]
                for g, guided in modes}
    for sampler in warm_set.samplers:
        for g, guided in modes:
            for size in sizes:
                for variant, statics in itertools.product(variants[guided], _static_choices(warm_set)):
                    given = tuple(sorted({**variant, **statics}.items()))
                    if not offered.issuperset(variant) or not _served(pipe, sampler, g, size, given):
                        continue
                    beyond = tuple(k for k, v in given if k in variant and (k not in base or base[k] != v)) + \
                        tuple(f"{k}={v}" for k, v in statics.items())
                    for bucket in buckets:  # LoRA buckets smallest first: each is then compiled as itself
                        out += [WarmSignature(sampler, g, guided, bucket, size, given, lora, beyond,
                                              warm_set.progress)
                                for lora in (None, *warm_set.lora_ranks)]
    return out


def _static_choices(warm_set: WarmSet) -> list[dict[str, Any]]:
    """Every combination of a resolved set's served static values (``WarmSet.input_values``), as
    ``generate`` keywords: [{}] where it declares none (each static input at its default)."""
    names = [name for name, _ in warm_set.input_values]
    return [dict(zip(names, values)) for values in itertools.product(*(v for _, v in warm_set.input_values))]


class OfferedInputs(NamedTuple):
    """What a resolved set's server takes, by keyword (``warm --dry-run`` prints it)."""
    required: tuple[str, ...]  # always offered (a prompt)
    optional: tuple[str, ...]  # the offered ones (``WarmSet.inputs``)
    not_offered: tuple[str, ...]  # declared by the family, refused by a server of this set


def offered_inputs(pipe: Any, warm_set: WarmSet) -> OfferedInputs:
    """The inputs a server of a resolved set takes and refuses."""
    from preheat.families.offer import default_offered, optional_inputs, required_inputs

    specs = _specs(pipe)
    optional = optional_inputs(specs)
    offered = default_offered(specs) if warm_set.inputs is None else warm_set.inputs
    return OfferedInputs(required_inputs(specs), tuple(n for n in optional if n in offered),
                         tuple(n for n in optional if n not in offered))


def _guidance_modes(pipe: Any, warm_set: WarmSet) -> list[tuple[float, bool]]:
    """(the guidance keyword, whether its programs run classifier-free guidance) per mode of the
    set: "off" is 1.0; "on" is the model's default scale where that guides, else 2.0 -- and for a
    model whose guidance is not CFG (FLUX.1's embedded scale, or none), its default: its guided
    variants are those whose inputs turn CFG on (a negative prompt and ``true_cfg_scale``)."""
    modes = [(1.0, False)] if "off" in warm_set.guidance else []
    if "on" in warm_set.guidance:
        default = pipe.defaults.get("guidance")
        try:
            on = float(default) if default is not None and pipe.is_guided(default) else 2.0
            if not pipe.is_guided(on):
                on = 1.0 if default is None else float(default)
        except InvalidArgumentError:  # a scale this model refuses (no guidance input): its own default
            on = 1.0 if default is None else float(default)
        modes.append((on, True))
    return modes


def _runs(pipe: Any, guidance: float, variant: dict[str, Any], guided: bool) -> bool:
    """Whether a warm variant's call runs the mode it is warmed for (an unguided model's variant
    without the inputs that guide it is the "off" program, not an "on" one); a variant the model
    refuses (guided calls of a class model without a null class) runs none."""
    try:
        return pipe.is_guided(guidance, **variant) == guided
    except InvalidArgumentError:
        return False


def _served(pipe: Any, sampler: str, guidance: float, size: Optional[tuple[int, int]],
            given: tuple[tuple[str, Any], ...]) -> bool:
    """Whether the model takes this variant with this sampler (an image variant it refuses for a
    sampler -- a mask it cannot blend -- is refused at parse time too, so there is nothing to warm)."""
    if not any(name in _image_inputs(pipe) for name, _ in given):
        return True  # text-to-image variants: resolve() has checked them
    sized = {} if size is None else _size_inputs(size)
    try:
        pipe.check(1, sampler=sampler, guidance=guidance, steps=1, **sized, **given_inputs(pipe, given, size))
    except InvalidArgumentError:
        return False
    return True


def _size_inputs(size: tuple[int, int]) -> dict[str, int]:
    """A served (width, height) as ``generate`` keywords (``families.inputs.IMAGE_SIZE``)."""
    from preheat.families.inputs import IMAGE_SIZE

    return IMAGE_SIZE.inputs(size)


def _image_inputs(pipe: Any) -> set[str]:
    from preheat.families.inputs import Image

    return {s.name for s in _specs(pipe) if isinstance(s.type, Image)}


def given_inputs(pipe: Any, given: tuple[tuple[str, Any], ...], size: Optional[tuple[int, int]],
                 n: Optional[int] = None) -> dict[str, Any]:
    """A variant's data inputs as ``generate`` keywords: an image input (``WARM_IMAGE``) a
    placeholder of ``size`` (the model's own when None), a per-image one repeated ``n`` times."""
    from preheat.families.inputs import Image

    specs = {s.name: s for s in _specs(pipe)}
    width, height = size if size is not None else pipe.family.native_size(pipe)
    out = {}
    for name, value in given:
        kind = specs[name].type
        if isinstance(kind, Image):  # its content is data; its size selects the program
            value = kind.placeholder(width, height)
        out[name] = [value] * n if n is not None and specs[name].per_image else value
    return out


def call_inputs(pipe: Any, sig: WarmSignature) -> dict[str, Any]:
    """``Pipeline.generate`` keywords for one signature (steps=1: the serving program, run cheaply).
    An image input is a placeholder image of the signature's size: each served size is then also
    an image size the VAE encoder is compiled for."""
    n = sig.bucket
    inputs: dict[str, Any] = {"steps": 1, "sampler": sig.sampler, "guidance": sig.guidance, "seed": list(range(n)),
                              **given_inputs(pipe, sig.given, sig.size, n)}
    if sig.size is not None:
        inputs.update(_size_inputs(sig.size))
    inputs.update(progress_inputs(pipe, sig.progress))  # a server streams every step
    if sig.lora:  # per image, as a server's batches give it (the same slot count); one zeros LoRA per rank
        inputs["lora"] = [[(pipe.lora_runtime.warm_zeros(sig.lora), 1.0)]] * n
    return inputs


def run_signature(pipe: Any, sig: WarmSignature) -> None:
    """Compile (or load) and run one signature; ``pipe.last`` says which cache layer served it (a
    compiler whose executables are for another machine: ``preheat.cache.compile.compile_described``)."""
    pipe.generate(sig.bucket, **call_inputs(pipe, sig))


def status(pipe: Any, sig: WarmSignature, remote: Any = None) -> dict[str, Any]:
    """The denoising program's cache key and whether it is cached locally and (with a store)
    remotely, without compiling or running anything (``Pipeline.describe``)."""
    denoise = next(s for s in pipe.describe(sig.bucket, **call_inputs(pipe, sig)) if s.name == "denoise")
    out = _program(pipe, denoise, remote)
    del out["stage"]
    return out


def _program(pipe: Any, stage: Any, remote: Any) -> dict[str, Any]:
    """One described stage's ``{"stage", "key", "local", "remote"}``: its key as the pipeline's
    compiler makes it (a ``--target`` compiler keys it for its GPU), whether an entry of it is in
    the local cache, and in the store (None without one). A stage a ``--target`` compiler leaves to
    the machine that runs it: key, local and remote None, and ``skipped`` saying why."""
    from preheat.cache.compile import HOST_STAGE, left_to_target
    from preheat.cache.keys import key_fields, key_of

    if left_to_target(pipe.compiler, stage):
        return {"stage": stage.name, "key": None, "local": None, "remote": None, "skipped": HOST_STAGE}
    fields_for = pipe.compiler.fields_for if pipe.compiler is not None else key_fields
    key = key_of(fields_for(stage.fingerprint, stage.sig, stage.args))
    local = pipe.compiler is not None and (pipe.compiler.kind_dir / key / "manifest.json").is_file()
    return {"stage": stage.name, "key": key, "local": bool(local),
            "remote": None if remote is None else remote.has("jax", key)}


def programs(pipe: Any, sig: WarmSignature, remote: Any = None) -> list[dict[str, Any]]:
    """Every compiled program one signature's call runs -- a text family's encoders, its denoising
    loop and its VAE decoder; a pixel family's loop -- as ``{"stage", "key", "local", "remote"}``
    (``remote`` None without a store), in the order they run. Nothing is compiled or run on the
    device: the call is described (``Pipeline.describe``)."""
    return [_program(pipe, stage, remote) for stage in pipe.describe(sig.bucket, **call_inputs(pipe, sig))]


def prefetch_calls(warm_set: WarmSet) -> Callable[[Any], list[dict[str, Any]]]:
    """``preheat.load(prefetch=...)`` for a declaration: given the pipeline being loaded (its
    weights still placeholders), the ``generate`` keywords of every signature but the LoRA ones
    (adapters are read per call), so that a server's warm-up finds its executables loaded."""
    def calls(pipe: Any) -> list[dict[str, Any]]:
        return [{"n": sig.bucket, **call_inputs(pipe, sig)} for sig in signatures(pipe, resolve(pipe, warm_set))
                if sig.lora is None]

    return calls


def warm(warm_set: WarmSet, pipe: Any, log: Callable[[str], None] = lambda line: None,
         push_timeout_s: float = 600.0, done: Callable[[int, int], None] = lambda k, total: None,
         names: SettingNames = SettingNames()) -> dict[str, Any]:
    """Compile every signature of ``warm_set`` with ``pipe`` (``preheat.load(warm_set.model,
    dtype=warm_set.dtype)``) into its cache root, and upload every local entry the store lacks
    when it has one (``PREHEAT_CACHE_URL``). Returns ``{"signatures": [{"signature",
    "cache_layer", "seconds", "remote"}], "pushed": bool}``; with a store, ``remote`` says whether
    it holds the signature's denoising program afterwards (None: it could not be asked or is not
    trusted), and ``pushed`` is False unless it holds every one. With ``--target``'s compiler the
    programs compile at once (``preheat.cache.compile.compile_described``): a signature's ``seconds``
    count from the start of the compiles to its programs' readiness, and ``skipped`` names a host
    stage left to the target machine. ``done(k, total)``: called as
    each signature is ready (``preheat warm``'s progress bar); ``names``: how the user gave the
    settings an unusable one's message names (``resolve``)."""
    import functools
    import time

    from preheat.cache.compile import HOST_STAGE, compile_described
    from preheat.timings import coldest

    resolved = resolve(pipe, warm_set, names)
    rows = []
    sigs = signatures(pipe, resolved)
    compiler = pipe.compiler
    if compiler is not None and hasattr(compiler, "retune"):  # on a GPU: entries compiled without one get autotuned
        compiler.retune = True
    done(0, len(sigs))

    def row(sig: WarmSignature, layer: str, seconds: float, events: list[dict[str, Any]]) -> None:
        rows.append({"signature": sig.describe(), "cache_layer": layer, "seconds": seconds})
        tuned = [e["retune"] for e in events if "retune" in e]
        if tuned:
            rows[-1]["retune"] = tuned
        unrunnable = [f"{e.get('stage', 'denoise')}: {e['unrunnable']}" for e in events if "unrunnable" in e]
        if unrunnable:  # warm --target: entries a GPU will not run (cache.entries.UNRUNNABLE)
            rows[-1]["unrunnable"] = unrunnable
        skipped = [e["stage"] for e in events if "skipped" in e]
        if skipped:  # warm --target: a host stage, compiled on the machine that runs it
            rows[-1]["skipped"] = {stage: HOST_STAGE for stage in skipped}
        log(f"{sig.describe()}: {seconds:.2f}s (cache: {layer}){_retune_note(tuned)}"
            + (f"; will not run on the GPU ({'; '.join(unrunnable)})" if unrunnable else "")
            + (f"; not compiled here: {', '.join(skipped)} {HOST_STAGE}" if skipped else ""))
        done(len(rows), len(sigs))

    if compiler is not None and not compiler.runs:  # --target: every signature's programs at once
        def ready(i: int, events: list[dict[str, Any]]) -> None:
            layer = functools.reduce(coldest, [e["layer"] for e in events if "layer" in e], "memory")
            row(sigs[i], layer, time.perf_counter() - t0, events)

        t0 = time.perf_counter()
        compile_described(compiler, (pipe.describe(sig.bucket, **call_inputs(pipe, sig)) for sig in sigs),
                          pipe.program, each=ready)  # described as the first ones compile
    else:
        for sig in sigs:
            t0 = time.perf_counter()
            seen = len(compiler.events) if compiler is not None else 0
            run_signature(pipe, sig)
            row(sig, pipe.last.cache_layer, time.perf_counter() - t0,
                compiler.events[seen:] if compiler is not None else [])
    pushed = True
    if compiler is not None and compiler.remote is not None:
        compiler.push_missing()  # entries compiled earlier, that the store lacks
        pushed = compiler.wait_pushes(push_timeout_s)
        for sig, row in zip(sigs, rows):  # what the fleet will find: the store's word, not ours
            row["remote"] = status(pipe, sig, compiler.remote)["remote"]
        pushed = pushed and all(row["remote"] for row in rows)
    return {"signatures": rows, "pushed": pushed}


def _retune_note(tuned: list[Any]) -> str:
    """``preheat warm``'s words for what retuning did to a signature's programs (``preheat.cache.retune``)."""
    parts = []
    for t in tuned:
        if isinstance(t, dict):
            verb = "replaced by the autotuned compile" if t["replaced"] else "kept (the autotuned compile is not faster)"
            parts.append(f"{verb}: {1e3 * t['deviceless_s']:.3g} -> {1e3 * t['autotuned_s']:.3g} ms")
        else:
            parts.append(str(t))
    return "".join(f"; {p}" for p in parts)
