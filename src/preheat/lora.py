"""LoRA files in, runtime adapters out: reading, key mapping, rank buckets, per-image slots.

``pipe(prompt, lora="style.safetensors", lora_scale=0.8)`` never merges a LoRA into the weights
and never recompiles for a new one: the factors are arguments of the compiled programs
(``preheat.models.lora`` says how a layer uses them). This module is the host side:

    a request's lora=...  --parse-->  per image: a slot = ((LoraFile, scale), ...)
    distinct slots (K, padded to a power of two) + each image's slot index (B,)
    factors for every target layer, (K, in, R) / (K, R, out), R the rank bucket   (cached per mix)
    scales (K, R): each rank column's user scale                                   (tiny; per call)

Files read (safetensors), by key style::

    diffusers / peft   unet.<path>.lora_A.weight, .lora_B.weight     (also transformer., text_encoder.,
                       [.lora.down/.lora.up, .lora_down/.lora_up]     text_encoder_2.; alpha from the
                                                                      file's lora_adapter_metadata)
    kohya / A1111      lora_unet_<path with _>.lora_down.weight, .lora_up.weight, .alpha
                       lora_te_ / lora_te1_ / lora_te2_ for the text encoders; the UNet also in the
                       original layout, lora_unet_input_blocks_4_1_... (``families.stable_diffusion.sgm_lora_names``)
    Flux, BFL names    lora_unet_double_blocks_0_img_attn_qkv (kohya), diffusion_model.double_blocks.0...
                       (ComfyUI), double_blocks.0.processor.qkv_lora1.down.weight (XLabs): a fused
                       q/k/v (/mlp) layer shares A and splits B's rows (``families.flux.bfl_lora_names``)

A layer's update is ``scale * alpha / rank * B @ A`` (alpha = rank when the file gives none, as
diffusers does). Several LoRAs in one slot sit side by side in the rank dimension, so a mix is
one product; the bucket must hold their summed ranks. Keys that match no layer of the model, a
rank above the largest bucket, DoRA files, a corrupt file and a non-finite scale are one-line errors.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from preheat.errors import InvalidArgumentError, ModelFormatError, ModelNotFoundError, WeightsError
from preheat.models.bfl import Piece

__all__ = ["BUCKETS", "LoraCache", "LoraRuntime", "LoraFile", "LoraTargets", "LoraRequest", "read_lora", "parse_request", "parse_cli",
           "bucket_for", "check_lora_ranks", "denoiser_args", "encoder_adapters"]

BUCKETS = (16, 32, 64, 128)  # rank buckets: one compiled program per bucket (and slot count)
_CACHE_SIZE = 8  # LoRA files, and stacked slot mixes, held per pipeline (least recently used out)

# (suffix, role) in the order they are tried; role "down" = A (r, in), "up" = B (out, r)
_SUFFIXES = ((".lora_A.weight", "down"), (".lora_B.weight", "up"), (".lora_A.default.weight", "down"),
             (".lora_B.default.weight", "up"), (".lora.down.weight", "down"), (".lora.up.weight", "up"),
             (".lora_down.weight", "down"), (".lora_up.weight", "up"), (".alpha", "alpha"),
             (".down.weight", "down"), (".up.weight", "up"))  # the last two: XLabs' Flux files
_UNSUPPORTED = ((".dora_scale", "DoRA"), (".lora_magnitude_vector", "DoRA"), (".lora_A.bias", "LoRA biases"),
                (".lora_B.bias", "LoRA biases"), (".hada_w1_a", "LoHa"), (".lokr_w1", "LoKr"))
# diffusers' old attention-processor names (LoRAAttnProcessor) -> the layer's own name
_PROCESSOR = {".processor.to_q_lora": ".to_q", ".processor.to_k_lora": ".to_k", ".processor.to_v_lora": ".to_v",
              ".processor.to_out_lora": ".to_out.0"}


@dataclass(frozen=True)
class LoraTargets:
    """What a family offers LoRAs: its components' target layers and the file prefixes naming them.

    ``layers``: component -> {layer path: (in, out)} (``preheat.models.lora.targets``); the
    denoiser is "denoiser", text encoders "text_encoder", "text_encoder_2".
    """

    family: str
    layers: Mapping[str, Mapping[str, tuple[int, int]]]
    prefixes: Mapping[str, str]  # file prefix (diffusers "unet", kohya "lora_unet") -> component
    path_prefix: Mapping[str, str]  # component -> prefix of its layer paths a file may leave out
    # the denoiser's other names (Flux: BFL / XLabs), with "_" for ".": name -> pieces of
    # (layer path, first row, end row of the file's B factor, swap its halves)
    aliases: Mapping[str, tuple[Piece, ...]] = field(default_factory=dict)
    alias_prefixes: tuple[str, ...] = ()  # prefixes stripped before an alias is looked up

    def __post_init__(self) -> None:
        kohya = {c: {p.replace(".", "_"): p for p in layers} for c, layers in self.layers.items()}
        object.__setattr__(self, "_kohya", kohya)

    def zeros(self, rank: int, encoders: Sequence[str] = ()) -> "LoraFile":
        """A LoRA of ``rank`` whose factors are zeros, with a layer in each of ``encoders`` too: what
        warm-up runs (``preheat.warm``) so that a rank bucket's programs -- the denoiser's and
        the text encoders' with adapters -- are compiled before any real LoRA arrives."""
        layers: dict[str, dict[str, tuple[np.ndarray, np.ndarray]]] = {}
        for comp in ("denoiser", *encoders):
            path, (cin, cout) = next(iter(self.layers[comp].items()))
            layers[comp] = {path: (np.zeros((rank, cin), np.float32), np.zeros((cout, rank), np.float32))}
        return LoraFile(source=f"<zeros, rank {rank}>", layers=layers, rank=rank)


