"""The core every surface calls: load a model, compile its whole sampling loop once, sample.

A call runs up to three compiled stages, each with its own executable (and cache entry):

    stage      program                                            shared across
    ---------  -------------------------------------------------  ------------------------------
    encode     token ids -> text embeddings (text families)       samplers, step counts, guidance
    denoise    initial noise from per-image seeds, every step      --
               (``preheat.samplers.denoise_loop``, one ``lax.fori_loop``),
               classifier-free guidance; pixel families also
               convert to uint8 here
    decode     latents -> uint8 pixels (VAE families)             samplers, step counts, prompts
    encode_    an image the call passes in -> latents (a          samplers, strengths, prompts,
    image      posterior sample per image; ``families.image``)     image content

The family describes each stage (``families.stages.Stage``; its hooks never run one), the engine
schedules them -- encode -> [encode_image] -> denoise -> decode -- so every key is known before
anything runs (``Pipeline.describe``). What is static and what is data for the denoising program,
and the program itself: ``preheat.denoise``.

Each stage's program takes one argument, a NamedTuple of named fields (``EncodeArgs``,
``DenoiseArgs``, ``DecodeArgs``, ``EncodeImageArgs``: ``preheat.families.stages``), whose
``BATCHED`` names what is split over devices; a LoRA's factors and each image's adapter slot
are fields of their own (``LoraArgs``), never part of the weights or the conditioning.

Seeds are per image: image ``b`` draws all its randomness from ``key(seed_b)``
(``preheat.noise``), so it is the same whatever else shares its batch -- or however many devices
split it: with ``load(devices=...)`` every stage runs data parallel, the batch split over a mesh
axis ``data`` and the weights replicated (``preheat.sharding``). Inside: NHWC. Outside
(``noise``): NCHW like diffusers. What a family contributes (inputs, conditioning, decoding) is
described in ``preheat.families``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from preheat import platforms
from preheat.cache.executables import Executables
from preheat.errors import InvalidArgumentError, PreheatError, SamplingStopped
from preheat.families import request as request_of
from preheat.families.base import Family, LoadedModel, Request, StageSignature, to_pixels
from preheat.families.components import Components, PixelComponents
from preheat.families.guidance import guidance_rescale
from preheat.families.stages import DenoiseArgs, LoraArgs, Stage, joined
# re-exported: the engine is where callers have found them
from preheat.model_source import BUILTIN_MODEL, BUILTIN_MODELS, model_root  # noqa: F401
from preheat.load_options import loader_options, source_id
from preheat.progress import Progress, Reporter, current, reporting
from preheat.denoise import Denoiser, Signature, build_program, denoise_output, rescaled_guidance  # noqa: F401
from preheat.samplers import SchedulerConfig, load_scheduler_config, make_spec
from preheat.timings import Phases, Timings, now_s

if TYPE_CHECKING:
    from preheat.lora import LoraRuntime  # imported by the models that take LoRAs (a pixel model never does)

__all__ = ["Pipeline", "load_jax_pipeline", "BUILTIN_MODEL", "BUILTIN_MODELS", "model_root", "Signature", "StageSignature", "Request", "Timings", "to_pixels",
           "DenoiseArgs", "build_program", "rescaled_guidance", "make_compiler"]

@dataclass
class Pipeline:
    """A model ready to sample. Build with :func:`preheat.load` or :meth:`Pipeline.from_denoiser`."""

    apply: Denoiser
    params: Any
    sample_shape: tuple[int, ...]  # NHWC per image at the default size: (H, W, C)
    scheduler_config: SchedulerConfig
    fingerprint: dict[str, Any]  # denoiser identity, for the compile cache (never the weights)
    family: Family = field(default_factory=lambda: _pixel())
    num_classes: int | None = None  # class-conditional families: number of real classes
    null_class: int | None = None  # the "no class" label for classifier-free guidance
    labels: tuple[str, ...] = ()  # human names of the classes, index = label
    defaults: dict[str, Any] = field(default_factory=dict)  # sampler / steps / guidance (complete)
    dtype: str = "float32"
    layout: str = "NCHW"  # layout of user-facing arrays (noise); the engine is NHWC inside
    components: Components = field(default_factory=PixelComponents)  # a family's other parts (encoders, VAE, ...)
    # the run-time LoRA state (files held, stacks, rank buckets run); None: the model takes no LoRA.
    # Made from the components' lora_targets when not given (dataclasses.replace shares it).
    lora_runtime: LoraRuntime | None = None
    compiler: Any = None  # preheat.cache's compiler; None = compile in memory only
    last: Timings = field(default_factory=Timings)
    load_report: Any = None  # how the weights were read (preheat.models.load_report.LoadReport); set by load()
    mesh: Any = None  # jax.sharding.Mesh with axis "data" (preheat.sharding); None: the default device alone
    startup: Any = None  # preheat.timings.Phases of load() and the first call (set by load())
    executables: Executables = field(default_factory=Executables, repr=False)  # by signature: the memory layer
    # each thread's call in progress records into its own Timings (``last`` is whichever call began
    # last: concurrent calls must not write into, or read stages from, each other's)
    _calls: threading.local = field(default_factory=threading.local, init=False, repr=False, compare=False)
    reports_progress: ClassVar[bool] = True  # run(..., progress=) and generate(..., progress=) are honoured

    def __post_init__(self) -> None:
        self.defaults = request_of.resolved_defaults(self.family, self.defaults)
        if self.lora_runtime is None and self.components.lora_targets is not None:
            from preheat.lora import LoraRuntime

            self.lora_runtime = LoraRuntime.of(self.components)
        # weights placed on the devices once, not per call: replicated, or split over fsdp
        if self.mesh is not None:
            from preheat.sharding import distribute, distribute_components

            self.params = distribute(self.params, self.mesh)
            self.components = distribute_components(self.components, self.mesh)

    @property
    def device_count(self) -> int:
        """How many devices split each batch (a batch runs padded to a multiple of this)."""
        return 1 if self.mesh is None else self.mesh.size

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_denoiser(cls, fn: Callable[[Any, jax.Array, jax.Array, Any], jax.Array], params: Any,
                      sample_shape: Sequence[int], scheduler_config: dict[str, Any] | SchedulerConfig | str | Path, *,
                      num_classes: int | None = None, null_class: int | None = None,
                      name: str | None = None, layout: str = "NHWC", **defaults: Any) -> "Pipeline":
        """Bring your own denoiser: ``fn(params, x, t, class_labels) -> prediction``.

        ``sample_shape`` is one sample's shape in ``layout`` ("NHWC", the Flax convention, or
        "NCHW"); ``fn`` sees arrays in that layout. The compile cache identifies the model by
        ``name`` (default: the function's qualified name) *and* a fingerprint of ``fn``'s lowered
        program, so a changed function body is never served a stale executable.
        """
        if layout not in ("NHWC", "NCHW"):
            raise InvalidArgumentError(f"layout={layout!r} is not supported; use 'NHWC' or 'NCHW'", argument="layout")
        shape = tuple(int(s) for s in sample_shape)
        if len(shape) != 3 or min(shape) <= 0:
            raise InvalidArgumentError(f"sample_shape={tuple(sample_shape)} must be three positive ints (one image)",
                                       argument="sample_shape")
        if layout == "NCHW":
            shape = (shape[1], shape[2], shape[0])

            def user_fn(p: Any, x: jax.Array, t: jax.Array, y: Any) -> jax.Array:  # the engine is NHWC inside
                return jnp.transpose(fn(p, jnp.transpose(x, (0, 3, 1, 2)), t, y), (0, 2, 3, 1))
        else:
            user_fn = fn

        def apply(p: Any, x: jax.Array, t: jax.Array, cond: Any, lora: Any = None) -> jax.Array:
            return user_fn(p, x, t, cond.get("class_labels"))  # no LoRA targets: lora is always None

        leaves = jax.tree.leaves(params)
        dtype = str(leaves[0].dtype) if leaves else "float32"
        fingerprint = {"kind": "denoiser", "name": name or f"{fn.__module__}.{fn.__qualname__}",
                       "sample_shape": list(shape), "layout": layout,
                       "program": _lowered_fingerprint(user_fn, params, shape, dtype, num_classes is not None)}
        return cls(apply=apply, params=params, sample_shape=shape,
                   scheduler_config=load_scheduler_config(scheduler_config), fingerprint=fingerprint,
                   num_classes=num_classes, null_class=null_class, defaults=defaults, dtype=dtype, layout=layout)

    # ------------------------------------------------------------------ sampling

    def __call__(self, first: Any = None, /, **inputs: Any) -> list:
        """Sample images; returns ``list[PIL.Image]``.

        ``pipe(8, class_labels=3)`` for pixel families; ``pipe("a watercolor fox",
        negative_prompt="blurry", width=512, height=512)`` (or a list of prompts, or ``n=4``
        images of one prompt) for text families. ``seed``: an int (image i gets ``seed + i``)
        or one seed per image. ``lora="style.safetensors", lora_scale=0.8`` (or
        ``lora=[(src, scale), ...]``, or one entry per image) adds LoRAs as data: see ``preheat.lora``.
        ``progress=fn``: ``fn(step, total)`` after each finished step (``preheat.progress``).
        """
        return request_of.images(self.generate(first, **inputs))

    def generate(self, first: Any = None, /, progress: Progress | None = None, **inputs: Any) -> np.ndarray:
        """Like ``__call__`` but returns uint8 pixels, (n, H, W, C)."""
        return self.run(self.validate(first, **inputs), progress=progress)

    def run(self, request: Request, progress: Progress | None = None) -> np.ndarray:
        """Sample a validated request (``validate``, or ``preheat.families.request.concat`` of
        several): uint8 pixels (n, H, W, C). What a server's worker calls for a batch.
        ``progress(step, total)``: called after each finished step; raises ``SamplingStopped``
        when its reporter was stopped (``preheat.progress``)."""
        first_call = self.startup is not None and "first_call" not in self.startup.spans
        start = now_s()
        self.last = self._calls.timings = Timings()
        with reporting(progress) as reporter:
            try:
                out = self._schedule(request, self.execute_stage, reporter)
            except jax.errors.JaxRuntimeError:
                if reporter is not None and reporter.stopped:
                    raise SamplingStopped(f"stopped at step {reporter.step}") from None
                raise
        out = np.asarray(self.family.finish(self, request, out))
        if first_call:
            self.startup.add("first_call", start, now_s())
        return out

    def validate(self, first: Any = None, /, **inputs: Any) -> Request:
        """Check a call's arguments (host-side only: nothing runs on the device) into a Request."""
        return request_of.validate(self, first, inputs)

    def check(self, first: Any = None, /, **inputs: Any) -> Request:
        """Every host-side check of a call (``validate`` plus the sampler's schedule for this step
        count), with no device work: what a server runs before it accepts a request."""
        return request_of.check(self, first, inputs)

    def describe(self, first: Any = None, /, progress: Progress | None = None, **inputs: Any) -> list[Stage]:
        """Every program a call runs, in order, each once, with the arguments the call passes it
        (placed as the mesh runs them): described, nothing compiled or run. A later stage's
        arguments hold zeros of the earlier ones' output shapes (``jax.eval_shape``; the denoising
        loop's is :func:`denoise_output`), which is all a key needs: so every key is known before
        anything runs (prefetching, ``preheat warm --dry-run``, a target's compiles)."""
        request = self.validate(first, **inputs)
        described: dict[Any, Stage] = {}

        def record(stage: Stage) -> Any:
            n = stage.sig.batch
            stage = self._placed(stage)
            described.setdefault(stage.sig, stage)
            shapes = denoise_output(stage.sig) if stage.name == "denoise" else \
                jax.eval_shape(stage.program(), stage.args)
            return _unpadded(jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes), n, stage.sig.batch)

        with reporting(progress) as reporter:
            self._schedule(request, record, reporter)
        return list(described.values())

    def prepare(self, first: Any = None, /, progress: Progress | None = None,
                **inputs: Any) -> tuple[Signature, DenoiseArgs]:
        """Validate a call and turn it into (the denoising program's signature, its one argument:
        ``executable(sig, args)(args)`` runs it). The stages before it run (a text family's
        encoders: the embeddings are arguments). On several devices the arguments are placed (and
        padded) as the program takes them."""
        self.last = self._calls.timings = Timings()
        stage = self._denoise_stage(self.validate(first, **inputs), self.execute_stage, progress=progress is not None)
        if self.mesh is not None:
            stage = self._placed(stage)
        return stage.sig, stage.args

    def _schedule(self, request: Request, execute: Callable[[Stage], Any], reporter: Reporter | None = None) -> Any:
        """encode -> [encode_image] -> denoise -> decode: the family describes each stage, ``execute``
        runs it (``execute_stage``) or records it (``describe``); returns the last stage's output."""
        denoise = self._denoise_stage(request, execute, reporter, progress=reporter is not None)
        out = execute(denoise)
        decode = self.family.decode(self, request, out)
        return out if decode is None else execute(decode)

    def _denoise_stage(self, request: Request, execute: Callable[[Stage], Any], reporter: Reporter | None = None,
                       progress: bool = False) -> Stage:
        """The denoising stage of ``request``, once ``execute`` has given the stages before it."""
        spec = make_spec(request_of.scheduler_config(self, request), request.sampler)
        plan = request_of.plan(self, request)
        if reporter is not None:  # the call's id is data: every call shares the progress program
            plan = plan._replace(progress_id=np.int32(reporter.id))
        before = joined([self.family.condition(self, request), self.family.image_start(self, request, plan)],
                        lambda conditioning, start: (conditioning, start))
        restart = self.family.restart_step(self, request)
        conditioning, start = before.then([execute(stage) for stage in before.stages])
        lora = None
        if request.lora is not None:  # adapters are data: factors and scales, each image's slot
            from preheat.lora import denoiser_args

            factors, scales = denoiser_args(self, request.lora)
            lora = LoraArgs(factors=factors, scales=scales, slots=request.lora.index)
            self.lora_runtime.compiled(request.lora.bucket)
        noise = request.noise if request.noise is not None else np.zeros((), np.float32)
        args = DenoiseArgs(params=self.params, plan=plan, seeds=request.seeds, cond=conditioning.cond,
                           uncond=conditioning.uncond, guidance=np.float32(request.cfg_scale), noise=noise,
                           start=start, lora=lora, guidance_rescale=guidance_rescale(request),
                           restart=None if restart is None else np.int32(restart))
        sig = Signature.of(self.family.name, spec, request, args, self.dtype, self.family.pixels_in_loop, progress)
        return Stage("denoise", self.fingerprint, sig, lambda: build_program(sig, self.apply), args)

    def executable(self, sig: Signature, args: DenoiseArgs) -> Callable[[DenoiseArgs], Any]:
        """The compiled denoising program for ``sig`` (and the arguments ``prepare`` returned):
        from memory, the compile cache, or a fresh compile. Call it with the one ``args``."""
        return self.compiled_stage(Stage("denoise", self.fingerprint, sig, lambda: build_program(sig, self.apply),
                                         args))

    def place(self, sig: Any, args: Any) -> tuple[Any, Any]:
        """(sig, args) as the mesh runs them: the batch padded to a multiple of the device count,
        the fields ``args`` names in its ``BATCHED`` split over ``data``, the rest replicated
        (``preheat.families.stages``, ``preheat.sharding.batch_specs``)."""
        from preheat.sharding import batch_specs, pad_batch, padded, place

        specs = batch_specs(args, self.mesh)
        to = padded(sig.batch, self.mesh)
        args = place(pad_batch(args, specs, sig.batch, to), specs, self.mesh)
        return (sig if to == sig.batch else dataclasses.replace(sig, batch=to)), args

    def _placed(self, stage: Stage) -> Stage:
        """``stage`` as it runs: on a mesh, its arguments placed and its batch padded (:meth:`place`);
        a host stage stays the CPU's alone."""
        if self.mesh is None or stage.on_host:
            return stage
        sig, args = self.place(stage.sig, stage.args)
        return stage._replace(sig=sig, args=args)

    def program(self, stage: Stage) -> Callable[..., Any]:
        """The function a (placed) stage compiles: its program, split over the batch on a mesh
        (``preheat.sharding.shard_program``); a host stage's traced for the host's CPU wherever it is
        traced (a prefetch compiles on its own threads: ``platforms.on_host``)."""
        program = stage.program()
        if stage.on_host:
            def hosted(args: Any, inner: Callable[..., Any] = program) -> Any:
                with platforms.on_host():
                    return inner(args)

            return hosted
        if self.mesh is not None:
            from preheat.sharding import batch_specs, shard_program

            program = shard_program(program, self.mesh, batch_specs(stage.args, self.mesh), stage.outputs)
        return program

    def compiled_stage(self, stage: Stage) -> Callable[..., Any]:
        """One (placed) stage's executable (memory, then the compile cache, then a compile); its
        timings are recorded in ``last.stages[stage.name]``."""
        hit = self.executables.get(stage.sig)
        if hit is not None:
            self._timings().add(stage.name, Timings(cache_layer="memory"))
            return hit
        program = self.program(stage)
        if self.compiler is not None:
            compiled, timings = self.compiler.get_or_compile(stage.fingerprint, stage.sig, program, stage.args,
                                                             outputs=stage.outputs)
        else:
            from preheat.cache.xla_layer import compile_uncached

            start = time.perf_counter()
            lowered = jax.jit(program).lower(stage.args)
            traced = time.perf_counter()
            compiled = compile_uncached(lowered)  # cache="off": no layer, JAX's included
            timings = Timings(trace_lower_s=traced - start, compile_s=time.perf_counter() - traced, cache_layer="none")
        self._timings().add(stage.name, timings)
        if compiled is not None:  # (a target's compiler keeps nothing it could run here)
            self.executables.put(stage.sig, compiled)
        return compiled

    def _timings(self) -> Timings:
        """The Timings of this thread's call in progress (``last`` outside a call)."""
        return getattr(self._calls, "timings", None) or self.last

    def execute_stage(self, stage: Stage) -> Any:
        """Compile (or fetch) and run one stage, timing its run; on several devices its arguments
        are placed (padded) and the padding rows dropped from its output.

        A cached executable that loads but fails on its first run (seen on XLA:CPU: "Function ...
        not found") is a bad entry like any other: it is quarantined, compiled afresh, run again.
        """
        if stage.on_host:  # the host's program and run; its outputs as host arrays for the next stage
            with platforms.on_host():
                return jax.tree.map(np.asarray, self._execute(stage))
        return self._execute(stage)

    def _execute(self, stage: Stage) -> Any:
        if self.compiler is not None and not self.compiler.runs:  # its programs are for another machine
            raise InvalidArgumentError(f"this pipeline compiles for --target {self.compiler.target.name}: its programs "
                                       "cannot run here (preheat warm --target builds them)", argument="compiler")
        n = stage.sig.batch
        stage = self._placed(stage)
        executable = self.compiled_stage(stage)
        start = time.perf_counter()
        try:
            out = jax.block_until_ready(executable(stage.args))
        except jax.errors.JaxRuntimeError as exc:
            stopped = current() is not None and current().stopped  # a cancel, not a bad entry
            if self._timings().stages[stage.name].cache_layer != "aot" or self.compiler is None or stopped:
                raise
            self.compiler.reject(stage.fingerprint, stage.sig, stage.args, f"failed on its first run: {str(exc)[:200]}")
            self.executables.drop(stage.sig)
            executable = self.compiled_stage(stage)
            start = time.perf_counter()
            out = jax.block_until_ready(executable(stage.args))
        timings = self._timings()
        timings.stages[stage.name].run_s = run_s = time.perf_counter() - start
        timings.run_s += run_s
        return _unpadded(out, n, stage.sig.batch)

    # ------------------------------------------------------------------ argument checks

    def class_index(self, c: Any) -> int:
        """A class given as an index or a label name -> its index; unknown -> one-line error."""
        from preheat.families.pixel import class_index

        return class_index(self, c)

    def is_guided(self, guidance: float | None = None, **inputs: Any) -> bool:
        """Whether a call with this ``guidance`` (None = the model's default) runs guided."""
        return request_of.guidance(self, guidance, inputs)[0]


