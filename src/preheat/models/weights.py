"""Placing a checkpoint's tensors into an abstract NNX model, for every model family.

One loader serves every component (UNet, CLIP text encoder, VAE, ...): the module is built
abstractly (``build_abstract``: constructed directly, each parameter made by ``param`` as its shape
only; no initialiser runs, no FLOPs, no memory), then each parameter leaf is filled from the
checkpoint tensor whose key is the leaf's path, converted from torch layout.
Nothing is returned until every tensor has been checked, so a bad checkpoint never yields a
half-loaded model. Finding and reading the files (safetensors headers, a lazy ``Checkpoint``)
is ``preheat.models.safetensors_files``'s.

Key convention (the parameter path *is* the checkpoint key, modulo the leaf name)::

    kernel -> weight (transposed: conv OIHW -> HWIO, linear (out, in) -> (in, out))
    scale -> weight, embedding -> weight, bias -> bias, weight -> weight

Loading streams (issue 13: Flux-dev is 24 GB of bf16 plus T5-XXL, and must never sit on the host
twice): ``read_tensors`` parses only the safetensors headers and returns a lazy ``Checkpoint``;
``fill`` checks every key, shape and dtype against those headers first (a bad checkpoint fails
before a byte of tensor data is read), then reads one tensor at a time in file order, casts it,
and puts it on the device before reading the next. Beyond what is already on the device, the
host holds about one tensor (two while it is cast or transposed) plus the transfers still in
flight (bounded by ``IN_FLIGHT_BYTES``). Each fill is measured (``LoadReport``); ``recording()``
collects the reports of a whole pipeline load (both in ``preheat.models.load_report``).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Container, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from preheat.errors import UnsupportedConfigError, WeightsError
from preheat.models.load_report import LoadReport, PeakWindow
from preheat.models.load_report import record as record_load
from preheat.models.ggml import LAYOUTS
from preheat.models.gguf_file import packed_weights
from preheat.models.quantised import FLOAT8, Packed, Quantised, holds, int8_scale_shape, is_low, quantise_int8
from preheat.models.safetensors_files import Checkpoint
from preheat.models.scaled_fp8 import dequantise, ignored, scale_of, scale_shape, weight_scales

__all__ = [
    "IN_FLIGHT_BYTES",
    "torch_key",
    "to_jax_layout",
    "to_torch_layout",
    "expected_torch_shape",
    "fill",
    "DeferredFills",
    "LoadOptions",
    "DEFAULT_OPTIONS",
    "dtype_plan",
    "after_reads",
    "build_abstract",
    "param",
    "check_dtype",
]

_LEAF_TO_TORCH = {"kernel": "weight", "scale": "weight", "embedding": "weight", "bias": "bias", "weight": "weight"}

IN_FLIGHT_BYTES = 256 << 20
"""Host bytes that may wait on asynchronous host-to-device transfers before ``fill`` blocks."""




def torch_key(path: tuple[Any, ...]) -> str:
    """NNX parameter path -> torch state-dict key."""
    *mods, leaf = (str(p) for p in path)
    return ".".join([*mods, _LEAF_TO_TORCH[leaf]])


def _changes_layout(leaf: str, ndim: int) -> bool:
    return leaf == "kernel" and ndim in (2, 4)


def to_jax_layout(arr: np.ndarray, leaf: str) -> np.ndarray:
    if leaf == "kernel" and arr.ndim == 4:  # conv: (O, I, kH, kW) -> (kH, kW, I, O)
        return arr.transpose(2, 3, 1, 0)
    if leaf == "kernel" and arr.ndim == 2:  # linear: (out, in) -> (in, out)
        return arr.T
    return arr


def to_torch_layout(arr: np.ndarray, leaf: str) -> np.ndarray:
    if leaf == "kernel" and arr.ndim == 4:  # (kH, kW, I, O) -> (O, I, kH, kW)
        return arr.transpose(3, 2, 0, 1)
    if leaf == "kernel" and arr.ndim == 2:
        return arr.T
    return arr


def expected_torch_shape(shape: tuple[int, ...], leaf: str) -> tuple[int, ...]:
    if leaf == "kernel" and len(shape) == 4:
        kh, kw, i, o = shape
        return (o, i, kh, kw)
    if leaf == "kernel" and len(shape) == 2:
        return (shape[1], shape[0])
    return tuple(shape)


class OneKey:
    """Stands in for ``nnx.Rngs`` in an abstract build: the same key for every initialiser.

    ``nnx.Rngs`` bumps a counter Variable per draw, which costs time in an abstract build; values
    are never computed there (``param``), and preheat's models draw only ``rngs.params()`` (no
    dropout streams).
    """

    def __init__(self) -> None:
        self.key: jax.Array | None = None  # made on the first draw: an abstract build never draws

    def params(self) -> jax.Array:
        if self.key is None:
            self.key = jax.random.key(0)
        return self.key


_ABSTRACT = threading.local()


def param(shape: tuple[int, ...], init: Callable[[], jax.Array]) -> nnx.Param:
    """A float32 parameter of ``shape``: ``init()`` when a model is made for real, a
    ``jax.ShapeDtypeStruct`` in an abstract build (``build_abstract``), where nothing is computed.

    Why not ``nnx.eval_shape``: it traces every initialiser (random draws, scaling, zeros) into a
    jaxpr, about 3 ms a parameter: more than reading the weights of a small UNet."""
    if getattr(_ABSTRACT, "active", False):
        return nnx.Param(jax.ShapeDtypeStruct(tuple(shape), jnp.float32))
    return nnx.Param(init())


def build_abstract(make: Callable[[Any], nnx.Module]) -> tuple[nnx.GraphDef, nnx.State]:
    """Graph definition and a State of ShapeDtypeStructs of ``make(rngs)``; no FLOPs, no memory.

    The module is constructed directly, its parameters made by ``param`` as shapes only; a
    parameter made otherwise (a concrete array) is turned into its shape here."""
    t0 = time.perf_counter()
    previous = getattr(_ABSTRACT, "active", False)
    _ABSTRACT.active = True
    try:
        model = make(OneKey())
    finally:
        _ABSTRACT.active = previous
    graphdef, state = nnx.split(model)
    state = jax.tree.map(lambda x: x if isinstance(x, jax.ShapeDtypeStruct) else jax.ShapeDtypeStruct(x.shape, x.dtype),
                         state)
    record_load(abstract_s=time.perf_counter() - t0)
    return graphdef, state


def _meta(tensors: Mapping[str, Any], key: str) -> tuple[tuple[int, ...], np.dtype] | None:
    if isinstance(tensors, Checkpoint):
        return tensors.meta(key)
    arr = tensors.get(key)
    return None if arr is None else (tuple(arr.shape), np.dtype(arr.dtype))


class _Scratch:
    """Two reusable host buffers (raw bytes, cast result) for tensors that are copied again on their
    way to the device. Reusing them saves the page faults of fresh memory (most of the cost of a
    host copy) and bounds the host's share to the two largest such tensors."""

    def __init__(self) -> None:
        self._bufs: list[np.ndarray] = [np.empty(0, np.uint8), np.empty(0, np.uint8)]
        self._user: jax.Array | None = None  # the last transfer that read from them

    def take(self, which: int, nbytes: int) -> np.ndarray:
        if self._user is not None:  # never overwrite bytes a transfer may still be reading
            self._user.block_until_ready()
            self._user = None
        if self._bufs[which].nbytes < nbytes:
            self._bufs[which] = np.empty(0, np.uint8)  # drop the old one first
            self._bufs[which] = np.empty(nbytes, np.uint8)
        return self._bufs[which]

    def used_by(self, value: jax.Array) -> jax.Array:
        self._user = value
        return value


