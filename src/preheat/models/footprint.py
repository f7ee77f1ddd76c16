"""How many device bytes a model's weights take at a dtype, from the safetensors headers alone.

A model that cannot fit the chip should be refused before a byte of it is read (a TPU v5e chip has
15.75 GiB of HBM; SDXL's 3.47 billion parameters take 12.9 GiB in float32 before any activation,
6.5 GiB in bfloat16; FLUX.1-dev's 16.9 billion take 31.5 GiB in bfloat16). The headers give
each tensor's shape and stored dtype; the load rules give the dtype it is placed in:

    denoiser (unet, transformer)  ``dtype``; a tensor stored in fp8 stays fp8; with ``weights_dtype``
                                  the Linear/Conv/Embedding weights diffusers' layerwise casting
                                  names (``preheat.models.storage``) in that dtype -- an estimate:
                                  a model's own extra skip patterns are not read; ``int8`` adds a
                                  float32 scale per output channel (a lower bound: a 2-D tensor's
                                  smaller axis, as the header does not say Linear from Embedding)
    text encoders                 ``dtype``; with ``offload_encoders`` (``encoders_on="offload"``) in
                                  host memory (``offloaded``), streamed to the device while prompts
                                  are encoded: what is outside its numbered blocks (embeddings,
                                  norms) and two blocks at a time (``streamed``: the scan moves one
                                  in while the last is used); with ``encoders_on="host"`` in host
                                  memory and run there: never on the device (``host``)
    vae                           float32 when its config says ``force_upcast`` and ``dtype`` is half
    integer tensors               as stored
    anything else                 not counted (a safety checker, an image encoder: no family loads them)

So the figure never exceeds what a load places: the refusal it backs cannot refuse a model that fits.

Two figures matter, and ``plan`` prints both, a line per component (what goes where, at which dtype):

    denoising  ``total``: what stays on the device (the denoiser, the VAE, encoders not offloaded);
               it should leave room for activations and programs (``ROOM``)
    encoding   ``peak``: that plus what the offloaded encoders' streaming holds; it must fit

``offload_encoders`` lowers the first by the encoders' bytes and the second by all but a few blocks of
them: FLUX.1-dev's T5-XXL (8.9 GiB in bfloat16) streams beside its int8 transformer (11.1 GiB) on a
15.75 GiB chip with about 1 GiB of it there at once (docs/tpu.md). ``encoders_on="host"`` lowers
both further: the encoders run on the host's CPU, and only their embeddings reach the device (the
CPU's time is its price). ``fitting`` names the first load option, cheapest to quality first, that fits.

Nothing here imports JAX at import time: ``preheat doctor --model`` reads it in-process;
``check_fits`` is the load's one-line refusal (it asks JAX for the devices only when not given them).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from preheat import platforms
from preheat.errors import InvalidArgumentError, ModelError, PreheatError
from preheat.models.safetensors_files import read_header, read_json, weight_files

__all__ = ["ENCODERS_ON", "encoders_placement", "Footprint", "weight_footprint", "check_fits", "fitting", "gib", "ROOM",
           "WEIGHTS_DTYPES"]

DENOISERS = ("unet", "transformer")
_SKIP = re.compile(r"pos_embed|patch_embed|norm")  # storage.DEFAULT_SKIP, less the anchored two below
_SKIP_LINEAR = re.compile(r"pos_embed|patch_embed")  # weights_layers="linear": norm modules' Linears too
_SKIP_TOP = ("proj_in", "proj_out")
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "int8": 1}
WEIGHTS_DTYPES = ("int8", "float8_e4m3fn")  # storage.WEIGHTS_DTYPES, without importing JAX
ROOM = 0.75  # weights above this share leave little for activations (SDXL 1024² in float32: 82% of a v5e chip)


# where a text family's encoders live and run (preheat.load(encoders_on=...)); "offload" is
# offload_encoders=True (kept in host memory, streamed to the device while prompts are encoded)
ENCODERS_ON = ("device", "host", "offload")


def encoders_placement(offload_encoders: bool, encoders_on: str) -> tuple[bool, str]:
    """``(offload_encoders, encoders_on)`` with ``encoders_on="offload"`` read as ``offload_encoders=True``
    on the device (the CLI's and the environment's one spelling of both); one line for an unknown value."""
    if encoders_on not in ENCODERS_ON:
        raise InvalidArgumentError(f"encoders_on={encoders_on!r} is not supported; use one of "
                                   f"{', '.join(ENCODERS_ON)}", argument="encoders_on")
    if encoders_on == "offload":
        return True, "device"
    return offload_encoders, encoders_on


def gib(n: float) -> str:
    """Bytes as people read them: GiB from 1 GiB up, else MiB."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


