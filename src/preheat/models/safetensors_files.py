"""Checkpoint files read directly: a component folder's safetensors file(s), and JSON beside them.

Why not the ``safetensors`` package: its ``safe_open`` maps the file into the process (that grew
the process by twice as much as plain reads, for no speed gain: docs/benchmarks.md), and what
``preheat.models.weights.fill`` needs first is the table alone, to check every key, shape and
dtype before a byte of tensor data is read. So the format is read here: an 8-byte little-endian
header length, a JSON header bounded by the format's own limit (100 MB) and checked against the
file's size (a torn or corrupt file is one ``ModelFormatError`` naming it, never a wrong tensor),
then each tensor's bytes at the offsets the header gives, read with plain reads when asked for.

    read_header(path)      {key: TensorInfo}: dtype, shape, byte span; no tensor data read
    TensorInfo.read()      one tensor's bytes, as a numpy array (bf16 and fp8 through ml_dtypes)
    read_tensors(files)    a lazy ``Checkpoint`` (a mapping read on access) over a component's files
    weight_files(folder)   which files those are (below)
    bare_read(files)       the yardstick: a bare ``safe_open`` read of every tensor (issue 17)

Weight files a component folder may hold, in the order they are looked for::

    <stem>[.<variant>].safetensors                     one file
    <stem>.safetensors.index[.<variant>].json + shards  sharded (``weight_map``); what diffusers
    <stem>[.<variant>].safetensors.index.json + shards  and transformers write, then the older name

where ``stem`` is ``diffusion_pytorch_model`` (diffusers) or ``model`` (transformers).
Placing the tensors into a model (layout, dtype, the device, the bytes in flight) is
``preheat.models.weights``'s; nothing here needs jax.
"""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import ml_dtypes
import numpy as np

from preheat.errors import ModelFormatError, ModelNotFoundError

__all__ = [
    "DIFFUSERS_STEM",
    "TRANSFORMERS_STEM",
    "read_json",
    "weight_files",
    "TensorInfo",
    "read_header",
    "Checkpoint",
    "read_tensors",
    "bare_read",
]

DIFFUSERS_STEM = "diffusion_pytorch_model"
TRANSFORMERS_STEM = "model"


def read_json(path: Path, what: str = "config") -> dict[str, Any]:
    """A JSON object from ``path``; a missing file or bad JSON is a one-line error naming it."""
    if not path.is_file():
        raise ModelNotFoundError(f"{path} does not exist ({what})")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        reason = f"{exc.msg} (line {exc.lineno})" if isinstance(exc, json.JSONDecodeError) else "not UTF-8"
        raise ModelFormatError(f"{path} is not valid JSON: {reason}") from None
    if not isinstance(raw, dict):
        raise ModelFormatError(f"{path} must hold a JSON object")
    return raw


def weight_files(folder: Path, stems: Sequence[str] = (DIFFUSERS_STEM, TRANSFORMERS_STEM),
                 variant: str | None = None) -> list[Path]:
    """The safetensors file(s) of one component folder (see the module docstring)."""
    tried = []
    for stem in stems:
        base = f"{stem}.{variant}" if variant else stem
        single = folder / f"{base}.safetensors"
        tried.append(single.name)
        if single.is_file():
            return [single]
        # diffusers and transformers name a variant's index <stem>.safetensors.index.<variant>.json
        indexes = [folder / f"{stem}.safetensors.index.{variant}.json"] if variant else []
        indexes.append(folder / f"{base}.safetensors.index.json")
        index = next((i for i in indexes if i.is_file()), None)
        if index is not None:
            weight_map = read_json(index, "shard index").get("weight_map")
            if not isinstance(weight_map, dict):
                raise ModelFormatError(f"{index} has no 'weight_map' object")
            shards = sorted(set(weight_map.values()))
            missing = [s for s in shards if not (folder / s).is_file()]
            if missing:
                raise ModelNotFoundError(f"{folder} is missing shard file(s) {', '.join(missing)} listed in {index.name}")
            return [folder / s for s in shards]
    bins = sorted(p.name for p in folder.glob("*.bin"))
    if bins:
        raise ModelNotFoundError(
            f"{folder} has only {bins[0]}; preheat reads safetensors only "
            "(convert once with diffusers/transformers: from_pretrained(p).save_pretrained(p))")
    hint = f" (variant {variant!r})" if variant else ""
    raise ModelNotFoundError(f"{folder} has no {' or '.join(tried)}{hint}")


# safetensors dtype names -> numpy (bf16 and fp8 through ml_dtypes, which jax uses too)
_DTYPES: dict[str, np.dtype] = {name: np.dtype(t) for name, t in {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
    "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_,
}.items()}
_MAX_HEADER = 100_000_000  # the safetensors format's own limit


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's header entry: where its bytes are, and what they hold."""

    file: Path
    key: str  # as stored in the file (before ``rename``)
    dtype: np.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in ``file``
    nbytes: int

    def read(self, into: np.ndarray | None = None) -> np.ndarray:
        """This tensor, read with plain reads (no mmap, so no file pages are mapped into the process
        and the resident set is only what is allocated here): into a fresh buffer nobody else refers
        to, or into ``into`` (a reusable uint8 scratch buffer of at least ``nbytes``)."""
        buf = np.empty(self.nbytes, np.uint8) if into is None else into[:self.nbytes]
        view = memoryview(buf)
        got = 0
        try:
            with open(self.file, "rb", buffering=0) as f:
                f.seek(self.start)
                while got < self.nbytes:  # one read returns at most ~2 GiB on Linux
                    n = f.readinto(view[got:])
                    if not n:
                        raise _format_error(self.file, f"truncated while reading {self.key} (the file changed?)")
                    got += n
        except OSError as exc:
            raise _format_error(self.file, f"{self.key}: {exc.strerror or type(exc).__name__}") from None
        return buf.view(self.dtype).reshape(self.shape)