@dataclass(frozen=True, eq=False)
class LoraFile:
    """One LoRA file, read and mapped onto a model's layers (host float32 arrays)."""

    source: str
    layers: Mapping[str, Mapping[str, tuple[np.ndarray, np.ndarray]]]  # comp -> path -> (A (r, in), B*alpha/r (out, r))
    rank: int  # the largest rank of any layer: the columns this LoRA takes in a slot
    # (component, bucket, dtype) -> {layer: (down (in, R), up (R, out))} on the device: filled the
    # first time the file is used alone in a slot, dropped with the file when an LRU lets it go
    device: dict = field(default_factory=dict, compare=False, repr=False)


@dataclass(frozen=True)
class LoraRequest:
    """A call's adapters: distinct slots, each image's slot, the rank bucket (all host-side)."""

    slots: tuple[tuple[tuple[LoraFile, float], ...], ...]  # K slots (padded with empty ones)
    index: np.ndarray  # (n,) int32
    bucket: int

    @property
    def signature(self) -> tuple[int, int]:
        return self.bucket, len(self.slots)


# --------------------------------------------------------------------------------------- reading


def _local_file(source: str) -> Path:
    """A LoRA source -> a local safetensors file (http(s):// and hf:// through the weights store)."""
    text = str(source)
    if re.match(r"^(https?|hf)://", text, re.I):
        from preheat.store import resolve

        inside = ""
        if text.lower().startswith("hf://"):  # hf://org/repo[/file.safetensors][@rev]: the store pulls that file
            parts = text[len("hf://"):].partition("@")[0].strip("/").split("/")
            inside = "/".join(parts[2:])  # the snapshot keeps the file at its repository path
        path = Path(resolve(text))
        if inside:
            path = path / inside
            if not path.is_file():
                raise ModelNotFoundError(f"LoRA source {source} has no file {inside}")
            return path
        if path.is_dir():
            files = sorted(path.rglob("*.safetensors"))
            if len(files) != 1:
                raise ModelNotFoundError(f"LoRA source {text} holds {len(files)} .safetensors files; name one")
            return files[0]
        return path
    path = Path(text).expanduser()
    if path.is_dir():
        files = sorted(path.glob("*.safetensors"))
        if len(files) != 1:
            raise ModelNotFoundError(f"LoRA folder {path} holds {len(files)} .safetensors files; name one")
        return files[0]
    if not path.is_file():
        raise ModelNotFoundError(f"LoRA file {path} does not exist")
    return path


