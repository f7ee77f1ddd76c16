"""GGUF checkpoints (llama.cpp's format) as deployers ship FLUX.1 transformers: kept quantised on the device.

    preheat.load("flux1-dev-Q4_K_S.gguf", config="<FLUX.1 diffusers folder>")

A FLUX.1 GGUF file (city96's layout) holds Black Forest Labs' transformer under its original
names (``double_blocks.0.img_attn.qkv.weight``, ...; ``preheat.models.bfl``'s table), each tensor
in one GGML type. This module reads such a file as the tensors of a scaled checkpoint, so the
single-file conversion (``preheat.models.single_file``) and ``weights.fill`` treat it as they
treat a scaled fp8 file (``preheat.models.scaled_fp8``): no dequantisation on the host.

    F32, F16, BF16   the tensor as it is (GGML's dimensions reversed: torch's order)
    Q8_0             blocks of 32 int8 along the last (torch) axis, one float16 scale each:
                     ``X.weight``       int8     (out, in)        the values
                     ``X.scale_weight`` float16  (out, in / 32)   one scale per block
    Q4_0 Q4_1 Q5_0   the file's blocks as they are (``preheat.models.ggml.LAYOUTS``):
    Q5_1 Q2_K Q3_K   ``X.weight_Q4_K``  uint8    (out, in / QK * BYTES)   each row's blocks
    Q4_K Q5_K Q6_K   (the kind in the name, so the headers alone say what a tensor is)
    IQ4_NL IQ4_XS

A Q8_0 weight then stays int8 + float16 on the device (``quantised.Quantised``) and the compiled
program expands ``values * scale`` in float32 where the weight is used, as diffusers' GGUF
quantizer does in its compute dtype; a packed weight stays its blocks (``quantised.Packed``,
in the kernel's layout) and the program unpacks them (``ggml.dequantise``: gguf's own numpy
dequantisation, bit for bit). Cutting a fused weight's rows (BFL's ``qkv``) cuts whole rows of
blocks, so the conversion moves bytes only. Any other GGML type (Q8_1, IQ2_XS, TQ2_0, ...) is
one ``ModelFormatError`` naming it and the types read here. The file is memory-mapped by ``gguf``'s
reader; a tensor's bytes are read when it is indexed.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from preheat.errors import MissingExtraError, ModelFormatError
from preheat.models.ggml import LAYOUTS

__all__ = ["SUPPORTED", "BLOCK", "GGUFTensors", "is_gguf", "split_q8_0", "packed_name", "packed_weights"]

SUPPORTED = ("F32", "F16", "BF16", "Q8_0", *LAYOUTS)  # the GGML types read here
BLOCK = 32  # Q8_0: values per block, each block 2 bytes of float16 scale then 32 int8
_SCALE = "scale_weight"  # a Q8_0 weight's scales, named as a scaled fp8 file names its scale


def packed_name(weight: str, kind: str) -> str:
    """The name a packed weight's blocks go by: ``X.weight`` in Q4_K -> ``X.weight_Q4_K``."""
    return f"{weight}_{kind}"


def packed_weights(keys: Iterable[str]) -> dict[str, tuple[str, str]]:
    """{``X.weight``: (``X.weight_Q4_K``, ``"Q4_K"``)} for every packed weight among ``keys`` (a
    converted folder's too: the names alone, no tensor is read)."""
    out = {}
    for key in keys:
        head, sep, kind = key.rpartition(".weight_")
        if sep and kind in LAYOUTS:
            out[f"{head}.weight"] = (key, kind)
    return out


def is_gguf(path: str | Path) -> bool:
    """Whether ``path`` is a GGUF file (its name; the reader checks the magic)."""
    return Path(path).suffix.lower() == ".gguf"


