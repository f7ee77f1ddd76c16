"""8-bit weight storage: which layers of a denoiser are kept in fp8 or int8, and their upcast at use.

    preheat.load(model, weights_dtype="float8_e4m3fn")
    preheat.load(model, weights_dtype="int8")     # int8 values, a float32 scale per output channel

The layers are the ones diffusers' ``enable_layerwise_casting(storage_dtype=float8_e4m3fn)``
casts, so a model stored here matches diffusers' own fp8 storage: every Linear, Conv and
Embedding weight, unless a module on its path matches one of the skip patterns (``re.search``
on each dotted prefix of the module's name, as diffusers walks ``named_children``):

    DEFAULT_SKIP   pos_embed, patch_embed, norm, ^proj_in$, ^proj_out$   (every model)
    + the model's own ``_skip_layerwise_casting_patterns`` (``extra``)

``^proj_in$`` and ``^proj_out$`` are anchored, so only the top-level projections stay at full
precision; an attention block's inner ``proj_in``/``proj_out`` is cast. Biases stay in the
compute dtype, where diffusers casts them too: a rounding error of the bytes, but not always of the
image (a tiny random SDXL moves 2.2 levels of 255 by its biases alone; tests/models/test_storage.py
compares with diffusers' image of the same fp8 weights and full biases, and records that gap).

``weights_layers="linear"`` (not the default) drops the ``norm`` pattern: the Linear layers
inside norm modules -- Flux's and SD3's AdaLN modulation (``norm1.linear``, ``norm.linear``,
``norm_out.linear``), a quarter of FLUX.1-dev's weights -- are stored in fp8 too, as the fp8
single files deployers ship hold them. Norm weights themselves are never Linear, so stay.

The weights are placed in fp8 by ``weights.fill`` (``LoadOptions.weights_dtype`` with ``low``)
and stay so on the device; the model's ``apply`` calls ``upcast`` inside the jitted program, so
each weight is converted to the compute dtype where it is used. A tensor already stored as
``F8_E4M3`` is placed as it is (no cast on the host). A 1x1 Conv's fp8 kernel (SD/SDXL UNets'
attention ``proj_in``/``proj_out`` and resnet ``conv_shortcut``) is left fp8 by ``upcast`` and
converted by ``layers.Conv2d``, which then applies it as the matrix product it is: on a GPU one
GEMM that reads the fp8 weight, like a Linear's, instead of a kernel writing a bf16 copy of the
weight in cuDNN's layout at every step, then cuDNN's convolution.

A weight stored in a compact form with scales (a scaled fp8 file's ``F8_E4M3`` weight and its
float32 per-tensor scale; a GGUF ``Q8_0`` weight's int8 values and per-block scales) is one
``preheat.models.quantised.Quantised`` value on the device: a pytree of the stored values and
their scale, which ``upcast`` expands to ``values * scale`` in the compute dtype, in the same
place it converts a plain fp8 weight. A Linear layer's (or a 1x1 Conv's) weight whose scale is per
tensor or per output channel is not expanded: ``upcast`` converts its values and keeps the scale,
and the layer scales the matmul's output (``Quantised.product``: ``(x @ values) * scale``, the
scale in the GEMM's epilogue), so on a GPU the GEMM reads the fp8 values itself, as it reads a
plain fp8 weight, instead of a separate kernel writing a scaled bf16 copy of every weight at every
step. Block scales along the input (GGUF Q8_0), kxk Conv and Embedding weights are expanded as
before (a kxk conv's cuDNN kernel reads a bf16 copy of the weight in its own layout whatever the
stored dtype; the scale fuses into that copy for free, and on the output it would cost a kernel).
An Embedding's table is expanded whole in the program's text, then gathered, but XLA fuses the
convert and the scale into the gather's kernel, which computes them for the gathered rows only: no
widened table is written (the H200 HLO, tests/models/test_storage.py), so the stored rows are not
gathered first by hand.
``weights_dtype="int8"`` stores the same layers (the same skip rules, ``weights_layers`` alike) as
int8 values with one float32 scale per output channel, made on the device as each tensor is placed
(``quantised.quantise_int8``: symmetric, ``scale = max|w| / 127``), a ``Quantised`` like a scaled fp8
file's per-channel weight, so it takes that weight's path: a Linear's or 1x1 Conv's product is done
on the int8 values converted to the compute dtype inside the GEMM's operand read (exact: every int8
is a bf16), the float32 accumulator scaled in its epilogue (``Quantised.product``); a kxk Conv's
and an Embedding's are expanded to ``values * scale`` where used. It is weight-only: activations stay
in the compute dtype, so the GEMM itself runs in bf16 and what int8 saves is HBM (1 byte a weight,
read once a step). Why int8 beside fp8: a TPU v5e has int8 in its matrix unit and no fp8 arithmetic
(its fp8 weights are converted by the VPU), and per-channel scales keep more of a weight than fp8's
3-bit mantissa (int8's error is at most half a step of ``max|w| / 127`` in each channel).
Every other path (placement on a mesh, compile keys, placeholders for prefetch) sees its two
arrays as it sees any leaves. A GGUF weight of a packed type (Q4_0 ... Q6_K, IQ4_NL, IQ4_XS) is one
``quantised.Packed`` value, the file's blocks as bytes, which ``upcast`` unpacks in the same place
(``preheat.models.ggml``: integer and bit arithmetic, then the scales in float32).
"""