def _metadata(path: Path) -> dict[str, Any]:
    """diffusers' ``lora_adapter_metadata`` (flat "unet.lora_alpha", ...) from the safetensors header."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    raw = (header.get("__metadata__") or {}).get("lora_adapter_metadata")
    if not raw:
        return {}
    try:
        meta = json.loads(raw)
    except json.JSONDecodeError:
        raise ModelFormatError(f"{path}: lora_adapter_metadata is not valid JSON") from None
    return meta if isinstance(meta, dict) else {}


def _alpha_from_metadata(meta: Mapping[str, Any], prefix: str, path: str, rank: int) -> float | None:
    """peft's alpha for one layer: alpha_pattern (a key suffix) first, then lora_alpha; rsLoRA aware."""
    alpha = meta.get(f"{prefix}.lora_alpha")
    if alpha is None:
        return None
    for pattern, value in (meta.get(f"{prefix}.alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", path):
            alpha = value
            break
    if meta.get(f"{prefix}.use_rslora"):
        return float(alpha) * rank / math.sqrt(rank)  # so that alpha / rank = alpha / sqrt(rank)
    return float(alpha)


def _split_key(key: str) -> tuple[str, str] | None:
    for suffix, role in _SUFFIXES:
        if key.endswith(suffix):
            return key[: -len(suffix)], role
    return None


def _locate(module: str, targets: LoraTargets) -> tuple[str, tuple[Piece, ...], str] | None:
    """A file's module name -> (component, the layers it feeds, metadata prefix), or None.
    Most names feed one layer; a fused one (Flux's BFL ``qkv``) feeds several, one row range each."""
    if targets.aliases:
        name = module
        for prefix in targets.alias_prefixes:
            if name.startswith(prefix):
                name = name[len(prefix):]
                break
        pieces = targets.aliases.get(name.replace(".", "_"))
        if pieces is not None:
            return "denoiser", pieces, ""
    found = _locate_one(module, targets)
    if found is None:
        return None
    comp, path, prefix = found
    return comp, (Piece(path),) if path else (), prefix


def _locate_one(module: str, targets: LoraTargets) -> tuple[str, str, str] | None:
    """A file's module name -> (component, layer path or "", metadata prefix), or None."""
    for old, new in _PROCESSOR.items():
        module = module.replace(old, new)
    if module.startswith("base_model.model."):  # a bare peft save of the denoiser
        module = "unet." + module[len("base_model.model."):]
    for prefix, comp in sorted(targets.prefixes.items(), key=lambda kv: -len(kv[0])):
        layers = targets.layers.get(comp)
        if layers is None:
            continue
        if prefix.startswith("lora_"):  # kohya: underscores for dots, resolved against the model's names
            if module.startswith(prefix + "_"):
                name = module[len(prefix) + 1:]
                kohya = targets._kohya[comp]  # type: ignore[attr-defined]
                extra = targets.path_prefix.get(comp, "").replace(".", "_")
                path = kohya.get(name) or kohya.get(extra + name)
                return (comp, path, prefix) if path else (comp, "", prefix)
        elif module.startswith(prefix + "."):
            path = module[len(prefix) + 1:]
            if path not in layers and targets.path_prefix.get(comp) and (targets.path_prefix[comp] + path) in layers:
                path = targets.path_prefix[comp] + path
            return (comp, path if path in layers else "", prefix)
    return None


def read_lora(source: str | os.PathLike[str], targets: LoraTargets) -> LoraFile:
    """Read one LoRA file and map it onto ``targets``; every key must find its layer."""
    from preheat.models.weights import read_tensors

    path = _local_file(str(source))
    tensors = read_tensors([path])  # header checked against the file size: a torn file fails here
    meta = _metadata(path)
    parts: dict[tuple[str, tuple[Piece, ...], str], dict[str, Any]] = {}
    unmatched: list[str] = []
    for key in tensors:
        for suffix, what in _UNSUPPORTED:
            if key.endswith(suffix):
                raise WeightsError(f"{path}: {what} files are not supported (key {key!r}); use a plain LoRA")
        split = _split_key(key)
        located = _locate(split[0], targets) if split else None
        if located is None or not located[1]:
            unmatched.append(key)
            continue
        parts.setdefault(located, {})[split[1]] = key
    if unmatched:
        raise WeightsError(f"{path}: {len(unmatched)} LoRA key(s) match no layer of this {targets.family} model, "
                           f"e.g. {', '.join(unmatched[:3])}")
    if not parts:
        raise WeightsError(f"{path} holds no LoRA layers")
    layers: dict[str, dict[str, tuple[np.ndarray, np.ndarray]]] = {}
    rank = 0
    for (comp, pieces, prefix), roles in parts.items():
        name = pieces[0][0] if len(pieces) == 1 else "+".join(p[0].rsplit(".", 1)[-1] for p in pieces)
        if "down" not in roles or "up" not in roles:
            missing = "up (B)" if "down" in roles else "down (A)"
            raise WeightsError(f"{path}: layer {name} has no {missing} factor")
        down = np.asarray(tensors[roles["down"]], np.float32)
        up = np.asarray(tensors[roles["up"]], np.float32)
        down = down.reshape(down.shape[0], -1) if down.ndim == 4 and down.shape[2:] == (1, 1) else down
        up = up.reshape(up.shape[0], -1) if up.ndim == 4 and up.shape[2:] == (1, 1) else up
        cin = targets.layers[comp][pieces[0][0]][0]
        cout = sum(targets.layers[comp][p[0]][1] for p in pieces)
        r = down.shape[0]
        if down.ndim != 2 or up.ndim != 2 or down.shape[1] != cin or up.shape != (cout, r):
            raise WeightsError(f"{path}: layer {name} has factors {tuple(down.shape)} and {tuple(up.shape)}; "
                               f"the layer maps {cin} -> {cout} (a conv LoRA wider than 1x1 is not supported)")
        if "alpha" in roles:
            alpha = float(np.asarray(tensors[roles["alpha"]], np.float32).reshape(-1)[0])
        else:
            alpha = _alpha_from_metadata(meta, prefix, pieces[0][0], r)
        scale = 1.0 if alpha is None else alpha / r
        if not np.all(np.isfinite(down)) or not np.all(np.isfinite(up)) or not math.isfinite(scale):
            raise WeightsError(f"{path}: layer {name} holds non-finite values")
        for layer, start, stop, swap in pieces:  # a fused layer: A is shared, B's rows are split
            part = up if start is None else up[start:stop]
            if swap:  # BFL's final modulation is (shift, scale); diffusers' norm_out.linear (scale, shift)
                half = part.shape[0] // 2
                part = np.concatenate([part[half:], part[:half]])
            if layer in layers.get(comp, {}):
                raise WeightsError(f"{path}: layer {layer} is given twice (under two names)")
            layers.setdefault(comp, {})[layer] = (down, part * np.float32(scale))
        rank = max(rank, r)
    return LoraFile(source=str(source), layers=layers, rank=rank)


class LoraCache:
    """The LoRAs held ready, least recently used out: each file read once, its padded factors kept
    on the device with it (``LoraFile.device``). Counts hits, misses and evictions (a server's
    ``/metrics``). Thread-safe: a server reads files while parsing, its worker while running."""

    def __init__(self, max_size: int = _CACHE_SIZE, lock: Any = None) -> None:
        if max_size < 1:
            raise InvalidArgumentError(f"the LoRA cache size {max_size} must be >= 1", argument="max_loras")
        self.max_size = max_size
        self.hits = self.misses = self.evictions = 0
        self._files: OrderedDict[tuple[str, int], LoraFile] = OrderedDict()
        self._lock = threading.Lock() if lock is None else lock  # a LoraRuntime's own, when it holds the cache

    def __len__(self) -> int:
        return len(self._files)

    def get(self, source: str, targets: LoraTargets) -> LoraFile:
        """The file for ``source`` (read on a miss; a local file changed on disk is read again)."""
        try:
            stamp = 0 if re.match(r"^(https?|hf)://", source, re.I) else os.stat(_local_file(source)).st_mtime_ns
        except OSError:
            stamp = 0
        key = (source, stamp)
        with self._lock:
            hit = self._files.get(key)
            if hit is not None:
                self.hits += 1
                self._files.move_to_end(key)
                return hit
        lora = read_lora(source, targets)  # outside the lock: a download must not stall the others
        with self._lock:
            self.misses += 1
            self._files[key] = lora
            self._files.move_to_end(key)
            while len(self._files) > self.max_size:
                self._files.popitem(last=False)
                self.evictions += 1
        return lora


class LoraRuntime:
    """A pipeline's run-time LoRA state (``Pipeline.lora_runtime``; None for a model that takes no
    LoRA): the files held (a :class:`LoraCache`), the stacked slot mixes on the device, the zeros of
    empty slots, the rank buckets compiled so far and the zeros LoRAs warm-up runs -- all behind one
    lock, since a server parses requests (reading files, picking buckets) on its event loop's
    threads while its worker runs batches.

    ``targets``: the model's target layers; ``encoders``: the text encoders that take adapters
    (their names in ``targets.layers``)."""

    def __init__(self, targets: LoraTargets, encoders: Sequence[str] = (), max_loras: int = _CACHE_SIZE,
                 stack_slots: int | None = None) -> None:
        self.targets = targets
        self.encoders = tuple(encoders)
        self._lock = threading.RLock()
        self.cache = LoraCache(max_loras, lock=self._lock)
        self.stack_slots = _STACK_SLOTS if stack_slots is None else stack_slots
        self._stacks: OrderedDict[tuple, tuple[list, dict, int]] = OrderedDict()
        self._zeros: dict[tuple[str, int, str], dict] = {}
        self._buckets: set[int] = set()
        self._warm: dict[int, LoraFile] = {}

    @classmethod
    def of(cls, components: Any) -> "LoraRuntime | None":
        """The runtime for a model's components (``preheat.families.components.Components``; None
        when they offer no LoRA target layers)."""
        targets = components.lora_targets
        return None if targets is None else cls(targets, components.lora_encoders)

    def hold(self, max_loras: int | None = None, stack_slots: int | None = None) -> LoraCache:
        """A fresh LRU of ``max_loras`` files (a server's ``--max-loras``) and/or a budget of
        ``stack_slots`` slots in stacked mixes; returns the cache (what ``/metrics`` watches)."""
        with self._lock:
            if max_loras is not None:
                self.cache = LoraCache(max_loras, lock=self._lock)
            if stack_slots is not None:
                self.stack_slots = stack_slots
            return self.cache

    def file(self, source: Any) -> LoraFile:
        """``read_lora`` through the LRU; a ``LoraFile`` already read is used as it is."""
        if isinstance(source, LoraFile):
            return source
        with self._lock:
            cache = self.cache
        return cache.get(str(source), self.targets)

    # ---------------------------------------------------------------- rank buckets

    @property
    def buckets(self) -> tuple[int, ...]:
        """The rank buckets whose programs have run (sorted)."""
        with self._lock:
            return tuple(sorted(self._buckets))

    def compiled(self, bucket: int) -> None:
        """Note that a program of ``bucket`` has run (later requests prefer a bucket already compiled)."""
        with self._lock:
            self._buckets.add(bucket)

    def bucket_for(self, rank: int) -> int:
        """``bucket_for(rank, the buckets compiled so far)``."""
        return bucket_for(rank, self.buckets)

    def forget_buckets(self) -> None:
        with self._lock:
            self._buckets.clear()

    # ---------------------------------------------------------------- warm-up

    def warm_zeros(self, rank: int) -> LoraFile:
        """The zeros LoRA of ``rank`` warm-up runs (one per rank, kept: its device factors with it)."""
        with self._lock:
            held = self._warm.get(rank)
            if held is None:
                held = self._warm[rank] = self.targets.zeros(rank, self.encoders)
            return held

    # ---------------------------------------------------------------- device factors

    def factors(self, request: LoraRequest, comp: str, dtype: str) -> dict:
        """{layer path: (down (K, in, R), up (K, R, out))} on the device for ``comp``, cached per
        (files, bucket): the stacked slot mixes, least recently used out past ``stack_slots`` slots.

        Built on the device from each slot's own padded factors: a slot of one file takes the file's
        (kept with it, ``LoraFile.device``), so a new mix of files already held costs one stacking
        program, not a host rebuild and upload of every slot."""
        key = (comp, request.bucket, tuple(tuple(id(f) for f, _ in slot) for slot in request.slots))
        with self._lock:
            hit = self._stacks.get(key)
            if hit is not None:
                self._stacks.move_to_end(key)
                return hit[1]
        layers = self.targets.layers[comp]
        out = _stack([self._slot_factors(slot, comp, layers, request.bucket, dtype) for slot in request.slots])
        with self._lock:
            # the files are held too, so that their ids in the key stay theirs while the entry lives
            self._stacks[key] = ([f for slot in request.slots for f, _ in slot], out, len(request.slots))
            self._stacks.move_to_end(key)
            while len(self._stacks) > 1 and sum(entry[2] for entry in self._stacks.values()) > self.stack_slots:
                self._stacks.popitem(last=False)
        return out

    def _slot_factors(self, slot: tuple[tuple[LoraFile, float], ...], comp: str,
                      layers: Mapping[str, tuple[int, int]], r: int, dtype: str) -> dict:
        """One slot's {layer: (down (in, R), up (R, out))} on the device: zeros for an empty slot
        (kept here), a lone file's own (kept with the file), else built for this slot."""
        if len(slot) == 1:
            held = slot[0][0].device
        else:
            held = self._zeros if not slot else {}
        with self._lock:
            hit = held.get((comp, r, dtype))
        if hit is not None:
            return hit
        out = _slot_arrays(slot, comp, layers, r, dtype)
        with self._lock:
            return held.setdefault((comp, r, dtype), out)

    @property
    def stacks_held(self) -> int:
        """Stacked mixes held now."""
        with self._lock:
            return len(self._stacks)


def check_lora_ranks(ranks: Sequence[int]) -> tuple[int, ...]:
    """Declared LoRA rank buckets (``--lora-ranks``): each must be one of ``BUCKETS``; one-line error."""
    wrong = [r for r in ranks if r not in BUCKETS]
    if wrong:
        raise InvalidArgumentError(f"LoRA rank bucket(s) {', '.join(map(str, wrong))} are not rank buckets; "
                                   f"buckets: {', '.join(map(str, BUCKETS))}")
    return tuple(ranks)


# --------------------------------------------------------------------------------------- requests


def _scale(value: Any, name: str = "lora_scale") -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise InvalidArgumentError(f"{name}={value!r} must be a number", argument=name)
    if not math.isfinite(float(value)):
        raise InvalidArgumentError(f"{name}={value!r} must be a finite number", argument=name)
    return float(value)


def _entries(spec: Any, default: float) -> list[tuple[Any, float]]:
    """One image's adapters: a source, (source, scale), or a list of either -> [(source, scale)]."""
    if spec is None:
        return []
    if isinstance(spec, (str, os.PathLike, LoraFile)):
        return [(spec, default)]
    if isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[0], (str, os.PathLike, LoraFile)):
        return [(spec[0], _scale(spec[1]))]
    if isinstance(spec, (list, tuple)):
        out: list[tuple[Any, float]] = []
        for item in spec:
            if isinstance(item, (list, tuple)) and not (len(item) == 2
                                                        and isinstance(item[0], (str, os.PathLike, LoraFile))):
                raise InvalidArgumentError(f"lora entry {item!r} must be a source or (source, scale)", argument="lora")
            out.extend(_entries(item, default))
        return out
    raise InvalidArgumentError(f"lora={spec!r} must be a source, (source, scale), or a list of them", argument="lora")