def split_q8_0(data: np.ndarray, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Q8_0 bytes ``data`` (uint8, (..., in / 32 * 34)) of a tensor of torch ``shape`` (..., in) ->
    (int8 values of ``shape``, float16 scales of shape (..., in / 32)). Bytes are moved, not converted."""
    *lead, width = shape
    blocks = np.asarray(data, np.uint8).reshape(*lead, width // BLOCK, 2 + BLOCK)  # (..., nb, 34)
    scales = np.ascontiguousarray(blocks[..., :2]).view(np.float16).reshape(*lead, width // BLOCK)
    values = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(shape)
    return values, scales


class GGUFTensors(Mapping[str, np.ndarray]):
    """The tensors of one GGUF file under their names, a Q8_0 weight as its values and its scales,
    a packed weight as its rows of blocks under ``X.weight_<KIND>`` (the module docstring); every
    tensor's type is checked when the file is opened."""

    def __init__(self, path: str | Path):
        try:
            from gguf import GGMLQuantizationType, GGUFReader
        except ModuleNotFoundError as exc:
            raise (MissingExtraError.of(exc, f"reading the GGUF file {path}") or exc) from None
        self.path = Path(path)
        try:
            reader = GGUFReader(str(path))
        except (ValueError, OSError, IndexError) as exc:  # a bad magic, a torn file
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise ModelFormatError(f"cannot read {path} as GGUF: {reason[:160]}") from None
        self._q8 = GGMLQuantizationType.Q8_0
        self._tensors: dict[str, Any] = {}  # name -> the reader's tensor
        self._scales: dict[str, str] = {}  # scale name -> its Q8_0 weight's name
        self._packed: dict[str, str] = {}  # X.weight_Q4_K -> X.weight
        for tensor in reader.tensors:
            kind = tensor.tensor_type.name
            if kind not in SUPPORTED:
                raise ModelFormatError(f"{path}: {tensor.name} is GGUF type {kind}; preheat reads "
                                       f"{', '.join(SUPPORTED)}")
            self._tensors[tensor.name] = tensor
            if kind in LAYOUTS:
                if not tensor.name.endswith(".weight") or len(tensor.shape) != 2:
                    raise ModelFormatError(f"{path}: {tensor.name} is {kind} but not a 2-D weight (preheat keeps "
                                           f"{kind} blocks as a layer's weight)")
                self._packed[packed_name(tensor.name, kind)] = tensor.name
            if tensor.tensor_type == self._q8:
                if not tensor.name.endswith(".weight") or int(tensor.shape[0]) % BLOCK:
                    raise ModelFormatError(f"{path}: {tensor.name} is Q8_0 but not a weight whose rows are "
                                           f"blocks of {BLOCK}")
                self._scales[f"{tensor.name.rpartition('.')[0]}.{_SCALE}"] = tensor.name

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every stored tensor's shape in torch's axis order under its own name (the scales left
        out, a packed weight's elements not its bytes), from the header alone: what
        ``preheat.models.published`` infers the model from."""
        return {name: tuple(int(d) for d in reversed(t.shape.tolist())) for name, t in self._tensors.items()}

    def __getitem__(self, key: str) -> np.ndarray:
        if key in self._scales:
            return self._read(self._scales[key])[1]
        if key in self._packed:  # each row's blocks, bytes as stored: (out, in / QK * BYTES)
            tensor = self._tensors[self._packed[key]]
            return np.asarray(tensor.data, np.uint8).reshape(int(tensor.shape[-1]), -1)
        if key in self._tensors and self._tensors[key].tensor_type.name in LAYOUTS:
            raise KeyError(key)  # read under its packed name
        return self._read(key)[0]

    def _read(self, name: str) -> tuple[np.ndarray, np.ndarray | None]:
        tensor = self._tensors[name]
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # GGML's ne0 is torch's last axis
        if tensor.tensor_type == self._q8:
            return split_q8_0(tensor.data, shape)
        if tensor.tensor_type.name == "BF16":  # read as bytes
            return np.asarray(tensor.data).view(ml_dtypes.bfloat16).reshape(shape), None
        return np.asarray(tensor.data).reshape(shape), None

    def __iter__(self) -> Iterator[str]:
        packed = set(self._packed.values())
        yield from (name for name in self._tensors if name not in packed)
        yield from self._scales
        yield from self._packed

    def __len__(self) -> int:
        return len(self._tensors) + len(self._scales)

    def __enter__(self) -> "GGUFTensors":  # as a Checkpoint is used by the single-file conversion
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