from __future__ import annotations

import contextlib
import contextvars
import re
from typing import Any, Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from preheat.errors import InvalidArgumentError, ModelFormatError
from preheat.models.conv import fp8_1x1_impl
from preheat.models.quantised import FLOAT8, INT8, Packed, Quantised, int8_scale_shape, is_low, is_quantised, refusal

__all__ = ["WEIGHTS_DTYPES", "DEFAULT_SKIP", "layerwise", "upcast", "check_weights_dtype", "stored_low",
           "placed_bytes", "device_bytes"]

WEIGHTS_DTYPES = (FLOAT8, INT8)  # what weights_dtype= takes
WEIGHTS_LAYERS = ("layerwise", "linear")  # diffusers' layerwise-casting set; every Linear/Conv/Embedding
DEFAULT_SKIP = ("pos_embed", "patch_embed", "norm", "^proj_in$", "^proj_out$")  # diffusers' DEFAULT_SKIP_MODULES_PATTERN


def layerwise(extra: Sequence[str] = (), options: Any = None) -> Callable[[str], bool]:
    """``low(key)`` for ``weights.fill``: True for a weight (torch key ``<module>.weight``) whose
    module no skip pattern matches on any prefix of its dotted name. ``fill`` asks only about the
    weights of Linear, Conv and Embedding layers (its ``kernel`` and ``embedding`` leaves).
    ``extra``: the model's own patterns; ``options.weights_layers == "linear"``: no ``norm`` pattern."""
    skip = (*DEFAULT_SKIP, *extra)
    if options is not None and options.weights_layers == "linear":
        skip = tuple(p for p in skip if p != "norm")
    patterns = [re.compile(p) for p in dict.fromkeys(skip)]

    def low(key: str) -> bool:
        module, _, leaf = key.rpartition(".")
        if leaf != "weight" or not module:
            return False
        parts = module.split(".")
        prefixes = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
        return not any(p.search(prefix) for prefix in prefixes for p in patterns)

    return low


