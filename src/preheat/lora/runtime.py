"""What a pipeline keeps between LoRA calls -- files read, stacked slot mixes on the device, the
zeros of empty slots, the rank buckets compiled -- and the programs' adapter arguments."""

from __future__ import annotations

import os
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from preheat.errors import InvalidArgumentError
from preheat.lora.files import LoraFile, LoraTargets, local_file, read_lora

__all__ = ["BUCKETS", "LoraRequest", "LoraCache", "LoraRuntime", "check_lora_ranks", "bucket_for", "denoiser_args",
           "encoder_adapters"]

BUCKETS = (16, 32, 64, 128)  # rank buckets: one compiled program per bucket (and slot count)
_CACHE_SIZE = 8  # LoRA files, and stacked slot mixes, held per pipeline (least recently used out)


@dataclass(frozen=True)
class LoraRequest:
    """A call's adapters: distinct slots, each image's slot, the rank bucket (all host-side)."""

    slots: tuple[tuple[tuple[LoraFile, float], ...], ...]  # K slots (padded with empty ones)
    index: np.ndarray  # (n,) int32
    bucket: int

    @property
    def signature(self) -> tuple[int, int]:
        return self.bucket, len(self.slots)


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
            stamp = 0 if re.match(r"^(https?|hf)://", source, re.I) else os.stat(local_file(source)).st_mtime_ns
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


def bucket_for(rank: int, compiled: Sequence[int] = ()) -> int:
    """The rank bucket for a slot of ``rank`` columns: a bucket already compiled if one fits
    (no new program), else the smallest that does; above the largest, a one-line error."""
    if rank > BUCKETS[-1]:
        raise InvalidArgumentError(f"LoRA rank {rank} is above the largest rank bucket; buckets: "
                                   f"{', '.join(map(str, BUCKETS))} (for LoRAs used together, their ranks add up)",
                                   argument="lora")
    fits = [b for b in compiled if b >= rank] or [b for b in BUCKETS if b >= rank]
    return min(fits)


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