def _format_error(path: Path, reason: str) -> ModelFormatError:
    return ModelFormatError(f"cannot read {path}: {reason}")


def read_header(path: Path) -> dict[str, TensorInfo]:
    """The tensor table of one safetensors file, checked against the file's size; no tensor data
    is read. A torn or corrupt file is one ``ModelFormatError`` naming it."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            f.seek(0)
            if size < 8:
                raise _format_error(path, f"{size} bytes is too short for a safetensors file")
            (n,) = struct.unpack("<Q", f.read(8))
            if n > min(_MAX_HEADER, size - 8):
                raise _format_error(path, f"header length {n} does not fit in a file of {size} bytes (truncated?)")
            raw = f.read(n)
    except OSError as exc:
        raise _format_error(path, exc.strerror or type(exc).__name__) from None
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise _format_error(path, "the header is not valid JSON (corrupt?)") from None
    if not isinstance(header, dict):
        raise _format_error(path, "the header is not a JSON object")
    data_start, data_len = 8 + n, size - 8 - n
    out: dict[str, TensorInfo] = {}
    end_max = 0
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        try:
            name = entry["dtype"]
            shape = tuple(int(d) for d in entry["shape"])
            begin, end = (int(o) for o in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise _format_error(path, f"header entry {key!r} is malformed") from None
        if name not in _DTYPES:
            raise _format_error(path, f"{key} has dtype {name!r}; readable: {', '.join(_DTYPES)}")
        dtype = _DTYPES[name]
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if min(shape, default=0) < 0 or begin < 0 or end - begin != nbytes:
            raise _format_error(path, f"{key} spans bytes {begin}..{end}, but {dtype} {shape} needs {nbytes}")
        if end > data_len:
            raise _format_error(path, f"truncated: {key} ends at data byte {end}, the file holds {data_len}")
        end_max = max(end_max, end)
        out[key] = TensorInfo(path, key, dtype, shape, data_start + begin, nbytes)
    if end_max != data_len:
        raise _format_error(path, f"{data_len - end_max} bytes after the last tensor (corrupt?)")
    return out


class Checkpoint(MutableMapping[str, np.ndarray]):
    """The tensors of one component's safetensors files, read on access.

    Made by ``read_tensors``: only the headers are read, so keys, shapes and dtypes are known up
    front (``info``) while each tensor's bytes are read when it is indexed, as a fresh numpy array
    (bf16 through ml_dtypes). It behaves like the dict ``read_tensors`` used to return: assigning
    a key keeps that array in memory, deleting hides the key. ``dict(checkpoint)`` still works,
    but reads every tensor: pass the ``Checkpoint`` itself to ``fill`` to stream.
    """

    def __init__(self, files: Iterable[Path], rename: Callable[[str], str] | None = None):
        self.files = [Path(f) for f in files]
        self._info: dict[str, TensorInfo] = {}
        self._held: dict[str, np.ndarray] = {}  # assigned by the caller
        for f in self.files:
            for key, info in read_header(f).items():
                self._info[rename(key) if rename else key] = info  # later files win, as dict updates did

    def info(self, key: str) -> TensorInfo | None:
        """The header entry of ``key``; None for a missing key or one assigned in memory."""
        return self._info.get(key)

    def meta(self, key: str) -> tuple[tuple[int, ...], np.dtype] | None:
        """(shape, dtype) of ``key`` without reading it; None if missing."""
        if key in self._held:
            return tuple(self._held[key].shape), self._held[key].dtype
        info = self._info.get(key)
        return None if info is None else (info.shape, info.dtype)

    @property
    def nbytes(self) -> int:
        return sum(i.nbytes for i in self._info.values()) + sum(a.nbytes for a in self._held.values())

    def __getitem__(self, key: str) -> np.ndarray:
        if key in self._held:
            return self._held[key]
        return self._info[key].read()

    def __setitem__(self, key: str, value: np.ndarray) -> None:
        self._info.pop(key, None)
        self._held[key] = np.asarray(value)

    def __delitem__(self, key: str) -> None:
        if key in self._held:
            del self._held[key]
        else:
            del self._info[key]

    def __contains__(self, key: object) -> bool:
        return key in self._info or key in self._held

    def __iter__(self) -> Iterator[str]:
        yield from self._info
        yield from self._held

    def __len__(self) -> int:
        return len(self._info) + len(self._held)

    def __enter__(self) -> "Checkpoint":  # as safetensors' safe_open is used; nothing is held open
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def __repr__(self) -> str:
        return f"Checkpoint({len(self)} tensors, {self.nbytes} bytes, files={[f.name for f in self.files]})"


def read_tensors(files: Iterable[Path], rename: Callable[[str], str] | None = None) -> Checkpoint:
    """The tensors of ``files`` (keys passed through ``rename``), as a lazy ``Checkpoint``: the
    headers are read and checked now, each tensor's bytes when it is used (``fill`` streams them)."""
    return Checkpoint(files, rename)


def bare_read(files: Iterable[Path]) -> tuple[float, int]:
    """(seconds, bytes) of a bare safetensors read of ``files``: every tensor through
    ``safe_open(framework="numpy")``, nothing kept. The yardstick for the weights phase (issue 17)."""
    from safetensors import safe_open

    t0, total = time.perf_counter(), 0
    for f in files:
        with safe_open(str(f), framework="numpy") as handle:
            for key in handle.keys():
                total += handle.get_tensor(key).nbytes
    return time.perf_counter() - t0, total