def upcast(params: Any, dtype: Any, tie: Any = None) -> Any:
    """``params`` with every fp8 leaf converted to ``dtype`` (the compute dtype); the rest as they
    are. Called inside the jitted apply, so the device keeps fp8 and XLA places the converts. A
    plain fp8 1x1 Conv kernel is left fp8 for its layer to convert inside its GEMM. A
    ``Quantised`` Linear or 1x1 Conv weight with a per-tensor or per-output-channel scale stays
    ``Quantised`` (its values converted, its scale as it is) for the layer to scale its product; any
    other is expanded to ``values * scale``.

    ``tie``: a value of this step (the sample). Without it XLA's loop-invariant code motion hoists
    every convert out of the sampling loop (seen in the compiled HLO on CPU), so a call would hold
    a full-precision copy of every weight; an optimization barrier shared with ``tie`` makes the
    weights a value of the step, so each is converted where it is used, step by step. Only the
    stored values go through it: a bias or scale that did was no longer fused into the GEMM's
    epilogue on the GPU (the H200 HLO: a second kernel per layer re-reading the GEMM's output).
    Leaves of a ``stacking.BlockStack`` are left for its scan, which upcasts each block's slice.

    A leaf in host memory (offloaded text encoders' weights: ``families.text.offload``) is moved to
    the device here first, where it is used: a stack's one block per scan iteration, so the device
    holds a block of the encoder at a time, and the transfer of the next overlaps this one's work."""
    def stored(x: Any) -> bool:
        return is_quantised(x) or is_low(x.dtype) or in_host_memory(x)

    def held(x: Any) -> Any:  # the stored bytes of a leaf
        return x.values if isinstance(x, Quantised) else x.blocks if isinstance(x, Packed) else x

    from preheat.models.block_paths import is_stacked_path

    flat, treedef = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_quantised)
    # a BlockStack's (N, ...) leaves are upcast one block at a time inside its scan (stacking.BlockStack)
    picks = [i for i, (path, x) in enumerate(flat) if stored(x) and not is_stacked_path(path)]
    if not picks:
        return params
    values = [held(flat[i][1]) for i in picks]
    values = [to_device_memory(v) for v in values]
    if tie is not None:
        values, _ = jax.lax.optimization_barrier((values, tie))
    out = [x for _, x in flat]
    for i, v in zip(picks, values):
        path, x = flat[i]
        if isinstance(x, Quantised) and in_host_memory(x.scale):
            x = Quantised(x.values, to_device_memory(x.scale))
        if not (is_quantised(x) or is_low(x.dtype)):  # moved in from host memory, used as it is
            out[i] = v
        elif isinstance(x, Packed):  # GGML blocks: unpacked where used (preheat.models.ggml)
            out[i] = Packed(v, x.kind).expand(dtype)
        elif not isinstance(x, Quantised):  # a 1x1 conv's fp8 kernel is converted by its layer, inside its GEMM
            out[i] = v if _pointwise_conv(path, x) else v.astype(dtype)
        elif _gemm_kernel(path, x) and x.per_output:
            out[i] = Quantised(v, x.scale).converted(dtype)  # the layer scales its product (Quantised.product)
        else:
            out[i] = Quantised(v, x.scale).expand(dtype)
    return jax.tree_util.tree_unflatten(treedef, out)


_FROM_HOST: contextvars.ContextVar[bool] = contextvars.ContextVar("preheat_weights_from_host", default=False)


@contextlib.contextmanager
def weights_from_host() -> Iterator[None]:
    """While a program that takes its weights from host memory is traced (offloaded encoders: the
    encode stage, ``families.text.encode``): every weight ``upcast`` meets is moved in. A traced
    placeholder (``jax.ShapeDtypeStruct``: a prefetch's, ``warm --target``'s) does not carry its
    memory kind into the trace as an array does, so the program says it, rather than each leaf."""
    token = _FROM_HOST.set(True)
    try:
        yield
    finally:
        _FROM_HOST.reset(token)


def offloaded_leaf(ndim: int) -> bool:
    """Whether an offloaded encoder's weight of ``ndim`` dimensions (one block's, for a stack) is kept
    in host memory: matrices and tables. Vectors (norm scales, biases) stay on the device, a few KiB
    a block: a TPU cannot slice one block's row of a stacked bf16 vector out of host memory (its
    rows pack two to a sublane), and moving them would gain nothing."""
    return ndim >= 2


def in_host_memory(x: Any) -> bool:
    """Whether an array (or a traced one) lives in host memory: pinned host memory the device reads."""
    if isinstance(x, (Quantised, Packed)):
        return in_host_memory(x.values if isinstance(x, Quantised) else x.blocks)
    if _FROM_HOST.get():
        return offloaded_leaf(np.ndim(x) if not hasattr(x, "ndim") else x.ndim)
    try:
        return jax.typeof(x).memory_space == jax.memory.Space.Host
    except (AttributeError, TypeError):  # not an array; a jax without memory spaces
        return False


def to_device_memory(x: Any) -> Any:
    """``x`` in the device's own memory: moved in from host memory inside the program, else as it is."""
    return jax.device_put(x, jax.memory.Space.Device) if in_host_memory(x) else x


def _pointwise_conv(path: Any, x: Any) -> bool:
    """Whether a plain fp8 leaf is a 1x1 Conv2d's ``(1, 1, in, out)`` kernel: left fp8 by ``upcast``,
    so that ``layers.Conv2d`` sees the stored dtype and applies it as a matrix product (one GEMM
    whose operand read converts the fp8 weight), not XLA's convolution (cuDNN on a GPU, fed by a
    kernel writing a bf16 copy of the weight in its layout at every step: the H200 HLO,
    tests/models/test_storage.py). A strided or padded 1x1 conv converts it there instead.
    ``PREHEAT_FP8_1X1=conv`` (``conv.fp8_1x1_impl``, part of the compile key) turns this off: every
    plain fp8 kernel converted here, the layer's convolution on the bf16 copy (the GPU check's
    ``fp8unet`` row times both)."""
    return len(x.shape) == 4 and _gemm_kernel(path, x) and fp8_1x1_impl() == "gemm"