@dataclass
class Footprint:
    """Device bytes per component (``parts``: name -> bytes) of one load."""

    root: Path
    dtype: str
    weights_dtype: str | None
    offload_encoders: bool
    parts: dict[str, int] = field(default_factory=dict)
    offloaded: dict[str, int] = field(default_factory=dict)  # encoders kept in host memory
    streamed: dict[str, int] = field(default_factory=dict)  # of those, what is on the device while they encode
    weights_layers: str = "layerwise"
    dtypes: dict[str, str] = field(default_factory=dict)  # component -> its dtype in words ("int8 + bfloat16")
    encoders_on: str = "device"
    host: dict[str, int] = field(default_factory=dict)  # encoders kept and run on the host (encoders_on="host")

    @property
    def total(self) -> int:
        """Bytes on the device while denoising (and at rest)."""
        return sum(self.parts.values())

    @property
    def peak(self) -> int:
        """Bytes on the device while prompts are encoded: the offloaded encoders' streamed parts too."""
        return self.total + sum(self.streamed.values())

    def fits(self, limit: int, encoding: bool = True) -> bool:
        """Whether this load fits ``limit`` bytes with room: its resting weights within ``ROOM`` of
        it (activations, programs), its encode stage's within it (``encoding=False``: the first alone)."""
        return self.total <= ROOM * limit and (self.peak <= limit or not encoding)

    def options(self) -> str:
        """The load options this footprint is for, as the CLI spells them."""
        out = f"--dtype {self.dtype}"
        out += f" --weights-dtype {self.weights_dtype}" if self.weights_dtype else ""
        out += " --weights-layers linear" if self.weights_dtype and self.weights_layers == "linear" else ""
        out += " --encoders-on host" if self.encoders_on == "host" else ""
        return out + (" --encoders-on offload" if self.offload_encoders else "")

    def plan(self, limit: int | None = None, what: str = "the device") -> list[str]:
        """What goes where: a line per component (where, dtype, bytes), then the denoising and
        encoding figures against ``limit`` (``what`` names it: "one TPU chip")."""
        rows = [(name, "device", n, "") for name, n in self.parts.items()]
        rows += [(name, "host -> device", n, f"streamed while prompts are encoded, {gib(self.streamed.get(name, n))} "
                                             "at once") for name, n in self.offloaded.items()]
        rows += [(name, "host", n, "run on the host's CPU; never on the device") for name, n in self.host.items()]
        rows.sort(key=lambda r: -r[2])
        width = max((len(r[0]) for r in rows), default=0)
        lines = [f"{name:<{width}}  {where:<14}  {self.dtypes.get(name, self.dtype):<24}  {gib(n):>10}"
                 + (f"  ({note})" if note else "") for name, where, n, note in rows]
        if not limit:
            return lines + [f"on {what}: {gib(self.total)} (no memory figure to compare with)"]
        room = f"{gib(limit - self.total)} left for activations and programs" if self.total <= limit else \
            f"{gib(self.total - limit)} more than {what} holds"
        lines.append(f"denoising: {gib(self.total)} on {what} of {gib(limit)} ({self.total / limit:.0%}): {room}")
        if self.offloaded:
            over = self.peak - limit
            lines.append(f"encoding: {gib(self.peak)} on {what} ({self.peak / limit:.0%}): "
                         + (f"{gib(over)} more than it holds" if over > 0 else "fits"))
        if self.host:
            lines.append(f"host memory: {gib(sum(self.host.values()))} of text encoders, run there; their "
                         "embeddings move to the device once per call")
        return lines