def _lowered_fingerprint(fn: Callable, params: Any, shape: tuple[int, ...], dtype: str, labels: bool) -> str:
    """sha256 of the StableHLO of one denoiser call: changes whenever the traced code does."""
    import hashlib

    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), getattr(x, "dtype", np.float32)), params)
    x = jax.ShapeDtypeStruct((1, *shape), dtype)
    t = jax.ShapeDtypeStruct((1,), jnp.float32)
    y = jax.ShapeDtypeStruct((1,), jnp.int32) if labels else None
    try:
        text = jax.jit(fn).lower(abstract, x, t, y).as_text()
    except Exception as exc:  # a denoiser that cannot be traced fails here with its own message
        raise InvalidArgumentError(f"the denoiser cannot be traced with sample_shape={shape}: "
                                   f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                                   argument="fn") from None
    # drop location metadata (file paths, line numbers) so that moving code does not change the key
    lines = [ln.split(" loc(")[0] for ln in text.splitlines() if not ln.lstrip().startswith("#loc")]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def _unpadded(out: Any, n: int, batch: int) -> Any:
    """A stage's output of ``batch`` rows without those a mesh padded its ``n`` with."""
    return out if batch == n else jax.tree.map(lambda o: o[:n], out)


def _pixel() -> Family:
    from preheat.families.pixel import PIXEL

    return PIXEL


