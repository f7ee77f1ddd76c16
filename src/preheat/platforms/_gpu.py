"""NVIDIA GPUs: cuDNN's fused attention where it can run, XLA's convolutions (matrix products in a
deviceless compile), autotuned compiles, and a key that names what decides the generated code.

Attention: cuDNN's fused kernel takes bf16/fp16 in BTNH layout with a head dim that is a multiple
of 8 and at most 128, and needs a cuDNN package on the compiling machine. Hopper (9.x) would take
heads up to 256, but jax checks that limit against the *running* backend, so heads above 128 (SD
1.5's 160-wide deepest blocks) take XLA's path everywhere. A deviceless compile (``preheat warm
--target``) takes XLA's path for every layer: XLA builds a fused-attention call's cuDNN graph (its
execution plan and workspace) only when it compiles with the device at hand; compiled without
one, the executable holds the call but no graph, and its thunk finds none at the first run (read
in XLA's GPU compiler and cuDNN thunk, docs/gpu.md). The pod's own trace reads its device and
fuses; its autotuned retune swaps that program in when faster.

Convolutions: XLA's (cuDNN's) on a device, one matrix product per tap in a deviceless compile:
XLA leaves a cuDNN convolution's algorithm unchosen there (choosing is timing), and the H200
rejected such an executable at its first run (docs/gpu.md), while a matrix product compiles to a
Triton GEMM that needs no choice (``preheat.models.conv``).

The key (``device_fields``) holds what decides whether generated code runs on a card, read from
XLA's description of it (``gpu_fields``): compute capability and feature extension, core count,
the thread, register and shared-memory limits -- never the card's marketing name, clocks,
bandwidth, memory or L2 size, which differ between boards of one chip and between XLA's file and
the card (docs/gpu.md, first run) and only steer heuristics the pod's autotuned recompile
revisits. A pod computes the same fields from its own device's description
(``local_description``) as a builder does from a shipped one (``preheat.cache.targets``).
"""

from __future__ import annotations

import functools
import os
import re
from importlib import metadata
from typing import Any, Optional

from preheat.errors import TargetError
from preheat.platforms._base import Attention, AttentionLayer, ConvLayer, Platform, accelerator_xla_flags

__all__ = ["GpuPlatform", "parse_description", "gpu_fields", "cuda_versions", "cudnn_available",
           "local_description", "device_gpu_fields"]

# The description's fields that decide whether generated code runs, which every board of a chip
# reports exactly (see the module docstring for what is left out, and why).
_CODE_FIELDS = ("core_count", "fpus_per_core", "threads_per_warp", "threads_per_block_limit",
                "threads_per_core_limit", "shared_memory_per_block", "shared_memory_per_block_optin",
                "shared_memory_per_core", "registers_per_core_limit", "registers_per_block_limit")


class GpuPlatform(Platform):
    """NVIDIA GPUs (jax's "gpu" devices with the CUDA plugin)."""

    name = "gpu"
    autotunes = True
    doctor_checks = ("cuda_libs", "ld_library_path", "gpu_memory")

    def attention(self, layer: AttentionLayer, capability: Any = None, deviceless: bool = False) -> Attention:
        """"cudnn" where its constraints hold on the GPU compiling it, "xla" on other layers and in
        every deviceless compile (explicit, so that jax never picks what the caller did not)."""
        if deviceless:  # no device, no cuDNN graph: the module docstring
            return Attention("xla")
        fused = (layer.dtype in ("bfloat16", "float16") and layer.head_dim % 8 == 0 and layer.head_dim <= 128
                 and not layer.masked and capability is not None and tuple(capability) >= (8, 0)
                 and cudnn_available())
        return Attention("cudnn" if fused else "xla")

    def conv_form(self, layer: Optional[ConvLayer], deviceless: bool = False) -> str:
        return "taps" if deviceless else "conv"

    def device_fields(self, device: Any, mesh_size: Optional[int], target: Any = None) -> dict[str, Any]:
        """The description's code fields (a pod's own, or a ``target``'s), the CUDA plugin and
        cuDNN versions, the program's device count and the XLA flags a GPU reads."""
        return {"platform": "gpu", "gpu": target.gpu if target is not None else device_gpu_fields(device),
                "device_count": 1 if mesh_size is None else mesh_size,
                "cuda": cuda_versions(), "xla_flags": accelerator_xla_flags()}

    def autotunes_now(self) -> bool:
        """XLA autotunes GPU compiles unless ``--xla_gpu_autotune_level=0`` switches it off."""
        return "--xla_gpu_autotune_level=0" not in os.environ.get("XLA_FLAGS", "").split()


_TOKEN = re.compile(r'\s+|#[^\n]*|"(?:[^"\\]|\\.)*"|[{}:]|[^\s{}:"#]+')