def _gemm_kernel(path: Any, x: Any) -> bool:
    """Whether a leaf is a weight its layer applies as one matrix product: a Linear's 2-D ``kernel``
    (the convention ``weights`` maps torch keys by), or a 1x1 Conv2d's ``(1, 1, in, out)`` one
    (``layers.Conv2d``: ``Quantised.matrix``). A kxk conv kernel and embeddings are expanded: on a
    GPU cuDNN reads a bf16 weight in its own layout, which XLA writes at every use whatever the
    stored dtype, and the scale fuses into that copy; on the output it would be one more kernel
    (the H200 HLO, tests/models/test_storage.py)."""
    names = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
    if not names or names[-1] != "kernel":
        return False
    return len(x.shape) == 2 or (len(x.shape) == 4 and tuple(x.shape[:2]) == (1, 1))


def check_weights_dtype(weights_dtype: str, mesh: Any = None, weights_layers: str = "layerwise") -> None:
    """A one-line error for a ``weights_dtype`` preheat does not store, or one the devices cannot
    hold: a tiny array of it is placed on each device and upcast by a compiled program, as the
    denoiser's weights will be (before any weight is read)."""
    if weights_dtype not in WEIGHTS_DTYPES:
        raise InvalidArgumentError(f"weights_dtype={weights_dtype!r} is not supported; use {', '.join(WEIGHTS_DTYPES)} "
                                   "(or leave it out: the weights in dtype)", argument="weights_dtype")
    if weights_layers not in WEIGHTS_LAYERS:
        raise InvalidArgumentError(f"weights_layers={weights_layers!r} is not one of {', '.join(WEIGHTS_LAYERS)}",
                                   argument="weights_layers")
    devices = list(mesh.devices.flat) if mesh is not None else jax.devices()[:1]
    for device in devices:
        reason = refusal(device, weights_dtype)
        if reason is not None:
            raise ModelFormatError(f"weights_dtype={weights_dtype}: device {device} ({device.platform}) cannot hold "
                                   f"{weights_dtype} weights: {reason[:160]}")


def stored_low(params: Any, weights_dtype: str, source: Any) -> None:
    """A one-line error when a load asked for ``weights_dtype`` but no weight was stored in it
    (a denoiser whose loader names no layers): never a silent full-precision load. A layer kept
    ``Quantised`` or ``Packed`` (GGUF Q8_0's int8 and scales, Q4_K's blocks: more compact than a cast
    to fp8) counts as stored."""
    want = jnp.dtype(weights_dtype)
    leaves = jax.tree.leaves(params, is_leaf=is_quantised)
    if not any(is_quantised(leaf) or np.dtype(leaf.dtype) == want for leaf in leaves):
        raise ModelFormatError(f"{source}: weights_dtype={weights_dtype} was asked for, but this model's denoiser "
                               f"stores no layer in it")


def placed_bytes(abstract: Any, dtype: Any, weights_dtype: str | None = None, extra: Sequence[str] = (),
                 weights_layers: str = "layerwise") -> int:
    """Device bytes a load of ``abstract`` (an abstract State, torch-keyed) would place: in
    ``dtype``, or with ``weights_dtype`` for the layers ``layerwise(extra)`` names, by the same
    plan ``weights.fill`` follows. Shapes only: nothing is read or allocated."""
    from flax import nnx

    from preheat.models.weights import LoadOptions, dtype_plan, torch_key

    options = LoadOptions(weights_dtype=weights_dtype, weights_layers=weights_layers)
    plan = dtype_plan(abstract, dtype, options=options, low=layerwise(extra, options))
    total = 0
    for path, var in nnx.to_flat_state(abstract):
        want = jnp.dtype(plan(torch_key(path)) if plan is not None else dtype)
        total += int(np.prod(var.shape, dtype=np.int64)) * want.itemsize
        if want == np.int8:  # and a float32 scale per output channel (quantised.quantise_int8)
            total += 4 * int(np.prod(int8_scale_shape(tuple(var.shape))))
    return total


def device_bytes(params: Any) -> int:
    """Bytes ``params`` hold on the device: every array, a ``Quantised`` weight's values and scale,
    a ``Packed`` weight's blocks."""
    return sum(int(leaf.nbytes) for leaf in jax.tree.leaves(params))