def _layerwise(key: str, shape: tuple[int, ...], linear: bool = False) -> bool:
    """A weight diffusers' layerwise casting stores low (Linear, Conv, Embedding), by its key."""
    if not key.endswith(".weight") or len(shape) < 2:
        return False
    module = key[: -len(".weight")]
    return not (_SKIP_LINEAR if linear else _SKIP).search(module) and module not in _SKIP_TOP


def _component_bytes(folder: Path, variant: str | None, itemsize: int, low: int | None, linear: bool = False,
                     scaled: bool = False) -> int:
    """``scaled``: each ``low`` weight adds a float32 scale per output channel (int8)."""
    total = 0
    for path in weight_files(folder, variant=variant):
        for key, info in read_header(path).items():
            if low is not None and _floating(info) and info.dtype.itemsize > 1 and _layerwise(key, info.shape, linear):
                total += int(np.prod(info.shape, dtype=np.int64)) * low
                if scaled:  # a conv's (out, in, kh, kw): out; a 2-D one: its smaller axis, a lower bound
                    total += 4 * (info.shape[0] if len(info.shape) != 2 else min(info.shape))
            else:
                total += _placed(info, itemsize)
    return total


def _floating(info: Any) -> bool:
    return info.dtype.kind == "f" or info.dtype.name == "bfloat16" or "float8" in info.dtype.name


def _placed(info: Any, itemsize: int) -> int:
    """A tensor's device bytes placed in a dtype of ``itemsize``: integers and bools as stored, stored
    fp8 stays fp8, other floats converted."""
    if not _floating(info):
        return info.nbytes
    n = int(np.prod(info.shape, dtype=np.int64))
    return n if info.dtype.itemsize == 1 else n * itemsize


_BLOCK = re.compile(r"\.(?:block|layers)\.(\d+)\.")  # T5's encoder.block.N., CLIP's encoder.layers.N.


def _streamed_bytes(folder: Path, variant: str | None, itemsize: int) -> int:
    """An offloaded encoder's bytes on the device while it encodes: its tensors outside numbered
    blocks (moved in whole: embeddings, final norms) and two of its largest blocks (the one in use
    and the next, moving in: ``storage.upcast`` inside ``stacking.BlockStack``'s scan)."""
    outside, blocks = 0, {}
    for path in weight_files(folder, variant=variant):
        for key, info in read_header(path).items():
            n = _placed(info, itemsize)
            found = _BLOCK.search(key)
            if found:
                blocks[found.group(1)] = blocks.get(found.group(1), 0) + n
            else:
                outside += n
    return outside + 2 * max(blocks.values(), default=0)


def _vae_upcast(folder: Path) -> bool:
    try:
        return bool(read_json(folder / "config.json").get("force_upcast", True))
    except PreheatError:
        return True