def parse_description(text: str, source: str = "description") -> dict[str, list[Any]]:
    """A text-format protobuf message -> ``{field: [values]}`` (messages nested the same way;
    numbers and enum names as strings). Enough for XLA's target descriptions; anything that is
    not well-formed text format fails in one line."""
    tokens = [t for t in _TOKEN.findall(text) if t.strip() and not t.startswith("#")]
    if "".join(_TOKEN.findall(text)) != text:
        raise TargetError(f"{source}: not a text-format GPU description (unexpected characters)", reason="malformed")
    pos = 0

    def message(depth: int) -> dict[str, list[Any]]:
        nonlocal pos
        out: dict[str, list[Any]] = {}
        while pos < len(tokens):
            name = tokens[pos]
            if name == "}":
                if depth == 0:
                    raise TargetError(f"{source}: unbalanced '}}'", reason="malformed")
                pos += 1
                return out
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
                raise TargetError(f"{source}: expected a field name, found {name[:40]!r}", reason="malformed")
            pos += 1
            if pos < len(tokens) and tokens[pos] == ":":
                pos += 1
            if pos >= len(tokens):
                raise TargetError(f"{source}: field {name} has no value", reason="malformed")
            if tokens[pos] == "{":
                pos += 1
                value: Any = message(depth + 1)
            elif tokens[pos] in ("}", ":"):
                raise TargetError(f"{source}: field {name} has no value", reason="malformed")
            else:
                value = tokens[pos][1:-1] if tokens[pos].startswith('"') else tokens[pos]
                pos += 1
            out.setdefault(name, []).append(value)
        if depth:
            raise TargetError(f"{source}: a message is not closed (missing '}}')", reason="malformed")
        return out

    return message(0)


def _int(msg: dict[str, list[Any]], field: str, source: str) -> int:
    raw = msg.get(field, ["0"])[0]  # proto3: an absent number is 0 (XLA prints none of its zeros)
    try:
        return int(raw)
    except (TypeError, ValueError):
        raise TargetError(f"{source}: {field} is {raw!r}, not an integer", reason="malformed") from None


def gpu_fields(text: str, source: str = "description") -> dict[str, Any]:
    """The cache key's GPU fields, from a description (a shipped one, a saved one, or the one a
    pod's XLA gives for its own device: the same function serves all three)."""
    msg = parse_description(text, source)
    info = (msg.get("gpu_device_info") or [None])[0]
    if not isinstance(info, dict):
        raise TargetError(f"{source}: no gpu_device_info message: not an XLA GPU target description", reason="malformed")
    cc = (info.get("cuda_compute_capability") or [None])[0]
    if not isinstance(cc, dict):
        raise TargetError(f"{source}: no cuda_compute_capability: not an NVIDIA GPU description", reason="malformed")
    fields: dict[str, Any] = {"compute_capability": [_int(cc, "major", source), _int(cc, "minor", source)],
                              "feature_extension": str(cc.get("feature_extension", ["NONE"])[0])}
    for name in _CODE_FIELDS:
        fields[name] = _int(info, name, source)
    if fields["core_count"] <= 0:
        raise TargetError(f"{source}: core_count is missing or 0", reason="malformed")
    return fields


@functools.lru_cache(maxsize=1)
def cuda_versions() -> dict[str, Optional[str]]:
    """The versions of this process's CUDA plugin and cuDNN packages (None: not installed): the
    plugin holds the compiler that generates the code, and the pod's cuDNN must be able to run
    the fused graphs a builder's cuDNN compiled. Read the same way on a builder and on a pod."""
    out: dict[str, Optional[str]] = {}
    for name in ("jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin", "jax-cuda12-pjrt",
                 "nvidia-cudnn-cu13", "nvidia-cudnn-cu12"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def cudnn_available() -> bool:
    """Whether a cuDNN package is installed for the plugin to compile fused attention with."""
    return any(k.startswith("nvidia-cudnn") for k in cuda_versions())


def local_description(devices: list[Any]) -> str:
    """XLA's description of these (GPU) devices, as a pod's XLA reports it (``target_config``
    of their topology, as jax's own deviceless tests obtain it)."""
    from jax._src.lib import xla_client

    return xla_client.get_topology_for_devices(list(devices)).target_config


_DEVICE_FIELDS: dict[tuple[str, int, str], dict[str, Any]] = {}


def device_gpu_fields(device: Any) -> dict[str, Any]:
    """``gpu_fields`` of a local GPU device (cached per device: its description never changes)."""
    ident = (device.platform, int(device.id), str(device.device_kind))
    if ident not in _DEVICE_FIELDS:
        _DEVICE_FIELDS[ident] = gpu_fields(local_description([device]), f"the {device.device_kind} device")
    return _DEVICE_FIELDS[ident]
