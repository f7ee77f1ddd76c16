"""LoRA files read onto a model's target layers: key styles, alphas, fused layers, one-line errors
(the key styles are listed in ``preheat.lora``'s docstring)."""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from preheat.errors import ModelFormatError, ModelNotFoundError, WeightsError
from preheat.models.bfl import Piece

__all__ = ["LoraTargets", "LoraFile", "read_lora", "local_file"]

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

    ``layers``: component -> {layer path: (in, out)} (``preheat.models.adapters.targets``); the
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
    # file prefixes of a component the family's model lacks (an SDXL refiner's first text encoder)
    # -> that component: a file's keys there are refused by name
    absent: Mapping[str, str] = field(default_factory=dict)

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




def local_file(source: str) -> Path:
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
    from preheat.models.safetensors_files import read_tensors

    path = local_file(str(source))
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
    for prefix, comp in targets.absent.items():
        lacking = [k for k in unmatched if k.startswith(prefix + ("_" if prefix.startswith("lora_") else "."))]
        if lacking:
            raise WeightsError(f"{path}: {len(lacking)} LoRA key(s) are for {comp}, which this {targets.family} "
                               f"model does not have, e.g. {lacking[0]}")
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