def parse_cli(spec: str) -> tuple[str, float]:
    """``--lora SRC[:SCALE]`` -> (source, scale); a colon that is part of the source (``http://``,
    ``host:port``) stays in it: only a number after the last colon is a scale."""
    source, colon, tail = spec.rpartition(":")
    if colon and source and not tail.startswith("/"):
        try:
            value = float(tail)
        except ValueError:
            return spec, 1.0
        return source, _scale(value, "--lora scale")
    return spec, 1.0


def bucket_for(rank: int, compiled: Sequence[int] = ()) -> int:
    """The rank bucket for a slot of ``rank`` columns: a bucket already compiled if one fits
    (no new program), else the smallest that does; above the largest, a one-line error."""
    if rank > BUCKETS[-1]:
        raise InvalidArgumentError(f"LoRA rank {rank} is above the largest rank bucket; buckets: "
                                   f"{', '.join(map(str, BUCKETS))} (for LoRAs used together, their ranks add up)",
                                   argument="lora")
    fits = [b for b in compiled if b >= rank] or [b for b in BUCKETS if b >= rank]
    return min(fits)


def parse_request(pipe: Any, n: int, lora: Any, lora_scale: Any) -> LoraRequest | None:
    """``lora`` / ``lora_scale`` of a call -> a LoraRequest (None when no LoRA was asked for).

    ``lora``: a source (path, http(s)://, hf://), ``(source, scale)``, a list of those (used
    together on every image), or -- one entry per image -- a list of n entries where at least one
    is None or a list: ``[["a.safetensors"], None, [("a.safetensors", .5), "b.safetensors"]]``.
    ``lora_scale`` (default 1) is the scale of every source given without its own. A source may
    also be a ``LoraFile`` already read.

    Slots: one for LoRAs given for every image; per image, the batch size rounded up to a power of
    two, whatever the mix -- so that any mix of LoRAs on n images runs one program per bucket.
    """
    if lora is None:
        if lora_scale is not None:
            raise InvalidArgumentError("lora_scale is given but no lora", argument="lora_scale")
        return None
    runtime: LoraRuntime | None = pipe.lora_runtime
    if runtime is None:
        raise InvalidArgumentError(f"LoRAs are not supported for a {pipe.family.name} model", argument="lora")
    default = 1.0 if lora_scale is None else _scale(lora_scale)
    per_image = (isinstance(lora, list) and len(lora) == n
                 and any(item is None or isinstance(item, list) for item in lora))
    specs = [_entries(item, default) for item in lora] if per_image else [_entries(lora, default)] * n
    slots_of: list[tuple[tuple[LoraFile, float], ...]] = []
    for entries in specs:
        slots_of.append(tuple((runtime.file(src), s) for src, s in entries))
    distinct: list[tuple[tuple[LoraFile, float], ...]] = []
    keys: list[tuple] = []
    index = []
    for slot in slots_of:
        key = tuple((id(f), s) for f, s in slot)
        if key not in keys:
            keys.append(key)
            distinct.append(slot)
        index.append(keys.index(key))
    k = 1
    while k < (n if per_image else len(distinct)):
        k *= 2
    distinct += [()] * (k - len(distinct))  # padding slots: no adapter
    need = max(sum(f.rank for f, _ in slot) for slot in distinct)
    bucket = runtime.bucket_for(need)
    return LoraRequest(slots=tuple(distinct), index=np.asarray(index, np.int32), bucket=bucket)


