"""The core every surface calls: load a model, compile its whole sampling loop once, sample.

One call = one compiled program: initial noise from per-image seeds, every denoising step
(``preheat.samplers.run``, a ``lax.fori_loop``), classifier-free guidance and the conversion
to uint8 pixels. What is static (changes the program) and what is data (does not):

    static (one executable each)          runtime data (no recompile)
    ------------------------------------  ----------------------------------------------
    model architecture, dtype             weights (an argument, never a constant)
    solver + prediction type + clipping   step count, schedule tables (a padded Plan)
    batch size, image shape               guidance scale, class labels, seeds
    guidance on/off, user noise or not    the user's initial noise

Seeds are per image: image ``b`` draws all its randomness from ``key(seed_b)``, so it is
the same whatever else shares its batch. Inside: NHWC. Outside (``noise``): NCHW like diffusers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from preheat.errors import InvalidArgumentError, ModelNotFoundError, SchedulerConfigError
from preheat.samplers import SAMPLERS, Plan, SchedulerConfig, SolverSpec, make_plan, make_spec, run

__all__ = ["Pipeline", "load", "BUILTIN_MODEL", "Signature", "Timings"]

BUILTIN_MODEL = Path(__file__).parent / "assets" / "digits"

Denoiser = Callable[[Any, jax.Array, jax.Array, "jax.Array | None"], jax.Array]
"""``fn(params, x, t, class_labels) -> prediction``: x (B, *sample_shape), t (B,) float32."""


@dataclass(frozen=True)
class Signature:
    """Everything that selects one compiled program (hashable; the compile-cache key builds on it)."""

    spec: SolverSpec
    batch: int
    sample_shape: tuple[int, ...]  # NHWC per image: (H, W, C)
    dtype: str
    guided: bool  # classifier-free guidance on (2x batch through the model)
    user_noise: bool  # initial noise passed in rather than drawn from the seeds
    class_conditional: bool


@dataclass
class Timings:
    """Phases of the last call, in seconds (the CLI report and bench read these)."""

    trace_lower_s: float = 0.0
    compile_s: float = 0.0  # compile, or load from the cache
    run_s: float = 0.0
    cache_layer: str = "memory"  # where the executable came from: memory | aot | xla | none


def _to_pixels(x: jax.Array) -> jax.Array:
    """[-1, 1] floats -> uint8, exactly as diffusers' pipelines round."""
    return jnp.round(jnp.clip(x / 2 + 0.5, 0.0, 1.0) * 255).astype(jnp.uint8)


def _image_keys(seeds: jax.Array) -> jax.Array:
    return jax.vmap(jax.random.key)(seeds)  # (B,) typed keys