def weight_footprint(root: str | Path, dtype: str = "float32", *, variant: str | None = None,
                     weights_dtype: str | None = None, weights_layers: str = "layerwise",
                     offload_encoders: bool = False, encoders_on: str = "device") -> Footprint:
    """The device bytes of ``root``'s weights at ``dtype`` (a one-line ``PreheatError`` when a
    component's files are missing or torn, as the load would raise)."""
    root = Path(root)
    dtype = str(dtype)
    offload_encoders, encoders_on = encoders_placement(offload_encoders, encoders_on)
    if dtype not in _ITEMSIZE:
        raise ModelError(f"dtype {dtype!r} is not one of {', '.join(k for k in _ITEMSIZE if 'float8' not in k)}")
    size = _ITEMSIZE[dtype]
    if weights_dtype is not None and weights_dtype not in WEIGHTS_DTYPES:
        raise ModelError(f"weights_dtype {weights_dtype!r} is not one of {', '.join(WEIGHTS_DTYPES)}")
    low = _ITEMSIZE.get(weights_dtype) if weights_dtype else None
    linear = weights_layers == "linear"
    scaled = weights_dtype == "int8"
    fp = Footprint(root, dtype, weights_dtype, offload_encoders, weights_layers=weights_layers, encoders_on=encoders_on)
    low_words = f"{weights_dtype} + {dtype}" if weights_dtype else dtype
    if not (root / "model_index.json").is_file():  # a bare model folder: the denoiser alone
        name = root.name or "model"
        fp.parts[name] = _component_bytes(root, variant, size, low, linear, scaled)
        fp.dtypes[name] = low_words
        return fp
    index = read_json(root / "model_index.json", "pipeline index")
    for name, entry in index.items():
        if name.startswith("_") or not isinstance(entry, list) or None in entry or not (root / name).is_dir():
            continue
        if name not in DENOISERS and name != "vae" and not name.startswith("text_encoder"):
            continue  # what the families do not load (safety_checker, image_encoder, ...): never counted
        if name == "vae":
            upcast = size < 4 and _vae_upcast(root / name)
            n = _component_bytes(root / name, variant, 4 if upcast else size, None)
            fp.dtypes[name] = "float32 (force_upcast)" if upcast else dtype
        elif name in DENOISERS:
            n = _component_bytes(root / name, variant, size, low, linear, scaled)
            fp.dtypes[name] = low_words
        elif encoders_on == "host":  # computed on the host's CPU, in the dtype it multiplies fast
            host_dtype = platforms.host_compute_dtype(dtype)
            n = _component_bytes(root / name, variant, _ITEMSIZE[host_dtype], None)
            fp.dtypes[name] = host_dtype
        else:
            n = _component_bytes(root / name, variant, size, None)
        encoder = name.startswith("text_encoder")
        (fp.host if encoder and encoders_on == "host" else fp.offloaded if encoder and offload_encoders
         else fp.parts)[name] = n
        if encoder and offload_encoders and encoders_on != "host":
            fp.streamed[name] = min(n, _streamed_bytes(root / name, variant, size))
    return fp


def fitting(root: str | Path, limit: int, *, dtype: str, variant: str | None = None, weights_dtype: str | None = None,
            weights_layers: str = "layerwise", offload_encoders: bool = False,
            prefer: str = "int8", encoding: bool = True, encoders_on: str = "device") -> Footprint | None:
    """The first load option, cheapest to quality first, whose footprint ``fits`` ``limit``, other
    than the one asked for; None when none does. The order: bfloat16 (from float32); 8-bit denoiser
    weights (``prefer`` first: int8 on a TPU, whose matrix unit has int8 and no fp8); every Linear in
    8 bits (AdaLN modulation too: ``--weights-layers linear``); text encoders offloaded; text encoders
    kept and run on the host (``--encoders-on host``: their compute moves to the CPU, so last).
    ``encoding=False``: the first that fits while denoising, whether or not its encode stage does
    (what a model needs beyond it is then its text encoders off the device)."""
    offload_encoders, encoders_on = encoders_placement(offload_encoders, encoders_on)
    half = dtype if dtype != "float32" else "bfloat16"
    eights = [prefer, *(d for d in WEIGHTS_DTYPES if d != prefer)] if weights_dtype is None else [weights_dtype]
    on = encoders_on
    tries = [(half, weights_dtype, weights_layers, offload_encoders and on != "host", on)]
    tries += [(half, wd, "layerwise", offload_encoders and on != "host", on) for wd in eights]
    tries += [(half, wd, "linear", offload_encoders and on != "host", on) for wd in eights]
    first = list(tries)
    tries += [(dt, wd, wl, True, "device") for dt, wd, wl, _, _ in first]
    tries += [(dt, wd, wl, False, "host") for dt, wd, wl, _, _ in first]
    asked = (dtype, weights_dtype, weights_layers, offload_encoders, encoders_on)
    seen = {asked}
    for option in tries:
        if option in seen:
            continue
        seen.add(option)
        dt, wd, wl, off, where = option
        fp = weight_footprint(root, dt, variant=variant, weights_dtype=wd, weights_layers=wl, offload_encoders=off,
                              encoders_on=where)
        if fp.fits(limit, encoding) and (not off or fp.offloaded) and (where != "host" or fp.host):
            return fp
    return None


