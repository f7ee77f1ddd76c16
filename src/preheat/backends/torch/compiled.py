"""``preheat.torch.compile``: torch.compile around code people already have, with hot restarts.

    pipe = FluxPipeline.from_pretrained(...).to("cuda")
    preheat.torch.compile(pipe)                   # regional; the same object, compiled in place
    image = pipe(prompt).images[0]                # first call: preheat's entry loaded, or compiled and stored

What is compiled (``mode``):

    regional  the repeated blocks of each denoiser (``transformer``, ``unet``, ...): the classes
              the model declares in ``_repeated_blocks`` (diffusers' ``compile_repeated_blocks``),
              else the classes found repeated in its ``nn.ModuleList`` s (SD3, PixArt): every
              instance shares one compiled graph, so cold compiles are several times shorter.
    full      the denoiser's whole forward.
    aot       every repeated block runs an AOTInductor package built without its weights (no
              Dynamo, no Inductor at run time; one package per block structure and input
              signature, shared by all its instances and by every fine-tune).

Where the artifacts come from: the denoiser's ``forward`` is wrapped, outside anything
compiled, by a gate that knows each input signature it has seen. The first call at a new
signature runs through ``TorchCompiler.warm_inductor``: preheat's entry for that key (Mega-Cache
artifacts + CPU kernels) is loaded before the call, or, on a miss, the call compiles and the
artifacts are stored after it. Later calls at a seen signature go straight to the compiled code.

The key (``torch_key_fields``): the module's class, config (or structure), parameter names /
shapes / dtypes and the source of its classes (never the weights), torch / CUDA / triton /
diffusers versions, device (GPU kind; CPU model, instruction sets, threads), the compile options
(scope, regions, dynamic, duck shapes), Inductor settings changed from torch's defaults, and the
input signature (tensor shapes, dtypes, devices, layouts; scalar values; grad and train mode).

Shapes: ``dynamic=False`` (default) compiles one static graph per resolution and batch, each
its own entry: no surprise recompiles once the served sizes are warm, and the cheaper restart
for the few sizes a server warms up. ``dynamic=True`` compiles symbolic shapes with duck shapes
off (``use_duck_shape`` patched to False around every call, so equal sizes are not tied to each
other); sizes other than 0 and 1 then share one entry, and no new size ever compiles. Measured
both ways by ``benchmarks/shapes.py`` (docs/benchmarks.md, issue 14): on the tiny Flux
and SD 1.x, dynamic's one compile is 1.2-1.3x a static one, each further static size 7-15 s,
and a dynamic warm first call 1.9-2.8x a static one (each block traced twice: a width equal to
a weight's size is specialised after a restart).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import threading
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from preheat.backends.torch.compile_cache import INDUCTOR_OPTIONS, TorchCompiler, make_compiler, torch_key_fields
from preheat.errors import InvalidArgumentError
from preheat.timings import Timings

__all__ = ["compile", "events", "region_classes", "MODES", "DENOISERS"]

MODES = ("regional", "full", "aot")
# The pipeline components that run once per step (what is worth compiling), in diffusers' names.
DENOISERS = ("transformer", "transformer_2", "unet", "prior")


def compile(target: Any, mode: str = "regional", *, dynamic: bool = False, cache: str | None = None) -> Any:
    """Compile ``target`` (a diffusers pipeline or any ``nn.Module``) in place and return it.

    ``mode``: "regional" (the repeated blocks), "full" (the whole denoiser forward) or "aot"
    (an AOTInductor package per repeated block, without weights).
    ``dynamic``: symbolic shapes (duck shapes off) instead of one graph per input size.
    ``cache``: "full" (default: preheat's entries), "local" (torch's own caches only) or "off";
    ``$PREHEAT_CACHE`` when not given. Compiling an already compiled target again with the same
    settings is a no-op; with other settings it is an error.
    """
    if mode not in MODES:
        raise InvalidArgumentError(f"mode={mode!r} is not supported; use 'regional', 'full' or 'aot'",
                                   argument="mode")
    if not isinstance(dynamic, bool):
        raise InvalidArgumentError(f"dynamic={dynamic!r} must be True or False", argument="dynamic")
    if mode == "aot" and dynamic:
        raise InvalidArgumentError("mode='aot' builds static-shape packages; use dynamic=False", argument="dynamic")
    return compile_with(target, mode, dynamic, make_compiler(cache))


def compile_with(target: Any, mode: str, dynamic: bool, compiler: TorchCompiler) -> Any:
    """``compile`` with a given ``TorchCompiler`` (the torch pipelines share theirs). ``aot`` of a
    denoiser holding GGUF weights (``gguf_weight``) is refused in one line before any is touched:
    the export takes each as a plain tensor of its packed bytes and fails at the first call."""
    denoisers = _denoisers(target)
    for module in denoisers if mode == "aot" else ():
        found = gguf_weight(module)
        if found is not None:
            from preheat.file_configs import refuse_gguf_aot

            refuse_gguf_aot(f"{type(module).__name__} holds GGUF-quantised weights ({found[0]} is {found[1]})",
                            "mode", "mode='regional' or 'full', which trace the dequantisation")
    for module in denoisers:
        _install(module, mode, dynamic, compiler)
    return target


def events(target: Any) -> list[dict[str, Any]]:
    """One dict per compile or cache load so far (key, layer, miss / quarantine reason, store
    result, timings), for every compiled denoiser of ``target``."""
    compilers = {id(gate.compiler): gate.compiler for module in _denoisers(target)
                 if (gate := getattr(module, "_preheat_gate", None)) is not None}  # denoisers may share one
    return [event for compiler in compilers.values() for event in compiler.events]


def region_classes(module: torch.nn.Module) -> list[str]:
    """The class names compiled by mode="regional": ``_repeated_blocks`` where the model declares
    them, else the class of every ``nn.ModuleList`` whose children (two or more) all share one
    class, keeping only the outermost (a block inside another chosen block is traced with it)."""
    declared = [str(name) for name in (getattr(module, "_repeated_blocks", None) or ())]
    if declared:
        return declared
    found: list[str] = []
    for sub in module.modules():
        if isinstance(sub, torch.nn.ModuleList) and len(sub) >= 2:
            kinds = {type(child) for child in sub}
            if len(kinds) == 1 and type(sub[0]).__name__ not in found:
                found.append(type(sub[0]).__name__)
    nested = set()
    for sub in module.modules():
        if type(sub).__name__ in found:
            nested |= {type(inner).__name__ for inner in list(sub.modules())[1:]}
    return [name for name in found if name not in nested]


# ---------------------------------------------------------------------------------------------


def _denoisers(target: Any) -> list[torch.nn.Module]:
    if isinstance(target, torch.nn.Module):
        return [target]
    components = getattr(target, "components", None)
    if isinstance(components, dict):
        found = [components[name] for name in DENOISERS if isinstance(components.get(name), torch.nn.Module)]
        if found:
            return found
        raise InvalidArgumentError(f"{type(target).__name__} has no denoiser to compile (none of "
                                   f"{', '.join(DENOISERS)}); pass the module itself")
    raise InvalidArgumentError(f"cannot compile a {type(target).__name__}: pass a diffusers pipeline or a torch.nn.Module")


def _install(module: torch.nn.Module, mode: str, dynamic: bool, compiler: TorchCompiler) -> None:
    previous = getattr(module, "_preheat_gate", None)
    if previous is not None:
        if (previous.scope, previous.dynamic) != (mode, dynamic):
            raise InvalidArgumentError(f"{type(module).__name__} is already compiled with mode={previous.scope!r}, "
                                       f"dynamic={previous.dynamic}; load it again to compile it differently")
        return
    if mode == "aot":
        _install_aot(module, compiler)
        return
    options = {**INDUCTOR_OPTIONS, "dynamic": dynamic}
    try:  # one graph per shape and block kind; allow many before Dynamo gives up
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    except AttributeError:  # pragma: no cover - older torch
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    forward = module.forward
    regions: list[str] = []
    explain = compiler.explains  # compile nothing: the gate only says whether an entry would serve
    if mode == "regional":
        regions = region_classes(module)
        blocks = [sub for sub in module.modules() if type(sub).__name__ in regions]
        if not blocks:
            raise InvalidArgumentError(f"mode='regional': {type(module).__name__} has no repeated blocks (no "
                                       "_repeated_blocks, no nn.ModuleList of one class); use mode='full'",
                                       argument="mode")
        for block in blocks if not explain else ():
            block.compile(**options)
    elif not explain:
        forward = torch.compile(forward, **options)
    key_options = {**options, "scope": mode, "regions": regions, "duck_shape": not dynamic}
    gate = _Gate(forward=forward, fingerprint=module_fingerprint(module), options=key_options, compiler=compiler,
                 scope=mode, dynamic=dynamic, module=module)
    module._preheat_gate = gate
    module.forward = gate  # an instance attribute: nn.Module.__call__ (and its hooks) reach it


@dataclass(eq=False)
class _Gate:
    """The denoiser's forward: the first call at each input signature goes through preheat's cache."""

    forward: Callable[..., Any]  # the original forward (scope "full": torch.compile'd)
    fingerprint: dict[str, Any]
    options: dict[str, Any]
    compiler: TorchCompiler
    scope: str
    dynamic: bool
    module: torch.nn.Module
    last: Timings = field(default_factory=Timings)  # of the last compile or cache load
    warm: set = field(default_factory=set, repr=False)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        shapes = {"args": signature(list(args), self.dynamic), "kwargs": signature(kwargs, self.dynamic),
                  "grad": torch.is_grad_enabled(), "training": self.module.training}
        text = json.dumps(shapes, sort_keys=True, default=str)
        if text in self.warm:
            return self._run(args, kwargs)
        with self.lock:  # one compile (and one entry) per signature, even from several threads
            if text in self.warm:
                return self._run(args, kwargs)
            out: list[Any] = []
            fields = torch_key_fields(self.fingerprint, mode="inductor", dtype=_param_dtype(self.module),
                                      device=_device_of(self.module, args, kwargs), shapes=json.loads(text),
                                      options=self.options)
            if self.compiler.explains:
                self.compiler.explain(fields)
                self.warm.add(text)
                return self._run(args, kwargs)
            self.last = self.compiler.warm_inductor(fields, lambda: out.append(self._run(args, kwargs)))
            self.warm.add(text)
            return out[-1]

    def _run(self, args: tuple, kwargs: dict[str, Any]) -> Any:
        if not self.dynamic:
            return self.forward(*args, **kwargs)
        import torch.fx.experimental._config as fx_config

        with fx_config.patch(use_duck_shape=False):
            return self.forward(*args, **kwargs)


def _install_aot(module: torch.nn.Module, compiler: TorchCompiler) -> None:
    """Each repeated block runs an AOTInductor package (no Dynamo, no Inductor at run time),
    built without weights: one package per block structure and input signature, shared by every
    instance (each binds its own parameters) and by every fine-tune of the architecture."""
    regions = region_classes(module)
    blocks = [sub for sub in module.modules() if type(sub).__name__ in regions]
    if not blocks:
        raise InvalidArgumentError(f"mode='aot': {type(module).__name__} has no repeated blocks (no "
                                   "_repeated_blocks, no nn.ModuleList of one class)", argument="mode")
    gate = _AotGate(compiler=compiler, scope="aot", dynamic=False, regions=regions)
    for block in blocks:
        block.forward = _AotBlock(block, gate)
    module._preheat_gate = gate


def gguf_weight(module: torch.nn.Module) -> tuple[str, str] | None:
    """The first parameter of ``module`` that diffusers' GGUF quantizer holds (a ``GGUFParameter``:
    ``from_single_file(..., quantization_config=GGUFQuantizationConfig(...))``), as (name, GGML
    type), or None. No such parameter exists unless diffusers' GGUF module was imported, so a
    module without one costs no import (and needs no ``gguf``)."""
    import sys

    utils = sys.modules.get("diffusers.quantizers.gguf.utils")
    if utils is None:
        return None
    for name, param in module.named_parameters():
        if isinstance(param, utils.GGUFParameter):
            kind = getattr(param.quant_type, "name", param.quant_type)
            return name, str(kind)
    return None


@dataclass(eq=False)
class _AotGate:
    """What ``events`` and a second ``compile`` read for mode="aot" (the blocks do the work)."""

    compiler: TorchCompiler
    scope: str
    dynamic: bool
    regions: list[str]
    last: Timings = field(default_factory=Timings)


class _AotBlock:
    """A block's forward: its AOTInductor runner for each input signature, from preheat's entry
    or exported, compiled and stored on first sight."""

    def __init__(self, block: torch.nn.Module, gate: _AotGate):
        self.block = block
        self.gate = gate
        self.fingerprint = module_fingerprint(block)
        self.runners: dict[str, Any] = {}
        self.lock = threading.Lock()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        shapes = {"args": signature(list(args)), "kwargs": signature(kwargs), "grad": torch.is_grad_enabled(),
                  "training": self.block.training}
        text = json.dumps(shapes, sort_keys=True, default=str)
        runner = self.runners.get(text)
        if runner is None:
            with self.lock:
                runner = self.runners.get(text) or self._prepare(text, args, kwargs)
        return runner(*args, **kwargs)

    def _prepare(self, text: str, args: tuple, kwargs: dict[str, Any]) -> Any:
        from preheat.backends.torch.compile_cache import AOT_EXPORT_OPTIONS, AOT_INDUCTOR_CONFIGS

        block = self.block
        fields = torch_key_fields(self.fingerprint, mode="aot", dtype=_param_dtype(block),
                                  device=_device_of(block, args, kwargs), shapes=json.loads(text),
                                  options={**AOT_INDUCTOR_CONFIGS, **AOT_EXPORT_OPTIONS, "scope": "aot",
                                           "regions": self.gate.regions})
        if self.gate.compiler.explains:
            self.gate.compiler.explain(fields)
            runner = self.runners[text] = type(block).forward.__get__(block)  # eager: explain compiles nothing
            return runner
        constants = {**dict(block.named_parameters()), **dict(block.named_buffers())}
        wrapper = block.__dict__.pop("forward")  # export the class's own forward, not this wrapper
        try:
            runner, timings = self.gate.compiler.load_or_build_aot(fields, block, args, constants, kwargs)
        finally:
            block.forward = wrapper
        self.gate.last = timings
        self.runners[text] = runner
        return runner


def signature(value: Any, dynamic: bool = False) -> Any:
    """What a compiled graph depends on in one argument, as JSON: tensors by shape (``dynamic``:
    sizes other than 0 and 1 as "s", as Dynamo specialises 0 and 1), dtype, device and layout;
    plain scalars by value; containers element by element; other objects by type."""
    if isinstance(value, torch.Tensor):
        shape = [int(s) if not dynamic or s in (0, 1) else "s" for s in value.shape]
        out: dict[str, Any] = {"shape": shape, "dtype": str(value.dtype).removeprefix("torch."),
                               "device": str(value.device)}
        if not value.is_contiguous():
            out["stride"] = [int(s) if not dynamic else "s" for s in value.stride()]
        if value.requires_grad:
            out["requires_grad"] = True
        return out
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [signature(v, dynamic) for v in value]
    if isinstance(value, dict):
        return {str(k): signature(v, dynamic) for k, v in value.items()}
    return {"type": f"{type(value).__module__}.{type(value).__qualname__}"}


def module_fingerprint(module: torch.nn.Module) -> dict[str, Any]:
    """The architecture (never the weights): class, config, parameter names/shapes/dtypes and
    the source of every non-torch class in the module tree."""
    cls = type(module)
    params = hashlib.sha256()
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        params.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
    code = hashlib.sha256()
    for kind in sorted({type(m) for m in module.modules()}, key=lambda c: f"{c.__module__}.{c.__qualname__}"):
        if kind.__module__.startswith("torch."):
            continue
        code.update(f"{kind.__module__}.{kind.__qualname__}".encode())
        code.update(_source_file_hash(kind).encode())
    fingerprint: dict[str, Any] = {"kind": f"{cls.__module__}.{cls.__qualname__}",
                                   "parameters": params.hexdigest()[:16], "code": code.hexdigest()[:16]}
    config = getattr(module, "config", None)
    if isinstance(config, dict):
        fingerprint["config"] = {k: v for k, v in dict(config).items() if not str(k).startswith("_")}
    return json.loads(json.dumps(fingerprint, default=str))


@functools.lru_cache(maxsize=None)
def _file_hash(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _source_file_hash(kind: type) -> str:
    """The hash of the whole file that defines ``kind`` (read once per process): any change to
    the class, or to the helpers beside it that it may call, changes the key. Hashing the file
    rather than ``inspect.getsource(kind)`` keeps this to a read: getsource tokenizes the file
    per class (seconds for diffusers' large model files on a loaded machine, at every start).
    Classes without a source file: their name (and the library's version) stands."""
    try:
        path = inspect.getsourcefile(kind)
        return _file_hash(path) if path else ""
    except (OSError, TypeError):
        return ""


def _param_dtype(module: torch.nn.Module) -> str:
    for p in module.parameters():
        if p.is_floating_point():
            return str(p.dtype).removeprefix("torch.")
    return "none"


def _device_of(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> torch.device:
    for p in module.parameters():
        return p.device
    for value in [*args, *kwargs.values()]:
        if isinstance(value, torch.Tensor):
            return value.device
    return torch.device("cpu")