# --------------------------------------------------------------------------------------- device arguments


_STACK_SLOTS = 16  # slots held in stacked mixes per pipeline (a stack of K slots is K LoRAs' worth of memory;
# LoraRuntime.hold(stack_slots=) changes it)


def _stack(slots: list[dict]) -> dict:
    """K slots' {layer: (down (in, R), up (R, out))} -> {layer: (down (K, in, R), up (K, R, out))},
    in one device program (cached by JAX per shapes)."""
    import jax
    import jax.numpy as jnp

    global _STACKER
    if _STACKER is None:
        _STACKER = jax.jit(lambda xs: jax.tree.map(lambda *leaves: jnp.stack(leaves), *xs))
    return _STACKER(slots)


_STACKER: Any = None


def _slot_arrays(slot: tuple[tuple[LoraFile, float], ...], comp: str, layers: Mapping[str, tuple[int, int]],
                 r: int, dtype: str) -> dict:
    """One slot's {layer: (down (in, R), up (R, out))}, put on the device (zeros where no file has the layer)."""
    import jax.numpy as jnp

    out = {}
    for layer, (cin, cout) in layers.items():
        down = np.zeros((cin, r), np.float32)
        up = np.zeros((r, cout), np.float32)
        col = 0
        for f, _ in slot:
            pair = f.layers.get(comp, {}).get(layer)
            if pair is not None:
                a, b = pair  # (rank, in), (out, rank)
                down[:, col:col + a.shape[0]] = a.T
                up[col:col + a.shape[0], :] = b.T
            col += f.rank
        out[layer] = (jnp.asarray(down, dtype), jnp.asarray(up, dtype))
    return out