def _device_limit(device: Any) -> int | None:
    try:
        stats = device.memory_stats() or {}
    except Exception:  # a backend without memory stats (the CPU)
        return None
    limit = stats.get("bytes_limit")
    return int(limit) if limit else None


def check_fits(root: Path, *, dtype: Any, variant: str | None, weights_dtype: str | None, offload_encoders: bool,
               weights_layers: str = "layerwise", mesh: Any = None, fsdp: int = 1,
               devices: Sequence[Any] | None = None, encoders_on: str = "device") -> None:
    """Refuse in one line a load whose weights alone exceed a device's memory, before any is read:
    on ``devices``, else the mesh's, else JAX's first device.

    Quiet whenever it cannot tell (no memory stats, files the loader will name in its own words)."""
    if devices is None:
        import jax

        devices = list(mesh.devices.flat) if mesh is not None else jax.devices()[:1]
    limits = [lim for lim in (_device_limit(d) for d in devices) if lim]
    if not limits:
        return
    try:
        name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
        fp = weight_footprint(root, name, variant=variant, weights_dtype=weights_dtype, weights_layers=weights_layers,
                              offload_encoders=offload_encoders, encoders_on=encoders_on)
    except (PreheatError, TypeError):
        return
    need, have = fp.peak // max(fsdp, 1), min(limits)
    if need > have:
        per = f" each of {fsdp} devices" if fsdp > 1 else " the device"
        when = " while prompts are encoded" if fp.peak > fp.total and fp.total // max(fsdp, 1) <= have else ""
        try:
            alt = fitting(root, have * max(fsdp, 1), dtype=fp.dtype, variant=variant, weights_dtype=weights_dtype,
                          weights_layers=weights_layers, offload_encoders=offload_encoders, prefer=_prefer(devices),
                          encoders_on=encoders_on)
        except PreheatError:
            alt = None
        fix = (f"{alt.options()} would take {gib(alt.peak // max(fsdp, 1))}" if alt else
               f"no dtype or weights_dtype does (`preheat doctor --model {root}` prints the plan)")
        rest = None if alt else fp if fp.fits(have * max(fsdp, 1), encoding=False) else fitting(
            root, have * max(fsdp, 1), dtype=fp.dtype, variant=variant, weights_dtype=weights_dtype,
            weights_layers=weights_layers, offload_encoders=offload_encoders, prefer=_prefer(devices), encoding=False,
            encoders_on=encoders_on)
        if rest is not None:
            fix = (f"{rest.options()} fits while denoising ({gib(rest.total // max(fsdp, 1))}), but no option "
                   f"fits the encode stage (`preheat doctor --model {root}` prints the plan)")
        raise ModelError(f"{root}: its weights take {gib(need)}{when} at {fp.options()}, {gib(need - have)} more than "
                         f"the {gib(have)}{per} holds; {fix}")


def _prefer(devices: Sequence[Any]) -> str:
    """The 8-bit weights to suggest first: the devices' platform's (``Platform.compact_weights``:
    int8 on a TPU, fp8 elsewhere)."""
    from preheat import platforms

    return platforms.get(getattr(devices[0], "platform", "") if devices else "").compact_weights