def _normal_per_image(keys: jax.Array, stream: int, index: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """One standard-normal draw per image, from that image's own key only. -> (B, *shape)."""
    def one(key: jax.Array) -> jax.Array:
        return jax.random.normal(jax.random.fold_in(jax.random.fold_in(key, stream), index), shape, jnp.float32)

    return jax.vmap(one)(keys)


_INIT_STREAM, _STEP_STREAM = 0, 1


def build_program(sig: Signature, apply: Denoiser, null_class: int | None) -> Callable[..., jax.Array]:
    """The whole sampling call as one pure function of (params, plan, seeds, labels, guidance, noise)."""
    spec = sig.spec
    draws = max(spec.noise_draws_per_step, 1)

    def program(params: Any, plan: Plan, seeds: jax.Array, labels: jax.Array, guidance: jax.Array,
                noise: jax.Array) -> jax.Array:
        b = sig.batch
        keys = _image_keys(seeds)
        if sig.user_noise:
            x_t = noise.astype(jnp.float32)  # (B, H, W, C)
        else:
            x_t = _normal_per_image(keys, _INIT_STREAM, jnp.int32(0), sig.sample_shape)
        y = labels if sig.class_conditional else None

        def model(x: jax.Array, t: jax.Array) -> jax.Array:
            x = x.astype(sig.dtype)
            tb = jnp.broadcast_to(t.astype(jnp.float32), (b,))
            if not sig.guided:
                return apply(params, x, tb, y).astype(jnp.float32)
            both = apply(params, jnp.concatenate([x, x]), jnp.concatenate([tb, tb]),
                         jnp.concatenate([y, jnp.full_like(y, null_class)])).astype(jnp.float32)
            cond, uncond = both[:b], both[b:]
            return uncond + guidance.astype(jnp.float32) * (cond - uncond)

        def noise_fn(i: jax.Array, k: int) -> jax.Array:
            return _normal_per_image(keys, _STEP_STREAM, i * draws + k, sig.sample_shape)

        x0 = run(spec, model, plan, x_t, noise_fn)
        return _to_pixels(x0)

    return program


@dataclass
class Pipeline:
    """A model ready to sample. Build with :func:`load` or :meth:`Pipeline.from_denoiser`."""

    apply: Denoiser
    params: Any
    sample_shape: tuple[int, ...]  # NHWC per image: (H, W, C)
    scheduler_config: SchedulerConfig
    fingerprint: dict[str, Any]  # architecture identity, for the compile cache (never the weights)
    num_classes: int | None = None  # class-conditional models: number of real classes
    null_class: int | None = None  # the "no class" label for classifier-free guidance
    labels: tuple[str, ...] = ()  # human names of the classes, index = label
    defaults: dict[str, Any] = field(default_factory=dict)  # sampler / steps / guidance
    dtype: str = "float32"
    layout: str = "NCHW"  # layout of user-facing arrays (noise); the engine is NHWC inside
    compiler: Any = None  # preheat.cache's compiler; None = compile in memory only
    last: Timings = field(default_factory=Timings)
    _executables: dict[Signature, Any] = field(default_factory=dict, repr=False)

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_denoiser(cls, fn: Denoiser, params: Any, sample_shape: Sequence[int],
                      scheduler_config: dict[str, Any] | SchedulerConfig | str | Path, *,
                      num_classes: int | None = None, null_class: int | None = None,
                      name: str | None = None, layout: str = "NHWC", **defaults: Any) -> "Pipeline":
        """Bring your own denoiser: ``fn(params, x, t, class_labels) -> prediction``.

        ``sample_shape`` is one sample's shape in ``layout`` ("NHWC", the Flax convention, or
        "NCHW"); ``fn`` sees arrays in that layout. ``name`` identifies the architecture in
        the compile cache (default: the function's qualified name).
        """
        if layout not in ("NHWC", "NCHW"):
            raise InvalidArgumentError(f"layout={layout!r} is not supported; use 'NHWC' or 'NCHW'")
        shape = tuple(int(s) for s in sample_shape)
        if len(shape) != 3 or min(shape) <= 0:
            raise InvalidArgumentError(f"sample_shape={tuple(sample_shape)} must be three positive ints (one image)")
        apply = fn
        if layout == "NCHW":
            shape = (shape[1], shape[2], shape[0])

            def apply(p, x, t, y):  # the engine is NHWC inside
                return jnp.transpose(fn(p, jnp.transpose(x, (0, 3, 1, 2)), t, y), (0, 2, 3, 1))

        leaves = jax.tree.leaves(params)
        dtype = str(leaves[0].dtype) if leaves else "float32"
        fingerprint = {"kind": "denoiser", "name": name or f"{fn.__module__}.{fn.__qualname__}",
                       "sample_shape": list(shape), "layout": layout}
        return cls(apply=apply, params=params, sample_shape=shape,
                   scheduler_config=_scheduler_config(scheduler_config), fingerprint=fingerprint,
                   num_classes=num_classes, null_class=null_class, defaults=defaults, dtype=dtype,
                   layout=layout)

    # ------------------------------------------------------------------ sampling

    def __call__(self, n: int = 1, *, class_labels: Any = None, steps: int | None = None,
                 sampler: str | None = None, guidance: float | None = None, seed: int | Sequence[int] = 0,
                 noise: Any = None, eta: float = 0.0) -> list:
        """Sample ``n`` images; returns ``list[PIL.Image]``. ``seed``: an int (image i gets
        ``seed + i``) or one seed per image."""
        from PIL import Image

        pixels = self.generate(n, class_labels=class_labels, steps=steps, sampler=sampler,
                               guidance=guidance, seed=seed, noise=noise, eta=eta)
        mode = {1: "L", 3: "RGB", 4: "RGBA"}.get(pixels.shape[-1])
        if mode is None:
            raise InvalidArgumentError(f"cannot make images from {pixels.shape[-1]} channels; use generate() for arrays")
        return [Image.fromarray(p[..., 0] if mode == "L" else p, mode) for p in pixels]

    def generate(self, n: int = 1, *, class_labels: Any = None, steps: int | None = None,
                 sampler: str | None = None, guidance: float | None = None, seed: int | Sequence[int] = 0,
                 noise: Any = None, eta: float = 0.0) -> np.ndarray:
        """Like ``__call__`` but returns uint8 pixels, (n, H, W, C)."""
        sig, args = self.prepare(n, class_labels=class_labels, steps=steps, sampler=sampler,
                                 guidance=guidance, seed=seed, noise=noise, eta=eta)
        executable = self.executable(sig, args)
        start = time.perf_counter()
        try:
            out = np.asarray(executable(*args))
        except jax.errors.JaxRuntimeError as exc:
            if self.last.cache_layer != "aot" or self.compiler is None:
                raise
            # A cached executable that loads but fails to run (seen on XLA:CPU: "Function ... not
            # found") is a bad entry like any other: quarantine it, compile, run again.
            self.compiler.reject(self, sig, args, f"failed on its first run: {str(exc)[:200]}")
            self._executables.pop(sig, None)
            executable = self.executable(sig, args)
            start = time.perf_counter()
            out = np.asarray(executable(*args))
        self.last.run_s = time.perf_counter() - start
        return out

    def prepare(self, n: int = 1, *, class_labels: Any = None, steps: int | None = None,
                sampler: str | None = None, guidance: float | None = None, seed: int | Sequence[int] = 0,
                noise: Any = None, eta: float = 0.0) -> tuple[Signature, tuple]:
        """Validate a call and turn it into (static signature, runtime arguments)."""
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n <= 0:
            raise InvalidArgumentError(f"n={n!r} must be a positive int")
        n = int(n)
        sampler = sampler or self.defaults.get("sampler", "ddpm")
        if sampler not in SAMPLERS:
            raise SchedulerConfigError(f"unknown sampler {sampler!r}; supported: {', '.join(SAMPLERS)}")
        steps = self.defaults.get("steps", 50) if steps is None else steps
        if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps <= 0:
            raise InvalidArgumentError(f"steps={steps!r} must be a positive int")
        spec = make_spec(self.scheduler_config, sampler)
        plan = make_plan(self.scheduler_config, sampler, int(steps), eta=eta)
        labels = self._labels(n, class_labels)
        guided, scale = self._guidance(guidance)
        seeds = self._seeds(n, seed)
        user_noise = noise is not None
        noise_arr = self._noise(n, noise) if user_noise else np.zeros((), np.float32)
        sig = Signature(spec=spec, batch=n, sample_shape=self.sample_shape, dtype=self.dtype, guided=guided,
                        user_noise=user_noise, class_conditional=self.num_classes is not None)
        args = (self.params, plan, seeds, labels, np.float32(scale), noise_arr)
        return sig, args

    def executable(self, sig: Signature, args: tuple) -> Callable[..., Any]:
        """The compiled program for ``sig``: from memory, the compile cache, or a fresh compile."""
        hit = self._executables.get(sig)
        if hit is not None:
            self.last = Timings(cache_layer="memory")
            return hit
        program = build_program(sig, self.apply, self.null_class)
        if self.compiler is not None:
            compiled, timings = self.compiler.get_or_compile(self, sig, program, args)
        else:
            start = time.perf_counter()
            lowered = jax.jit(program).lower(*args)
            traced = time.perf_counter()
            compiled = lowered.compile()
            timings = Timings(trace_lower_s=traced - start, compile_s=time.perf_counter() - traced, cache_layer="none")
        self.last = timings
        self._executables[sig] = compiled
        return compiled

    # ------------------------------------------------------------------ argument checks

    def _labels(self, n: int, class_labels: Any) -> np.ndarray:
        if self.num_classes is None:
            if class_labels is not None:
                raise InvalidArgumentError("class_labels given, but this model is not class-conditional")
            return np.zeros((n,), np.int32)
        if class_labels is None:
            return (np.arange(n) % self.num_classes).astype(np.int32)  # a tour of the classes
        if isinstance(class_labels, (int, str, np.integer)):
            class_labels = [class_labels] * n
        class_labels = list(class_labels)
        if len(class_labels) != n:
            raise InvalidArgumentError(f"got {len(class_labels)} class_labels for n={n}; give one per image or one for all")
        return np.asarray([self.class_index(c) for c in class_labels], np.int32)

    def class_index(self, c: Any) -> int:
        """A class given as an index or a label name -> its index; unknown -> one-line error."""
        if self.num_classes is None:
            raise InvalidArgumentError("this model is not class-conditional")
        if isinstance(c, str):
            if c in self.labels:
                return self.labels.index(c)
            if c.strip().lstrip("-").isdigit():
                c = int(c)
            else:
                raise InvalidArgumentError(f"unknown class {c!r}; known classes: {', '.join(self.labels) or f'0..{self.num_classes - 1}'}")
        if isinstance(c, bool) or not isinstance(c, (int, np.integer)) or not 0 <= int(c) < self.num_classes:
            raise InvalidArgumentError(f"unknown class {c!r}; classes are 0..{self.num_classes - 1}")
        return int(c)

    def is_guided(self, guidance: float | None = None) -> bool:
        """Whether a call with this ``guidance`` (None = the model's default) runs guided."""
        return self._guidance(guidance)[0]

    def _guidance(self, guidance: float | None) -> tuple[bool, float]:
        g = self.defaults.get("guidance") if guidance is None else guidance
        if g is None:
            return False, 1.0
        try:
            g = float(g)
        except (TypeError, ValueError):
            raise InvalidArgumentError(f"guidance={guidance!r} must be a number") from None
        if not np.isfinite(g) or g < 0:
            raise InvalidArgumentError(f"guidance={g} must be a finite number >= 0")
        if g == 1.0:
            return False, 1.0
        if self.null_class is None:
            raise InvalidArgumentError(
                f"guidance={g} needs a class-conditional model with a null class; this model has none (use guidance=1)")
        return True, g

    @staticmethod
    def _seeds(n: int, seed: int | Sequence[int]) -> np.ndarray:
        if isinstance(seed, (int, np.integer)) and not isinstance(seed, bool):
            seeds = [int(seed) + i for i in range(n)]
        elif isinstance(seed, (list, tuple, np.ndarray)):
            seeds = [int(s) for s in seed]
            if len(seeds) != n:
                raise InvalidArgumentError(f"got {len(seeds)} seeds for n={n}; give one int or one per image")
        else:
            raise InvalidArgumentError(f"seed={seed!r} must be an int or a list of ints")
        if any(not 0 <= s < 2**32 for s in seeds):
            raise InvalidArgumentError(f"seeds must be in [0, 2**32); got {min(seeds)}..{max(seeds)}")
        return np.asarray(seeds, np.uint32)

    def _noise(self, n: int, noise: Any) -> np.ndarray:
        arr = np.asarray(noise, dtype=np.float32)
        h, w, c = self.sample_shape
        want = (n, c, h, w) if self.layout == "NCHW" else (n, h, w, c)
        if arr.shape != want:
            raise InvalidArgumentError(f"noise has shape {arr.shape}, expected {want} ({self.layout}, n={n})")
        return arr.transpose(0, 2, 3, 1) if self.layout == "NCHW" else arr


def _scheduler_config(source: dict[str, Any] | SchedulerConfig | str | Path) -> SchedulerConfig:
    if isinstance(source, SchedulerConfig):
        return source
    if isinstance(source, dict):
        return SchedulerConfig.from_dict(source)
    path = Path(source)
    if path.is_dir():
        path = path / "scheduler_config.json"
    if not path.is_file():
        raise ModelNotFoundError(f"scheduler config {path} does not exist")
    return SchedulerConfig.from_file(path)


def _find_scheduler(root: Path, unet_dir: Path) -> Path:
    for candidate in (root / "scheduler" / "scheduler_config.json", root / "scheduler_config.json",
                      unet_dir / "scheduler_config.json"):
        if candidate.is_file():
            return candidate
    raise ModelNotFoundError(
        f"{root} has no scheduler/scheduler_config.json; pass scheduler=PATH for a bare UNet folder")


def make_compiler(cache: str | None = None) -> Any:
    """The compile cache for this process: ``cache`` (or ``$PREHEAT_CACHE``) is "full" (default),
    "xla" (JAX's persistent cache only) or "off". Configures JAX's cache before any compile."""
    import os

    mode = cache or os.environ.get("PREHEAT_CACHE", "full")
    if mode not in ("full", "xla", "off"):
        raise InvalidArgumentError(f"cache mode {mode!r} is not supported; use full, xla or off")
    if mode == "off":
        return None
    from preheat.cache.compile import JaxCompiler

    return JaxCompiler(mode=mode)


def load(model: str | Path | None = None, *, scheduler: Any = None, dtype: Any = "float32",
         cache: str | None = None, backend: str = "jax", compile: str = "none") -> Pipeline:
    """A sampling ``Pipeline`` for ``model``; ``None`` = the built-in model.

    ``model``: a diffusers-format folder, or a source for the weights store (``hf://org/repo[@rev]``,
    an ``http(s)://`` tarball), read from the store with no network once pulled.

    ``scheduler``: a scheduler_config.json path or dict, for a bare UNet folder without one.
    ``cache``: "full" (default), "xla" or "off"; see :func:`make_compiler`.
    ``backend="torch"`` returns a ``TorchPipeline`` (same call API) running diffusers' own UNet and
    schedulers, with ``compile`` = "none" (eager), "inductor" (torch.compile) or "aot" (AOTInductor).
    """
    if backend == "torch":
        from preheat.backends.torch import load as load_torch

        return load_torch(model, compile=compile, dtype=dtype, scheduler=scheduler, cache=cache)
    if backend != "jax":
        raise InvalidArgumentError(f"backend={backend!r} is not supported; use 'jax' or 'torch'")
    if compile != "none":
        raise InvalidArgumentError(f"compile={compile!r} applies to backend='torch'; the JAX loop is always compiled")
    from preheat.models.folders import image_size, pipeline_extras
    from preheat.models.loading import load_unet, resolve_unet_dir

    compiler = make_compiler(cache)  # first: JAX's cache must be configured before anything compiles

    from preheat.store import resolve

    # A local folder as it is; http(s):// and hf:// sources from the weights store (pulled once).
    root = BUILTIN_MODEL if model is None else resolve(str(model))
    unet_dir = resolve_unet_dir(root)
    sched = _scheduler_config(scheduler if scheduler is not None else _find_scheduler(root, unet_dir))
    unet = load_unet(unet_dir, dtype=jnp.dtype(dtype))
    cfg = unet.config
    extra = pipeline_extras(root)
    h, w = image_size(cfg.sample_size, unet_dir)
    num_classes = None
    null_class = extra.get("null_class")
    if cfg.num_class_embeds is not None and cfg.class_embed_type is None:
        num_classes = cfg.num_class_embeds - (1 if null_class is not None else 0)
    labels = tuple(extra.get("labels", ()))
    fingerprint = {"kind": "unet2d", "config": cfg.architecture_dict(), "sample_size": [h, w]}
    return Pipeline(apply=unet.apply, params=unet.params, sample_shape=(h, w, cfg.in_channels),
                    scheduler_config=sched, fingerprint=fingerprint, num_classes=num_classes,
                    null_class=null_class, labels=labels, defaults=dict(extra.get("defaults", {})),
                    dtype=str(jnp.dtype(dtype)), layout="NCHW", compiler=compiler)