def _place(tensors: Mapping[str, Any], key: str, leaf: str, dtype: np.dtype, scratch: _Scratch
           ) -> tuple[jax.Array, int]:
    """One tensor onto the device; returns it and the checkpoint bytes it came from.

    The cast is numpy's (the same rounding as ``jnp.asarray``); the layout change rides on the
    transfer (the runtime copies a strided view, faster than numpy's transpose). A tensor needing
    neither is read into a fresh buffer and donated, so on the CPU backend it becomes the device
    array uncopied; one needing a copy anyway is read into scratch memory.
    """
    info = tensors.info(key) if isinstance(tensors, Checkpoint) else None
    if info is None:  # an in-memory array: the caller's, never donated
        arr = np.asarray(tensors[key])
        host = arr.astype(dtype) if arr.dtype != dtype else arr
        return jax.device_put(to_jax_layout(host, leaf), donate=host is not arr), arr.nbytes
    relayout = _changes_layout(leaf, len(info.shape))
    if info.dtype == dtype and not relayout:
        return jax.device_put(info.read(), donate=True), info.nbytes
    raw = info.read(scratch.take(0, info.nbytes))
    if not relayout:  # a cast only: its fresh result is donated
        return jax.device_put(raw.astype(dtype), donate=True), info.nbytes
    if info.dtype != dtype:
        cast = scratch.take(1, raw.size * dtype.itemsize)[:raw.size * dtype.itemsize].view(dtype).reshape(raw.shape)
        np.copyto(cast, raw, casting="unsafe")
        raw = cast
    return scratch.used_by(jax.device_put(to_jax_layout(raw, leaf))), info.nbytes


