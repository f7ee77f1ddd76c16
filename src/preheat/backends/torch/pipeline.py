"""``TorchPipeline``: the JAX ``Pipeline``'s call API on diffusers' own UNet2DModel and schedulers
(text-to-image folders go to ``TorchTextPipeline``, ``preheat.backends.torch.text``).

    pipe = preheat.load(model, backend="torch", compile="none" | "inductor" | "aot")
    pixels = pipe.generate(8, sampler="ddim", steps=20, seed=0)      # uint8 (n, H, W, C)
    images = pipe(8)                                                 # list[PIL.Image]
    pipe.last                                                        # Timings of the last call

Arguments are validated by the same backend-neutral functions as the JAX ``Pipeline``'s
(``preheat.families.request``, through ``backends.torch.arguments``), so both backends take the
same arguments and raise the same one-line errors; defaults (sampler, steps, guidance, null class, labels) come from the same
``model_index.json``.

Same seeds, same noise: seeds are per image, and unless ``noise`` is given the initial noise
is drawn with the JAX engine's own per-image scheme (:func:`initial_noise`), so both backends
start from identical noise and deterministic samplers (ddim with eta=0, euler, heun, dpmpp_2m,
dpmpp_2m_karras) agree across backends to float32 rounding. Stochastic samplers (ddpm,
euler_a, ddim with eta > 0) draw their per-step noise from one ``torch.Generator`` per image
(seeded with that image's seed), not from JAX's keys, so their images differ between backends
(each is still reproducible on its own backend, whatever else shares the batch).

The UNet is called with the timestep as a float32 tensor of shape (batch,) (diffusers'
embedding casts it to float32 anyway), so one compiled graph serves every sampler.
Compile modes, and where the compiled UNet comes from (``last.cache_layer``):

    none      eager PyTorch                         none (first call at a shape), then memory
    inductor  torch.compile(dynamic=False)          mega (preheat's entry) | none, then memory
    aot       torch.export + AOTInductor package    aot (preheat's entry)  | none, then memory

See ``preheat.backends.torch.compile_cache`` for the cache entries and their key.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import numpy as np
import torch

from preheat.backends.torch.compile_cache import TorchCompiler, make_compiler, torch_key_fields
from preheat.backends.torch.sampling import make_scheduler, sample_loop
from preheat.backends.torch.arguments import EngineArguments
from preheat.families.base import Request
from preheat.families.request import plan_inputs, scheduler_overrides
from preheat.families.components import PixelComponents
from preheat.engine import model_root
from preheat.errors import InvalidArgumentError, UnsupportedConfigError
from preheat.families.pixel import PIXEL
from preheat.models.folders import class_count, image_size, pipeline_extras, resolve_unet_dir
from preheat.models.safetensors_files import read_json
from preheat.noise import initial_noise
from preheat.samplers import DETERMINISTIC_SAMPLERS, SchedulerConfig, find_scheduler_config, load_scheduler_config
from preheat.timings import Timings

__all__ = ["TorchPipeline", "load_torch_pipeline", "initial_noise", "COMPILE_MODES", "DETERMINISTIC_SAMPLERS"]  # initial_noise: re-exported

COMPILE_MODES = ("none", "inductor", "aot", "regional")  # regional: the text-to-image pipelines
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ---------------------------------------------------------------------------------------------
# The UNet as every path calls it


class UNetCall(torch.nn.Module):
    """``(x, t, class_labels) -> prediction``: the module that is compiled or exported."""

    def __init__(self, unet: torch.nn.Module, class_conditional: bool):
        super().__init__()
        self.unet = unet
        self.class_conditional = class_conditional

    def forward(self, x: torch.Tensor, t: torch.Tensor, class_labels: torch.Tensor | None = None) -> torch.Tensor:
        return self.unet(x, t, class_labels=class_labels, return_dict=False)[0]


class _Denoiser:
    """What ``sample_loop`` calls (a diffusers UNet's interface): ``(x, t, class_labels=) -> .sample``.

    ``t`` becomes a float32 (batch,) tensor and ``x`` the model dtype, so one compiled graph per
    batch shape serves every sampler; the prediction comes back as float32."""

    def __init__(self, pipe: "TorchPipeline"):
        self.pipe = pipe

    def __call__(self, x: torch.Tensor, t: Any, class_labels: torch.Tensor | None = None) -> SimpleNamespace:
        pipe = self.pipe
        b = x.shape[0]
        fn = pipe._runner(b)
        tb = torch.as_tensor(t, device=x.device).to(torch.float32).reshape(-1).expand(b).contiguous()
        out = fn(x.to(pipe.torch_dtype).contiguous(), tb, class_labels)
        return SimpleNamespace(sample=out.to(torch.float32))


# ---------------------------------------------------------------------------------------------
# The pipeline


@dataclass
class TorchPipeline(EngineArguments):
    """A diffusers UNet ready to sample with preheat's call API. Build with :func:`load_torch_pipeline`."""

    unet: Any  # diffusers UNet2DModel, eval mode, on ``device``
    scheduler_config: SchedulerConfig  # validates sampler choices exactly like the JAX side
    scheduler_dict: dict[str, Any]  # the raw scheduler_config.json, for diffusers' schedulers
    sample_shape: tuple[int, ...]  # (H, W, C), like Pipeline.sample_shape
    fingerprint: dict[str, Any]  # architecture identity for the compile cache (never the weights)
    num_classes: int | None = None
    null_class: int | None = None
    labels: tuple[str, ...] = ()
    defaults: dict[str, Any] = field(default_factory=dict)
    dtype: str = "float32"
    device: str = "cpu"
    compile: str = "none"
    compiler: TorchCompiler | None = None
    layout: str = "NCHW"  # user-facing arrays (noise) are NCHW, as for diffusers
    family: Any = field(default_factory=lambda: PIXEL)
    components: PixelComponents = field(default_factory=PixelComponents)  # none: no encoders, no LoRA targets
    last: Timings = field(default_factory=Timings)
    _runners: dict[int, Callable[..., torch.Tensor]] = field(default_factory=dict, repr=False)
    _module: Any = field(default=None, repr=False)
    _compiled: Any = field(default=None, repr=False)


    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    def run(self, request: Request) -> np.ndarray:
        """Sample a validated request: uint8 pixels (n, H, W, C)."""
        labels = request.values["class_labels"]
        n = request.n

        self.last = Timings(cache_layer="memory")
        self._runner(n * (2 if request.guided else 1), prepare=True)  # compile / load here, not in the loop
        timings = self.last

        start = time.perf_counter()
        nchw = (request.noise.transpose(0, 3, 1, 2) if request.noise is not None
                else initial_noise(request.seeds, request.sample_shape))
        x = torch.from_numpy(np.array(nchw, np.float32, order="C")).to(self.device)
        y = torch.from_numpy(labels.astype(np.int64)).to(self.device) if labels is not None else None
        generators = [torch.Generator("cpu").manual_seed(int(s)) for s in request.seeds]
        scheduler = make_scheduler(request.sampler, {**self.scheduler_dict, **scheduler_overrides(self, request)})
        pixels = sample_loop(_Denoiser(self), scheduler, x, request.steps, class_labels=y,
                             guidance=request.cfg_scale if request.guided else None, null_class=self.null_class,
                             eta=request.eta, generator=generators,
                             timesteps={k: list(v) for k, v in plan_inputs(self, request).items()})
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
        timings.run_s = time.perf_counter() - start
        self.last = timings
        return pixels

    # ------------------------------------------------------------------ compiled UNets

    def _runner(self, model_batch: int, prepare: bool = False) -> Callable[..., torch.Tensor]:
        """The UNet callable for a model batch: from memory, preheat's cache, or a fresh compile.
        Sets ``last`` when ``prepare`` (the call before sampling)."""
        hit = self._runners.get(model_batch)
        if hit is not None:
            if prepare:
                self.last = Timings(cache_layer="memory")
            return hit
        if self._module is None:
            self._module = UNetCall(self.unet, self.num_classes is not None).eval()
        module = self._module
        if self.compiler is not None and self.compiler.explains and self.compile != "none":
            self.compiler.explain(self._fields(self.compile, model_batch))  # and run eagerly

            def fn(x: torch.Tensor, t: torch.Tensor, y: torch.Tensor | None) -> torch.Tensor:
                return module(x, t, y)

            timings = Timings(cache_layer="explain")
        elif self.compile == "none":
            def fn(x: torch.Tensor, t: torch.Tensor, y: torch.Tensor | None) -> torch.Tensor:
                return module(x, t, y)

            timings = Timings(cache_layer="none")
        elif self.compile == "inductor":
            fn, timings = self._inductor(model_batch)
        else:
            fn, timings = self._aot(model_batch)
        self._runners[model_batch] = fn
        self.last = timings
        return fn

    def _example(self, model_batch: int) -> tuple:
        h, w, c = self.sample_shape
        x = torch.zeros((model_batch, c, h, w), dtype=self.torch_dtype, device=self.device)
        t = torch.full((model_batch,), 1.0, dtype=torch.float32, device=self.device)
        if self._module.class_conditional:
            return x, t, torch.zeros((model_batch,), dtype=torch.int64, device=self.device)
        return x, t

    def _fields(self, mode: str, model_batch: int) -> dict[str, Any]:
        h, w, c = self.sample_shape
        return torch_key_fields(self.fingerprint, mode=mode, model_batch=model_batch, sample_chw=(c, h, w),
                                class_conditional=self._module.class_conditional, dtype=self.dtype,
                                device=self.device)

    def _inductor(self, model_batch: int) -> tuple[Callable[..., torch.Tensor], Timings]:
        from preheat.backends.torch.compile_cache import INDUCTOR_OPTIONS

        try:  # one static graph per batch shape; allow many before Dynamo gives up
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        except AttributeError:  # pragma: no cover - older torch
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        if self._compiled is None:
            self._compiled = torch.compile(self._module, **INDUCTOR_OPTIONS)
        compiled = self._compiled

        def fn(x: torch.Tensor, t: torch.Tensor, y: torch.Tensor | None) -> torch.Tensor:
            return compiled(x, t, y)

        example = self._example(model_batch)

        def warm_up() -> None:
            with torch.no_grad():
                fn(*example) if len(example) == 3 else fn(*example, None)
            if self.device.startswith("cuda"):
                torch.cuda.synchronize()

        compiler = self.compiler or TorchCompiler(mode="off")
        timings = compiler.warm_inductor(self._fields("inductor", model_batch), warm_up)
        return fn, timings

    def _aot(self, model_batch: int) -> tuple[Callable[..., torch.Tensor], Timings]:
        module = self._module
        constants = {**dict(module.named_parameters()), **dict(module.named_buffers())}
        compiler = self.compiler or TorchCompiler(mode="off")
        runner, timings = compiler.load_or_build_aot(self._fields("aot", model_batch), module,
                                                     self._example(model_batch), constants)
        if module.class_conditional:
            def fn(x: torch.Tensor, t: torch.Tensor, y: torch.Tensor | None) -> torch.Tensor:
                return runner(x, t, y)
        else:
            def fn(x: torch.Tensor, t: torch.Tensor, y: torch.Tensor | None) -> torch.Tensor:
                return runner(x, t)
        return fn, timings


# ---------------------------------------------------------------------------------------------
# Loading


def _scheduler_dict(source: Any) -> dict[str, Any]:
    if isinstance(source, SchedulerConfig):
        return {k: v for k, v in dataclasses.asdict(source).items() if v is not None and k != "ignored_keys"}
    if isinstance(source, dict):
        return dict(source)
    path = Path(source)
    if path.is_dir():
        path = path / "scheduler_config.json"
    return json.loads(path.read_text())


def load_torch_pipeline(model: str | Path | None = None, *, compile: str = "none", dtype: Any = "float32",
                        device: str | None = None, scheduler: Any = None, cache: str | None = None,
                        variant: str | None = None, config: str | Path | None = None,
                        controlnet: str | Path | None = None, refiner: str | Path | None = None) -> Any:
    """A ``TorchPipeline`` for a UNet2DModel ``model`` (``None`` = the built-in model), or a
    ``TorchTextPipeline`` (``preheat.backends.torch.text``) for an SD, SDXL, SD3 or Flux folder.

    ``model``: a diffusers-format folder, or a weights-store source (``hf://org/repo[@rev]``, an
    ``http(s)://`` tarball), resolved exactly as :func:`preheat.load` does.

    ``compile``: "none" (eager), "inductor" (torch.compile), "aot" (AOTInductor package) or
    "regional" (``preheat.torch.compile``: the repeated blocks; text-to-image pipelines).
    ``device``: "cpu", "cuda", "cuda:1", ...; default cuda when available.
    ``scheduler``: a scheduler_config.json path or dict, for a bare UNet folder without one.
    ``cache``: "full" (default), "xla"/"local" or "off"; see :func:`make_compiler`.
    ``config``: with ``model`` a single ``.safetensors`` file (LDM SD 1.x/2.x, SGM SDXL, BFL FLUX.1,
    MMDiT SD3, ComfyUI bundles), what the JAX engine takes (``preheat.file_configs``): the file is
    converted once into a diffusers folder under the cache root, the same folder the JAX engine
    reads, and diffusers' ``from_pretrained`` loads that folder. A GGUF transformer file (``.gguf``,
    also ``hf://org/repo/file.gguf``) is read as diffusers users read it: ``from_single_file`` with a
    ``GGUFQuantizationConfig`` (``load_gguf_denoiser``), the rest of the pipeline from the config
    folder. Scaled fp8 files are refused in one line (``preheat.file_configs.plain_tensors``).
    ``controlnet``, ``refiner``: the JAX engine's second model folders (a ControlNetModel beside an SD
    1.x/2.x or SDXL base; an SDXL refiner beside an SDXL base), run as diffusers runs them
    (``preheat.backends.torch.companions``).
    """
    if compile not in COMPILE_MODES:
        raise InvalidArgumentError(f"compile={compile!r} is not supported; use {', '.join(COMPILE_MODES)}")
    dtype = str(dtype).replace("torch.", "")
    if dtype not in _DTYPES:
        raise InvalidArgumentError(f"dtype={dtype!r} is not supported; use {', '.join(_DTYPES)}")
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        torch_device = torch.device(device)
    except (RuntimeError, TypeError):
        raise InvalidArgumentError(f"device={device!r} is not a torch device") from None
    if torch_device.type == "cuda":
        if not torch.cuda.is_available():
            raise InvalidArgumentError(f"device={device!r}: CUDA is not available to torch here")
        # The initial noise is drawn by JAX; keep JAX from preallocating most of the GPU torch needs.
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    compiler = make_compiler(cache) if compile != "none" else None

    root = model_root(model, variant)  # as preheat.load: builtin:NAME, a folder, or a store source
    from preheat.file_configs import converted_folder, gguf_source, plain_tensors

    reading: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    gguf = gguf_source(root, config, variant, compile)  # diffusers' own GGUF loader, on the file itself
    converted = None if gguf is not None else converted_folder(model, root, config, variant, check=plain_tensors)
    if gguf is not None:
        root = gguf.configs
    elif converted is not None:  # the JAX engine's folder; its files have no variant: the variant picked what it links
        root, reading, variant = converted.root, converted.reading, None
    from preheat.families import class_name_of

    class_name = class_name_of(root)
    from preheat.backends.torch.text import TEXT_FAMILIES, load_gguf_denoiser, load_text

    if class_name in TEXT_FAMILIES:
        denoiser = None if gguf is None else load_gguf_denoiser(gguf, dtype)
        with reading:
            return load_text(Path(root), class_name, compile=compile, dtype=dtype, device=str(torch_device),
                             scheduler=scheduler, compiler=compiler, variant=variant, denoiser=denoiser,
                             controlnet=controlnet, refiner=refiner)
    from preheat.load_options import companion_refused

    for name, folder in (("controlnet", controlnet), ("refiner", refiner)):
        if folder is not None:
            raise companion_refused(name, root)
    if compile == "regional":
        raise InvalidArgumentError("compile='regional' is for diffusers text-to-image pipelines (SD, SDXL, SD3, "
                                   "Flux); use compile='inductor' or 'aot' for a UNet2DModel", argument="compile")
    unet_dir = resolve_unet_dir(root)
    raw = read_json(unet_dir / "config.json")
    cls = raw.get("_class_name", "UNet2DModel")
    if cls != "UNet2DModel":
        raise UnsupportedConfigError(f"unsupported model class {cls!r} in {unet_dir / 'config.json'}; supported: 'UNet2DModel'")
    sched_source = scheduler if scheduler is not None else find_scheduler_config(root, unet_dir)
    sched = load_scheduler_config(sched_source)
    sched_dict = _scheduler_dict(sched_source)

    from diffusers import UNet2DModel

    unet = UNet2DModel.from_pretrained(unet_dir, torch_dtype=_DTYPES[dtype], low_cpu_mem_usage=False, variant=variant)
    unet = unet.to(torch_device).eval().requires_grad_(False)
    cfg = unet.config
    extra = pipeline_extras(root)
    h, w = image_size(cfg.sample_size, unet_dir)
    null_class = extra.get("null_class")
    num_classes = class_count(cfg.num_class_embeds, cfg.class_embed_type, null_class)
    architecture = {k: v for k, v in dict(cfg).items() if not k.startswith("_")}
    fingerprint = json.loads(json.dumps({"kind": "diffusers.UNet2DModel", "config": architecture,
                                         "sample_size": [h, w]}, default=str))
    return TorchPipeline(unet=unet, scheduler_config=sched, scheduler_dict=sched_dict,
                         sample_shape=(h, w, cfg.in_channels), fingerprint=fingerprint, num_classes=num_classes,
                         null_class=null_class, labels=tuple(extra.get("labels", ())),
                         defaults=dict(extra.get("defaults", {})), dtype=dtype, device=str(torch_device),
                         compile=compile, compiler=compiler)