def make_compiler(cache: str | None = None) -> Any:
    """The compile cache for this process: ``cache`` (or ``$PREHEAT_CACHE``) is "full" (default),
    "xla" (JAX's persistent cache only) or "off". Configures JAX's cache before any compile."""
    mode = cache or os.environ.get("PREHEAT_CACHE", "full")
    if mode not in ("full", "xla", "off"):
        raise InvalidArgumentError(f"cache mode {mode!r} is not supported; use full, xla or off", argument="cache")
    if mode == "off":
        return None
    from preheat.cache.compile import JaxCompiler

    return JaxCompiler(mode=mode)


def load_jax_pipeline(model: str | Path | None = None, *, scheduler: Any = None, dtype: Any = "float32",
         cache: str | None = None, variant: str | None = None, config: str | Path | None = None,
         offload_encoders: bool = False, weights_dtype: str | None = None, weights_layers: str = "layerwise",
         devices: Any = None, fsdp: int = 1, prefetch: Sequence[dict[str, Any]] | None = None,
         controlnet: str | Path | None = None, refiner: str | Path | None = None,
         encoders_on: str = "device") -> Pipeline:
    """A JAX sampling ``Pipeline`` for ``model``; ``None`` = the built-in model.

    ``model``: a diffusers-format folder, or a source for the weights store (``hf://org/repo[@rev]``,
    an ``http(s)://`` tarball), read from the store with no network once pulled; ``builtin:NAME``
    or ``random:NAME`` (a random-weight folder written once; ``preheat.model_source``). The family is
    chosen from ``model_index.json``'s ``_class_name`` (or a bare model's ``config.json``); see
    ``preheat.families``.

    ``scheduler``: a scheduler_config.json path or dict, for a bare UNet folder without one.
    ``dtype``: the denoiser's dtype (float32, bfloat16, float16); a VAE that asks for it stays float32.
    ``variant``: weight files ``*.{variant}.safetensors`` (e.g. "fp16").
    ``config``: with ``model`` a single ``.safetensors`` file in an original layout (LDM SD 1.x/2.x,
    SGM SDXL, BFL FLUX.1, MMDiT SD3), the diffusers folder whose configs and tokenizers it is read
    with (``preheat.models.single_file``), a folder of only the component folders it lacks, or a
    published model's name (``"stable-diffusion-2-1-base"``); None: the published model is inferred
    from the file and what it lacks is pulled from its repository (``single_file_config``); a FLUX.1
    GGUF file (``preheat.models.gguf_file``) too, inferred from its header.
    ``cache``: "full" (default), "xla" or "off"; see :func:`make_compiler`.
    ``weights_dtype``: "float8_e4m3fn" keeps the denoiser's weights in fp8 on the device (the
    layers diffusers' ``enable_layerwise_casting`` casts), upcast to ``dtype`` where they are
    used, inside the compiled program (``preheat.models.storage``); "int8" keeps the same layers as
    int8 with a float32 scale per output channel, quantised once as they are read, the products
    done on the int8 values and scaled on their output; None: the denoiser's layers a
    checkpoint stores in fp8 stay fp8 (a scaled fp8 file's beside their scales), the rest in ``dtype``.
    ``weights_layers``: "linear" stores the Linear layers inside norm modules (AdaLN modulation) in
    fp8 too (FLUX.1-dev: 0.51x of bf16, against 0.64x for diffusers' set).
    ``offload_encoders`` (or ``encoders_on="offload"``): text families keep their text encoders'
    weights in the device's pinned host memory, and the encode stage moves each block in as its
    scan reaches it, so the device holds about one block of an encoder at a time (FLUX.1-dev's
    T5-XXL beside its int8 transformer on a 16 GB TPU v5e: ``families.text.offload``).
    ``encoders_on``: "host" (FLUX.1) keeps the text encoders' weights in host memory and runs the
    encode stage on the host's CPU: they never occupy the accelerator; the embeddings move to the
    device once per call, before the loop.
    ``devices``: "all" (the default, or ``$PREHEAT_DEVICES``), a count N (the first N) or a list
    of local device ids: each batch is split over them, the weights replicated on each
    (``preheat.sharding``); the first device alone runs today's single-device program.
    ``fsdp``: split each weight over this many of those devices instead of replicating it (for
    weights that do not fit one device); it must divide the device count.
    ``prefetch``: the calls expected first, as ``generate`` keywords (``[{"n": 4, "steps": 20}]``;
    a family's data inputs may be left out, like a prompt: its words are data; ``InputSpec.warm``), or a function of the pipeline
    being loaded that returns them (``preheat.warm.prefetch_calls``: a server's warm
    declaration). Every executable those calls run -- a text family's encoders, the denoising
    loop, the VAE decoder -- is loaded (or pulled from ``PREHEAT_CACHE_URL``) on a background
    thread while the weights are read: each call's stages are described on placeholder weights
    (``Pipeline.describe``), which gives the cache keys (they need the weights' and the
    embeddings' shapes, never their values), on one device or a mesh alike. Calls with a LoRA are left to load on first use.
    ``controlnet``: a diffusers ControlNetModel folder (SD 1.x/2.x or SDXL base, matching the
    model) run beside the UNet on every call: the model then takes ``control_image`` and the
    ControlNet's scale and step window (``preheat.families.control``).
    ``refiner``: an SDXL refiner folder beside an SDXL base (SDXL's ensemble of experts): the base
    denoises the first ``denoising_end`` of each call, the refiner the rest, in one program
    (``preheat.families.experts``). Both read ``variant``; a refiner shares the base's VAE.
    ``preheat.load`` (``preheat.api``) adds ``backend="torch"``.

    ``Pipeline.startup`` records each start-up phase and the critical path (``preheat.timings.Phases``).
    """
    from preheat.load_options import encoders_placement

    offload_encoders, encoders_on = encoders_placement(offload_encoders, encoders_on)  # "offload": the flag
    phases = Phases()
    phases.add("import", 0.0, now_s())  # interpreter start, imports, everything before load()
    compiler = make_compiler(cache)  # first: JAX's cache must be configured before anything compiles
    from preheat.sharding import select_devices

    mesh = select_devices(devices, fsdp)  # a bad devices= or fsdp= fails before any weights are read
    if weights_dtype is not None:
        from preheat.models.storage import check_weights_dtype

        check_weights_dtype(weights_dtype, mesh, weights_layers)  # an unknown dtype, or devices that cannot hold it, fail here

    from preheat.families import family_loader
    from preheat.file_configs import converted_folder
    from preheat.models.load_report import recording
    from preheat.models.weights import DeferredFills, LoadOptions

    root = model_root(model, variant)  # hf://: that variant only
    reading: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    converted = converted_folder(model, root, config, variant)  # a single file: its diffusers folder
    if converted is not None:  # a misfit names the file, not the folder; its files have no variant
        root, reading, variant = converted.root, converted.reading, None
    # second model folders run beside the model's own (the loader's keyword, and whom it applies to)
    companions = {"controlnet": controlnet, "refiner": refiner}
    early = bool(prefetch) and compiler is not None
    if early:  # the last such start's executables deserialise while the model is built (preheat.cache.early)
        from preheat.cache.early import startup_id

        compiler.start_early(startup_id(root, {"dtype": str(dtype), "variant": variant, "fsdp": fsdp,
                                               "weights_dtype": weights_dtype, "weights_layers": weights_layers,
                                               "offload_encoders": offload_encoders, "scheduler": scheduler,
                                               "encoders_on": encoders_on,
                                               **{name: None if folder is None else source_id(folder)
                                                  for name, folder in companions.items()},
                                               "devices": None if mesh is None else
                                               [int(d.id) for d in mesh.devices.flat]}), mesh)
    loader = family_loader(root)
    options = loader_options(loader.takes, root, offload_encoders, companions, variant, encoders_on)  # one line for a misfit
    from preheat.models.footprint import check_fits  # weights that cannot fit the device: refused before any is read
    check_fits(root, dtype=dtype, variant=variant, weights_dtype=weights_dtype, weights_layers=weights_layers,
               offload_encoders=offload_encoders, mesh=mesh, fsdp=fsdp, encoders_on=encoders_on)
    # Prefetching: the loader checks every header and returns placeholder weights (shapes only),
    # the executables load on a background thread, then the tensors are read here.
    with recording(str(root)) as weights_read:  # bytes, seconds, peak host memory of every component
        start = phases.spans["import"][1]
        pending = DeferredFills() if early else None
        with reading:
            loaded: LoadedModel = loader.load(root, scheduler=scheduler, dtype=dtype, variant=variant,
                                              options=LoadOptions(pending=pending, weights_dtype=weights_dtype,
                                                                  weights_layers=weights_layers), **options)
        if weights_dtype is not None:  # part of the denoiser's identity: its program takes fp8 weights
            from preheat.models.storage import stored_low

            loaded = dataclasses.replace(loaded, fingerprint={**loaded.fingerprint, "weights_dtype": weights_dtype,
                                                              "weights_layers": weights_layers})
            stored_low(loaded.params, weights_dtype, root)
        if pending is not None:
            phases.add("model", start, now_s())  # configs, abstract builds, every header checked
            _prefetch(loaded, mesh, compiler, prefetch, phases)
            with phases.phase("weights"):
                pending.run()
        else:
            phases.add("weights", start, now_s())  # the model phase is inside: the loader did both
    return Pipeline(**vars(loaded), compiler=compiler, load_report=weights_read.total, mesh=mesh, startup=phases)