class DeferredFills:
    """The tensor reads that ``fill`` queued (``LoadOptions(pending=...)``); ``run`` performs them.

    Why: the compile cache's key needs only the parameters' shapes and dtypes, which are known
    once every header is checked; deferring the reads lets a pipeline start loading its
    executable (``preheat.load(prefetch=...)``) while the weights are read."""

    def __init__(self) -> None:
        self.jobs: list[Callable[[], None]] = []

    def run(self) -> None:
        """Read every queued tensor onto the device, in the order the fills were called; each
        placeholder leaf of the returned States is set in place."""
        jobs, self.jobs = self.jobs, []
        for job in jobs:
            job()


@dataclass(frozen=True)
class LoadOptions:
    """How one load places its weights, passed explicitly from ``preheat.load`` down to ``fill``
    (rather than set around it on the thread, so a loader sees all that changes what it does).

    ``pending``: queue the reads there (``DeferredFills``) instead of reading at once: each leaf
    of the States ``fill`` returns holds a ``jax.ShapeDtypeStruct`` until ``pending.run()``.
    ``weights_dtype``: the storage dtype of the layers a denoiser's loader names (``fill``'s
    ``low``), ``"float8_e4m3fn"`` or ``"int8"`` (per-channel scales, made at load); upcast at use
    (``preheat.models.storage``). None: a
    denoiser's layers the checkpoint stores in fp8 stay fp8 (a scaled fp8 file's with their
    scales), every other weight is placed in the compute dtype. Encoders and VAEs never pass
    ``low`` (their programs do not upcast), so it leaves them be.
    ``weights_layers``: which layers: "layerwise" (diffusers' ``enable_layerwise_casting`` set)
    or "linear" (its Linear layers inside norm modules too: ``storage.layerwise``).
    ``device``: where the weights are placed (None: JAX's default device); the host's CPU for text
    encoders kept and run there (``preheat.load(encoders_on="host")``), so they never reach the chip.
    """

    pending: DeferredFills | None = None
    weights_dtype: str | None = None
    weights_layers: str = "layerwise"
    device: Any = None


DEFAULT_OPTIONS = LoadOptions()


