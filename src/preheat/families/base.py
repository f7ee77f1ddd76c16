"""What a model family tells the engine: its inputs, its conditioning, its sample shape, its decoding.

The engine (``preheat.engine``) knows one thing about models: a denoiser
``apply(params, x, t, cond, lora) -> prediction`` whose conditioning ``cond`` is a pytree batched on
axis 0 and ``lora`` the batch's adapters (``preheat.models.adapters.Adapters``) or None. The stages'
arguments are named (``preheat.families.stages``). Everything else -- which request inputs a family takes, how they become ``cond`` (a
class label, text embeddings, SDXL's size ids), what the unconditional branch of classifier-free
guidance is (a null class, an empty or negative prompt: always runtime data), the latent shape
for a width x height, and how a final sample becomes pixels -- is the family's.

    Family                 conditioning (cond / uncond)              decode
    ---------------------  ----------------------------------------  -------------------------
    pixel (UNet2DModel)    {"class_labels": (B,)} / null class       in the loop: x -> uint8
    stable-diffusion       {"context": (B, 77, D)} / "" or negative  VAE stage -> uint8
    stable-diffusion-xl    + "text_embeds" (B, P), "time_ids" (B, 6) VAE stage (fp32) -> uint8
      (-refiner)             (the second encoder alone; ids (B, 5))
    stable-diffusion-3     {"context": (B, 77+256, D), "pooled"}     VAE stage -> uint8
    flux                   {"context": (B, 512, D), "pooled"         VAE stage -> uint8
                            [, "guidance": (B,)]} / none (no CFG)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol

import numpy as np

from preheat.errors import InvalidArgumentError
from preheat.families.components import Components, PixelComponents
from preheat.families.inputs import IMAGE_SIZE, InputSpec, check_int, check_needs, size_specs, unknown_input
from preheat.families.offer import warm_variants
from preheat.families.stages import Stage, Staged
from preheat.samplers import DIFFUSION_SAMPLERS
from preheat.timings import Timings

__all__ = ["Family", "Conditioning", "Request", "StageSignature", "LoadedModel", "EngineView", "check_int",
           "to_pixels"]

Cond = dict[str, Any]


@dataclass(frozen=True)
class Request:
    """A validated call, host-side: what the engine turns into programs and arguments."""

    n: int
    sampler: str
    steps: int
    guided: bool
    guidance: float
    seeds: np.ndarray  # (n,) uint32
    noise: np.ndarray | None  # (n, H, W, C) float32, NHWC
    eta: float
    sample_shape: tuple[int, ...]
    values: dict[str, Any]  # the family's own inputs, normalised (labels, prompts, size, ...)
    lora: Any = None  # preheat.lora.LoraRequest: the call's adapters, per image (None: no LoRA)
    cfg_scale: float = 1.0  # classifier-free guidance's combination scale when ``guided``: ``guidance``, or an
    #                         embedded-guidance model's own (FLUX.1's true_cfg_scale; ``families.request.guidance``)


@dataclass(frozen=True)
class StageSignature:
    """What selects one compiled encode/decode program: its stage, batch and shapes."""

    stage: str
    batch: int
    shape: tuple[int, ...]
    dtype: str
    extra: tuple[tuple[str, Any], ...] = ()


class EngineView(Protocol):
    """What a family sees of the engine's pipeline (families never import the engine)."""

    sample_shape: tuple[int, ...]
    scheduler_config: Any
    dtype: str
    components: Components  # the family's typed parts (preheat.families.components)
    lora_runtime: Any  # preheat.lora.LoraRuntime; None when the model takes no LoRA
    num_classes: int | None
    null_class: int | None
    labels: tuple[str, ...]
    last: Timings


@dataclass
class LoadedModel:
    """What a family's loader returns: everything ``preheat.engine.Pipeline`` is built from."""

    apply: Callable[..., Any]  # apply(params, x, t, cond, lora=None) -> prediction, NHWC
    params: Any
    sample_shape: tuple[int, ...]  # (H, W, C) of one sample at the default size (latent for VAE families)
    scheduler_config: Any
    fingerprint: dict[str, Any]  # the denoiser's identity for the compile cache (never the weights)
    family: "Family"
    num_classes: int | None = None
    null_class: int | None = None
    labels: tuple[str, ...] = ()
    defaults: dict[str, Any] = field(default_factory=dict)
    dtype: str = "float32"
    layout: str = "NCHW"
    components: Components = field(default_factory=PixelComponents)  # the family's own (preheat.families.components)