def _prefetch(loaded: LoadedModel, mesh: Any, compiler: Any,
              calls: Sequence[dict[str, Any]] | Callable[[Pipeline], Sequence[dict[str, Any]]], phases: Phases) -> None:
    """Start loading the executables of ``calls`` on a background thread.

    Their keys come from each call's stages (``Pipeline.describe``) on a pipeline whose weights are
    still placeholders: a key needs the weights' and the arguments' shapes and placement, never
    their values. The descriptions are made on the thread too, overlapping the weight reads.
    """
    # built here, before the reads: on a mesh the view's placeholders take the placement the
    # weights will have (sharding.distribute), without touching a weight being read
    view = Pipeline(**vars(loaded), mesh=mesh)

    def items() -> list[tuple[dict[str, Any], Any, Any, int, Callable]]:
        try:
            wanted = calls(view) if callable(calls) else calls
        except PreheatError:  # a bad declaration fails on its own, where it is used
            return []
        placeholders = view.family.warm_inputs(view, guided=False)[0]
        stages: dict[Any, Stage] = {}
        for call in wanted:
            inputs = dict(call)
            if inputs.get("lora"):
                continue  # adapters are read per call: no key before then
            for name, value in placeholders.items():  # e.g. a prompt: its words are data
                inputs.setdefault(name, value)
            try:
                for stage in view.describe(inputs.pop("n", None), **inputs):
                    stages.setdefault(stage.sig, stage)
            except PreheatError:  # a bad call fails on its own, when it is made
                continue
        # with each program: a miss compiles on the prefetch's threads, the stages at once
        return [(s.fingerprint, s.sig, s.args, s.outputs, view.program(s)) for s in stages.values()]

    compiler.prefetch(items, phases)
