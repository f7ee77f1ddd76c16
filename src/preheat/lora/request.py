"""A call's ``lora=`` / ``lora_scale=`` (and ``--lora SRC[:SCALE]``) -> a LoraRequest: per-image
slots, padded to a power of two, and the rank bucket that holds them."""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

from preheat.errors import InvalidArgumentError
from preheat.lora.files import LoraFile
from preheat.lora.runtime import LoraRequest, LoraRuntime

__all__ = ["parse_cli", "parse_request"]

def _scale(value: Any, name: str = "lora_scale") -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise InvalidArgumentError.about("{0}={value!r} must be a number", name, value=value)
    if not math.isfinite(float(value)):
        raise InvalidArgumentError.about("{0}={value!r} must be a finite number", name, value=value)
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