def _scales(request: LoraRequest) -> np.ndarray:
    """(K, R) float32: each rank column's user scale (0 where no LoRA sits)."""
    scales = np.zeros((len(request.slots), request.bucket), np.float32)
    for s, slot in enumerate(request.slots):
        col = 0
        for f, scale in slot:
            scales[s, col:col + f.rank] = scale
            col += f.rank
    return scales


def denoiser_args(pipe: Any, request: LoraRequest) -> tuple[dict, np.ndarray]:
    """The denoiser's adapters for a call: (factors, scales); with each image's slot they make the
    denoising program's ``DenoiseArgs.lora`` (``preheat.families.stages.LoraArgs``)."""
    return pipe.lora_runtime.factors(request, "denoiser", pipe.dtype), _scales(request)


def encoder_adapters(runtime: LoraRuntime | None, request: LoraRequest | None, dtype: str) -> tuple[Any, ...] | None:
    """Per text encoder: (factors, scales), for every encoder as soon as any slot's file has layers
    for one of them (zeros for the others: two encode programs per bucket, with and without, rather
    than one per combination); None when no file has any (the encode program stays the plain one).
    ``dtype``: the text encoders' weights'."""
    if request is None or runtime is None:
        return None
    names = runtime.encoders
    if not any(name in f.layers for name in names for slot in request.slots for f, _ in slot):
        return None
    return tuple((runtime.factors(request, name, dtype), _scales(request)) for name in names)