def to_pixels(x: Any) -> Any:
    """[-1, 1] floats -> uint8, exactly as diffusers' pipelines round."""
    import jax.numpy as jnp

    return jnp.round(jnp.clip(x / 2 + 0.5, 0.0, 1.0) * 255).astype(jnp.uint8)


@dataclass
class Conditioning:
    """The denoiser's conditioning for one call: ``cond`` and ``uncond`` share one structure."""

    cond: Cond
    uncond: Cond


@dataclass(frozen=True)
class Family:
    """Base of every family. Subclasses override the hooks below; the engine calls nothing else.
    The hooks are pure: they describe the stages a call needs (``families.stages.Stage``), never
    run one; the engine runs them, encode -> [encode_image] -> denoise -> decode.

    ``defaults``: the one place a family's sampler, step count and guidance default live (a
    model folder's ``model_index.json`` may override them for itself).
    ``specs``: the family's own inputs of ``Pipeline.generate``, declared once
    (``preheat.families.inputs``); width and height come from :meth:`native_size` and
    :meth:`size_rule`. The common ones (n / steps / sampler / ...) are ``COMMON_SPECS``.
    ``positional``: the input a string first argument fills (``pipe("a fox")``), if any.
    ``loader_takes``: what this family's loader accepts beyond the common keywords (offloading, the
    second model folders of ``preheat.load``), declared so that a misfit is refused in one line before
    any weight is read (``preheat.load_options``).
    """

    name: str = "family"
    defaults: Mapping[str, Any] = field(default_factory=lambda: {"sampler": "ddpm", "steps": 50, "guidance": None})
    specs: tuple[InputSpec, ...] = ()
    positional: str | None = None
    preview_n: int = 16  # how many images ``preheat sample`` makes when not told (a grid of classes)
    pixels_in_loop: bool = True  # the denoising program ends with the conversion to uint8
    samplers: tuple[str, ...] = DIFFUSION_SAMPLERS  # the samplers this family's models were trained for
    loader_takes: frozenset[str] = frozenset()  # of "offload_encoders", "encoders_on", "controlnet", "refiner"

    @property
    def inputs(self) -> tuple[str, ...]:
        """The family's own keywords (its specs' names, then width and height)."""
        return (*(s.name for s in self.specs), *IMAGE_SIZE)

    def for_folder(self, root: Path) -> "Family":
        """The family a folder of this class is, as its configs say (no weight read): what a process
        that only passes the folder on (a bench's parent) types flags by. Most classes have one."""
        return self

    def folder_specs(self, root: Path) -> tuple[InputSpec, ...]:
        """The folder's own inputs as its configs declare them (no weight read): ``specs`` with what
        :meth:`input_specs` resolves from the loaded model and can tell from configs (a required image)."""
        return self.specs

    def native_size(self, pipe: "EngineView") -> tuple[int, int]:
        """The model's own (width, height) in pixels: what a call without a size makes."""
        return pipe.sample_shape[1], pipe.sample_shape[0]

    def served_sizes(self, pipe: "EngineView") -> tuple[tuple[int, int], ...]:
        """The (width, height) buckets a server and warm-up offer when not told: the native size
        (FLUX.1 Kontext: its preferred resolutions)."""
        return (self.native_size(pipe),)

    def size_rule(self, pipe: "EngineView") -> tuple[int, int, bool]:
        """(multiple, largest side, native size only?) for width and height."""
        return 1, 0, True

    def input_specs(self, pipe: "EngineView") -> tuple[InputSpec, ...]:
        """The specs with what depends on the loaded model resolved (sizes, class names)."""
        multiple, high, fixed = self.size_rule(pipe)
        return (*self.specs, *size_specs(*self.native_size(pipe), multiple, high, fixed=fixed))

    def warm_inputs(self, pipe: "EngineView", guided: bool) -> list[dict[str, Any]]:
        """The data inputs of each program variant warm-up compiles (``InputSpec.warm``); the
        first is what any call needs (a placeholder prompt: the words are data)."""
        return warm_variants(self.input_specs(pipe), guided)

    def check_inputs(self, pipe: "EngineView", n: int, inputs: dict[str, Any]) -> dict[str, Any]:
        """Validate the family's own inputs (host-side, no device work) into normalised values:
        each spec's check, in declaration order, then their relations (``InputSpec.needs``: a
        mask needs its image, of its size); subclasses derive what follows from them."""
        specs = self.input_specs(pipe)
        unknown_input(self.name, specs, inputs)
        values = {s.name: s.check(inputs.get(s.name), n) for s in specs}
        check_needs(specs, inputs, values)
        return values

    def sample_shape(self, pipe: "EngineView", values: dict[str, Any]) -> tuple[int, ...]:
        """One sample's shape (H, W, C), NHWC, for these inputs (resolution is static)."""
        return pipe.sample_shape

    def guidance_mode(self, pipe: "EngineView") -> str:
        """How the guidance scale reaches the model.

        "cfg": classifier-free guidance (two branches, ``uncond + g * (cond - uncond)``);
        "embedded": the scale is conditioning data the model was distilled on (FLUX.1-dev), one
        branch, and the family puts it in ``cond``; "none": the model takes no guidance (FLUX.1-schnell).
        """
        return "cfg"

    def plan_options(self, pipe: "EngineView", request: "Request") -> dict[str, Any]:
        """Extra host-side schedule inputs for ``make_plan`` (flow models: ``mu`` from the image's
        token count, the pipeline's own ``sigmas``); resolution is static, so these are too."""
        return {}

    def true_cfg(self, values: dict[str, Any]) -> float | None:
        """The scale of classifier-free guidance a model whose guidance is not CFG ("embedded" or
        "none") runs on this call anyway (FLUX.1's ``true_cfg_scale`` against a negative prompt:
        ``families.guidance``), or None: one branch. A "cfg" family's guidance is its scale."""
        return None

    def guidance_error(self, pipe: "EngineView", values: dict[str, Any]) -> str | None:
        """Why this model cannot run classifier-free guidance (None: it can)."""
        return None

    def check_unguided(self, pipe: "EngineView", values: dict[str, Any]) -> None:
        """Inputs that make sense only with guidance (``needs_guidance``: a negative prompt) are refused
        here; a value equal to the input's declared default (guidance_rescale's 0: off) asks nothing of it."""
        for spec in self.specs:
            if spec.needs_guidance and values.get(spec.name) is not None and values[spec.name] != spec.default:
                raise InvalidArgumentError(f"{spec.name} needs classifier-free guidance; {self.guidance_hint()}",
                                           argument=spec.name)

    def guidance_hint(self) -> str:
        """What turns classifier-free guidance on (a refusal of an input that needs it says so)."""
        return "use a guidance scale other than 1"

    def check_start(self, pipe: "EngineView", request: "Request") -> int | None:
        """Host-side check of where an image-conditioned call starts (its start step; None: from
        noise): what ``check`` runs so that a server refuses a strength that runs no step up front."""
        return None

    def image_start(self, pipe: "EngineView", request: "Request", plan: Any) -> Staged:
        """Where an image-conditioned call begins, staged (``preheat.samplers.Start``: the start
        step of ``plan``, the encoded image -- an encode_image stage --, the mask to blend), or None:
        the loop starts from noise. Families that take an ``image`` override it."""
        return Staged.ready(None)

    def restart_step(self, pipe: "EngineView", request: "Request") -> int | None:
        """The step from which the solver starts afresh, its sample kept (``samplers.denoise_loop``'s
        ``restart``: a second expert going on as diffusers' second pipeline would), or None."""
        return None

    def condition(self, pipe: "EngineView", request: "Request") -> Staged:
        """The denoiser's ``cond``/``uncond`` pytrees for a validated request, staged: the stages
        they need (a text family's encode) and how their outputs make a ``Conditioning``."""
        raise NotImplementedError

    def decode(self, pipe: "EngineView", request: "Request", latents: Any) -> Stage | None:
        """The stage that turns the denoising program's output into pixels (a VAE's decode), or
        None: the output goes to :meth:`finish` as it is."""
        return None

    def finish(self, pipe: "EngineView", request: "Request", out: Any) -> np.ndarray:
        """Host-side, last: the decoded (or denoised) output -> uint8 pixels (n, H, W, C)."""
        return np.asarray(out)