def after_reads(job: Callable[[], None], options: LoadOptions | None = None) -> None:
    """Run ``job`` once the weights ``fill`` was given so far are read: at once, or, with
    ``options.pending``, queued after their reads (e.g. moving an encoder's weights to the host).
    With ``options.device`` the job places what it makes there (JAX's default device for it)."""
    if options is not None and options.device is not None:
        inner, device = job, options.device

        def job() -> None:
            with jax.default_device(device):
                inner()

    if options is not None and options.pending is not None:
        options.pending.jobs.append(job)
    else:
        job()


def fill(abstract: nnx.State, tensors: Mapping[str, np.ndarray], dtype: Any, source: str, *,
         key_fn: Callable[[tuple[Any, ...]], str] = torch_key,
         ignore: Callable[[str], bool] | None = None,
         dtype_for: Callable[[str], Any] | None = None, options: LoadOptions | None = None,
         low: Callable[[str], bool] | None = None) -> nnx.State:
    """Fill ``abstract`` from ``tensors``; every problem is listed in one ``WeightsError``.

    ``tensors``: a ``Checkpoint`` (from ``read_tensors``: streamed, one tensor on the host at a
    time) or any mapping of numpy arrays. Keys, shapes and dtypes are all checked before any tensor
    is read, so a bad checkpoint costs no I/O and nothing half-loaded is returned.
    ``ignore(key)``: checkpoint keys that may be present without a parameter (e.g. buffers such
    as transformers' ``position_ids``). ``dtype_for(key)``: a per-tensor dtype override.
    ``options.pending``: the reads are queued there (``LoadOptions``). ``low(key)``: the tensors
    placed in ``options.weights_dtype`` when that is set (a denoiser's layerwise-cast weights);
    without it, the ones the checkpoint stores in fp8 (``dtype_plan``).
    A scaled checkpoint's weight (``X.weight`` with ``X.scale_weight``: a scaled fp8 file's, or a
    GGUF Q8_0 weight's int8 values and per-block scales) stored and planned compact (fp8, int8)
    is placed as it is stored with its scale, a ``quantised.Quantised`` that the apply expands at
    use; one planned in another dtype (a layer fp8 storage keeps at full precision, an encoder's)
    is dequantised on the host as it is placed. The scales and the marker match no parameter
    (``preheat.models.scaled_fp8``). A GGUF weight of a packed type (``X.weight_Q4_K``: each row's
    blocks, ``preheat.models.gguf_file``) is a Linear's ``X.weight``, always placed as its blocks
    (``quantised.Packed``, unpacked at use): no plan's dtype is smaller.
    A float weight planned int8 (``weights_dtype="int8"``) is placed as stored, then quantised there
    per output channel (``quantised.quantise_int8``, a program on the device) into a ``Quantised`` of
    its int8 values and float32 scales: the product is done on the int8 values, the scale on its output.
    """
    options = options or DEFAULT_OPTIONS
    stored = (lambda k: (_meta(tensors, k) or ((), None))[1]) if low is not None else None  # noqa: E731
    dtype_for = dtype_plan(abstract, dtype, key_fn=key_fn, dtype_for=dtype_for, options=options, low=low,
                           stored=stored)
    scales = weight_scales(tensors)  # a scaled fp8 file's weights: kept scaled, or dequantised as placed
    packed = packed_weights(tensors)  # GGUF blocks (Q4_K, ...): {X.weight: (X.weight_Q4_K, kind)}
    skip = lambda k: ignored(k, tensors) or (ignore is not None and ignore(k))  # noqa: E731 (scales, the marker)
    flat, plan = _check(abstract, tensors, dtype, source, key_fn, skip, dtype_for, scales, packed)
    # kept scaled on the device: planned and stored compact (the bytes as they are, beside their scale)
    kept = {key: scales[key] for _, _, _, _, key, want in plan
            if key in scales and _compact(want) and _compact(_meta(tensors, key)[1])}
    scale_shapes = {key: scale_shape(tensors, key, scales[key])  # checked before any tensor is read
                    for _, _, _, _, key, _ in plan if key in scales}
    # quantised here, per output channel: a float weight planned int8 (weights_dtype="int8")
    made = {key for _, _, _, _, key, want in plan
            if want == np.int8 and key not in scales and key not in packed}

    def placeholder(var: Any, leaf: str, key: str, want: np.dtype) -> Any:
        if key in packed:  # (in / QK, BYTES, out): the kernel's layout, a block's bytes along axis 1
            kind = packed[key][1]
            rows, width = var.shape
            return Packed(jax.ShapeDtypeStruct((rows // LAYOUTS[kind].qk, LAYOUTS[kind].nbytes, width), np.uint8),
                          kind)
        if key in made:  # (..., out) int8 and (1, ..., 1, out) float32 scales
            return Quantised(jax.ShapeDtypeStruct(tuple(var.shape), np.int8),
                             jax.ShapeDtypeStruct(int8_scale_shape(tuple(var.shape)), np.float32))
        if key not in kept:
            return jax.ShapeDtypeStruct(tuple(var.shape), want)
        shape = scale_shapes[key]  # (): one float32 per tensor; else blocks, as stored, in the kernel's layout
        scale_dtype = np.float32 if shape == () else _meta(tensors, kept[key])[1]
        layout = to_jax_layout(np.broadcast_to(np.zeros((), np.uint8), shape), leaf).shape
        return Quantised(jax.ShapeDtypeStruct(tuple(var.shape), _meta(tensors, key)[1]),
                         jax.ShapeDtypeStruct(layout, scale_dtype))

    # one placeholder Variable per leaf, its value set in place when its tensor is placed
    holders = {i: var.replace(placeholder(var, leaf, key, want)) for i, _, var, leaf, key, want in plan}
    state = nnx.from_flat_state([(flat[i][0], holders[i]) for i in sorted(holders)])

    def job() -> None:
        t0 = time.perf_counter()
        window = PeakWindow()
        try:
            report = _stream(plan, holders, tensors, source, scales, kept, packed, made)
        finally:
            before, peak, after, exact = window.close()
        record_load(replace(report, seconds=time.perf_counter() - t0, rss_before=before, peak_rss=peak,
                        rss_after=after, peak_exact=exact))

    after_reads(job, options)
    return state


def dtype_plan(abstract: nnx.State, dtype: Any, *, key_fn: Callable[[tuple[Any, ...]], str] = torch_key,
               dtype_for: Callable[[str], Any] | None = None, options: LoadOptions | None = None,
               low: Callable[[str], bool] | None = None,
               stored: Callable[[str], Any] | None = None) -> Callable[[str], Any] | None:
    """``fill``'s per-key dtype for a denoiser (``low`` given): ``options.weights_dtype`` for the
    Linear/Conv/Embedding weights (``kernel``/``embedding`` leaves) that ``low`` names; without
    ``weights_dtype``, the stored dtype for those the checkpoint stores compact (``stored(key)``:
    fp8, as ComfyUI keeps an fp8 file's weights, when the device holds fp8 (``quantised.holds``);
    a GGUF Q8_0 weight's int8 values, which ``fill`` keeps beside their scales); the rest
    ``dtype_for`` (or ``dtype``). With ``weights_dtype``, what a load would place is known from the
    plan and the abstract shapes alone (the fp8 memory benchmark)."""
    if options is None or low is None or (options.weights_dtype is None and stored is None):
        return dtype_for
    rest, compact = dtype_for, {}
    layers = {key_fn(path) for path, _ in nnx.to_flat_state(abstract) if str(path[-1]) in ("kernel", "embedding")}
    if options.weights_dtype is not None:
        want, chosen = jnp.dtype(options.weights_dtype), low
    else:  # the checkpoint decides: a layer stored compact (fp8; GGUF Q8_0's int8) stays so
        compact = {key: np.dtype(stored(key)) for key in layers if _compact(stored(key))}
        if any(is_low(d) for d in compact.values()) and not holds(FLOAT8):
            compact = {k: d for k, d in compact.items() if not is_low(d)}  # fp8 upcast on the host instead
        if not compact:
            return dtype_for
        chosen, want = compact.__contains__, None

    def planned(key: str) -> Any:
        if key in layers and chosen(key):
            return want if want is not None else compact[key]
        return rest(key) if rest is not None else dtype

    return planned


_COMPACT = (np.dtype(FLOAT8), np.dtype(np.int8))  # what a scaled weight may stay as on the device


def _compact(dtype: Any) -> bool:
    return dtype is not None and np.dtype(dtype) in _COMPACT


_Plan = list[tuple[int, tuple[Any, ...], Any, str, str, np.dtype]]


def _check(abstract: nnx.State, tensors: Mapping[str, Any], dtype: Any, source: str,
           key_fn: Callable[[tuple[Any, ...]], str], ignore: Callable[[str], bool] | None,
           dtype_for: Callable[[str], Any] | None, scales: Container[str] = (),
           packed: Mapping[str, tuple[str, str]] | None = None) -> tuple[list[Any], _Plan]:
    """Headers only: every key, shape and dtype, all problems in one ``WeightsError``; returns
    the flat abstract state and the plan (index, path, variable, leaf, key, dtype to place).
    A weight with a scale (``scales``) may be stored as int8 (GGUF Q8_0's values); a packed
    weight (``packed``: GGUF blocks) is read under its packed name, its shape the elements'."""
    flat = nnx.to_flat_state(abstract)
    problems: list[str] = []
    plan: _Plan = []
    used = set()
    packed = packed or {}
    for i, (path, var) in enumerate(flat):
        leaf = str(path[-1])
        key = key_fn(path)
        expected = expected_torch_shape(tuple(var.shape), leaf)
        meta = _meta(tensors, key)
        if meta is None and key in packed:
            name, kind = packed[key]
            used.add(name)
            (rows, width), layout = _meta(tensors, name)[0], LAYOUTS[kind]
            if leaf != "kernel" or len(expected) != 2:
                problems.append(f"{name} holds {kind} blocks, but {key} is not a Linear layer's weight")
                continue
            if (rows, width) != (expected[0], expected[1] // layout.qk * layout.nbytes) or expected[1] % layout.qk:
                problems.append(f"{name} has shape {(rows, width)} ({kind} blocks of {layout.qk} in {layout.nbytes} "
                                f"bytes), expected {expected}")
                continue
            plan.append((i, path, var, leaf, key, np.dtype(np.uint8)))
            continue
        if meta is None:
            problems.append(f"missing {key} (expected shape {expected})")
            continue
        used.add(key)
        shape, src_dtype = meta
        if shape != expected:
            problems.append(f"{key} has shape {shape}, expected {expected}")
            continue
        if not jnp.issubdtype(src_dtype, jnp.floating) and not (key in scales and src_dtype == np.int8):
            problems.append(f"{key} has dtype {src_dtype}, expected a floating-point dtype")
            continue
        want = dtype_for(key) if dtype_for is not None else dtype
        plan.append((i, path, var, leaf, key, jax.dtypes.canonicalize_dtype(src_dtype if want is None else want)))
    extra = sorted(k for k in set(tensors) - used if not (ignore and ignore(k)))
    problems.extend(f"unexpected {k} {_meta(tensors, k)[0]}" for k in extra)
    if problems:
        shown = "; ".join(problems[:6]) + (f"; (+{len(problems) - 6} more)" if len(problems) > 6 else "")
        raise WeightsError(f"{source} does not match its config: {shown}")
    return flat, plan


def _stream(plan: _Plan, holders: dict[int, Any], tensors: Mapping[str, Any], source: str,
            scales: Mapping[str, str] | None = None, kept: Mapping[str, str] | None = None,
            packed: Mapping[str, tuple[str, str]] | None = None, made: Container[str] = ()) -> LoadReport:
    """Read, cast and place every planned tensor (file order), setting ``holders[i]``'s value.
    ``kept``: the scaled weights (fp8, Q8_0) placed as stored beside their scale; the rest of
    ``scales`` are dequantised on the host. ``packed``: GGUF blocks, placed as they are. ``made``:
    float weights quantised to int8 here, per output channel, placed beside their scales."""
    lazy = isinstance(tensors, Checkpoint)
    packed = packed or {}
    if lazy:  # stream in file order (sequential reads; the OS reads ahead)
        infos = {key: tensors.info(packed[key][0] if key in packed else key) for _, _, _, _, key, _ in plan}
        plan = sorted(plan, key=lambda p: (str(infos[p[4]].file), infos[p[4]].start) if infos[p[4]] else ("", p[0]))
    in_flight: deque[tuple[jax.Array, int]] = deque()
    waiting = bytes_read = placed_bytes = largest = 0
    scratch = _Scratch()
    for i, path, var, leaf, key, want in plan:
        if key in packed:  # each row's blocks (out, in / QK * BYTES) -> (in / QK, BYTES, out): unpacked at use
            name, kind = packed[key]
            rows = np.asarray(tensors[name], np.uint8)
            blocks = rows.reshape(rows.shape[0], -1, LAYOUTS[kind].nbytes).transpose(1, 2, 0)
            value, nbytes = Packed(jax.device_put(blocks), kind), rows.nbytes
        elif kept and key in kept:  # the stored bytes as they are, and their scale: expanded at use
            values, nbytes = _place(tensors, key, leaf, holders[i].get_value().values.dtype, scratch)
            scale = scale_of(tensors, key, kept[key])
            value = Quantised(values, jax.device_put(to_jax_layout(scale, leaf)))
            nbytes += scale.nbytes
        elif key in made:  # placed as stored, then int8 values and a float32 scale per output channel, once
            as_stored = _meta(tensors, key)[1]
            if is_low(as_stored) and not holds(as_stored):  # an fp8 file on a device without fp8 arrays: bf16 (exact)
                as_stored = np.dtype(jnp.bfloat16)
            stored, nbytes = _place(tensors, key, leaf, as_stored, scratch)
            value = Quantised(*quantise_int8(stored))  # (..., out) int8, (1, ..., 1, out) float32, on the device
        elif scales and key in scales:  # fp8 times its scale, then the planned dtype (preheat.models.scaled_fp8)
            host = dequantise(tensors, key, scales[key]).astype(want)
            value = jax.device_put(to_jax_layout(host, leaf), donate=True)
            scale_shape_, scale_dtype = _meta(tensors, scales[key])
            nbytes = host.size * _meta(tensors, key)[1].itemsize + int(np.prod(scale_shape_)) * scale_dtype.itemsize
        else:
            value, nbytes = _place(tensors, key, leaf, want, scratch)
        bytes_read += nbytes
        placed_bytes += value.nbytes
        largest = max(largest, nbytes)
        holders[i].set_value(value)
        in_flight.append((value, nbytes))
        waiting += nbytes
        while waiting > IN_FLIGHT_BYTES:  # bound the host buffers still being copied
            done, n = in_flight.popleft()
            jax.block_until_ready(done)
            waiting -= n
    for value, _ in in_flight:
        jax.block_until_ready(value)
    files = tuple(str(f) for f in tensors.files) if lazy else ()
    return LoadReport(source=source, files=files, tensors=len(plan), bytes_read=bytes_read,
                      placed_bytes=placed_bytes, largest_tensor_bytes=largest,
                      largest_file_bytes=max((Path(f).stat().st_size for f in files), default=0))


def check_dtype(dtype: Any) -> jnp.dtype:
    """A floating dtype for weights/activations, or a one-line error."""
    try:
        dt = jnp.dtype(dtype)
    except TypeError:
        raise UnsupportedConfigError(f"unsupported dtype {dtype!r}; use float32, bfloat16 or float16") from None
    if not jnp.issubdtype(dt, jnp.floating):
        raise UnsupportedConfigError(f"unsupported dtype {dt}; use float32, bfloat16 or float16")
    return dt

