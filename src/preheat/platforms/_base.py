"""A platform's description: the base class every platform (cpu, gpu, tpu, a test's fake)
subclasses, and the small values its choices are made from and returned as.

The base class is the generic platform -- what preheat did on a backend it has no description
for (ROCm reports "gpu" too, but a METAL or a future plugin would land here): jax's own attention,
XLA's convolution, two-pass GroupNorm, the device's kind and runtime version in the key, no
autotuning, no platform checks in doctor.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple, Optional

__all__ = ["Platform", "AttentionLayer", "Attention", "ConvLayer"]


class AttentionLayer(NamedTuple):
    """What an attention layer's implementation is chosen from: all of it static at trace time."""

    dtype: str  # the operands' dtype name ("bfloat16", "float32", ...)
    head_dim: int  # Dh of q/k/v (B, L, nH, Dh)
    q_len: int  # L: query tokens
    kv_len: int  # M: key/value tokens (L for self-attention, 77/154/512 text tokens for cross-attention)
    heads: int = 1  # nH
    masked: bool = False  # a bias or mask is applied (causal is not a mask here: ``causal``)
    causal: bool = False


class Attention(NamedTuple):
    """One layer's attention implementation.

    ``impl``: jax's ``dot_product_attention(implementation=...)`` ("xla", "cudnn", or None: jax's
    default, the CPU's program as it always was), or "flash": jax's Pallas TPU flash kernel
    (``preheat.models.attention``), with its blocks (``block_q``, ``block_k``, both multiples of
    128) and the head dim it runs at (``head_dim``: the layer's, or a padded one the kernel takes)."""

    impl: Optional[str]
    block_q: int = 0
    block_k: int = 0
    head_dim: int = 0


class ConvLayer(NamedTuple):
    """What a 2-D convolution's form is chosen from: its input (B, H, W, Cin) and kernel (k, k, Cin, Cout)."""

    batch: int
    height: int
    width: int
    cin: int
    cout: int
    kernel: int
    stride: int = 1


# XLA flags that only XLA:CPU reads: an accelerator program's key leaves them out, so that a CPU
# builder's flags (a test suite's fake device count) do not make its entries unreachable for a pod.
_CPU_ONLY_FLAGS = ("--xla_force_host_platform_device_count", "--xla_cpu_")


def accelerator_xla_flags() -> str:
    """``$XLA_FLAGS`` without the flags only XLA:CPU reads."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    return " ".join(f for f in flags if not f.startswith(_CPU_ONLY_FLAGS))


class Platform:
    """Every platform-dependent choice preheat makes, for one platform (``name``: jax's platform
    name of its devices). Subclasses override what differs; the choices read only their arguments,
    never the running backend, so a deviceless compile gets the target's choices."""

    name: str = "generic"
    accelerator: bool = True  # the device is not the host (its memory, its peak, its label)
    autotunes: bool = False  # XLA times kernels when it compiles for a local device of this platform
    # ids of the doctor's platform-specific checks (``preheat.doctor.checks``) that apply here;
    # the platform-neutral ones (jax, storage, cache) run everywhere
    doctor_checks: tuple[str, ...] = ()
    # the 8-bit weights to suggest first when a model does not fit (models.footprint): fp8, which the
    # GPUs' and the CPU's products take
    compact_weights: str = "float8_e4m3fn"
    # materialise the flash kernel's q/k/v before their transpose (``models.conv.fence``): where the
    # compiler would otherwise fuse the transpose into the projection, at half its rate
    fences: bool = False

    def __init__(self, name: Optional[str] = None) -> None:
        if name is not None:
            self.name = name

    def __repr__(self) -> str:
        return f"<platform {self.name}>"

    def attention(self, layer: AttentionLayer, capability: Any = None, deviceless: bool = False) -> Attention:
        """The implementation of one attention layer traced for this platform (``capability``:
        the target's, e.g. a GPU's (major, minor); ``deviceless``: compiled without the device)."""
        return Attention(None)

    def conv_form(self, layer: Optional[ConvLayer], deviceless: bool = False) -> str:
        """``auto``'s convolution form (``preheat.models.conv.CONV_IMPLS``) for one layer (None:
        a layer not described: the platform's general choice)."""
        return "conv"

    def groupnorm_form(self) -> str:
        """``auto``'s GroupNorm statistics (``preheat.models.conv.GROUPNORM_IMPLS``)."""
        return "two_pass"

    def device_fields(self, device: Any, mesh_size: Optional[int], target: Any = None) -> dict[str, Any]:
        """The cache key's fields of the machine a program runs on: ``device`` (the first local
        one) or ``target`` (a deviceless compile for a device this process does not have: its
        ``key_fields()`` name the device), ``mesh_size`` devices (None: a single-device program).

        Locally: the device's kind, the process's device count, the runtime's version and the XLA
        flags, as every key before the platform seam had them."""
        import jax

        if target is not None:  # the hook a platform's deviceless targets use (cache.targets.Target for GPUs)
            return {"platform": self.name, **target.key_fields(),
                    "device_count": 1 if mesh_size is None else mesh_size, "xla_flags": accelerator_xla_flags()}
        return {"platform": device.platform, "device_kind": device.device_kind, "device_count": jax.device_count(),
                "platform_version": device.client.platform_version, "xla_flags": os.environ.get("XLA_FLAGS", "")}

    def autotunes_now(self) -> bool:
        """Whether a compile for a local device autotunes with this process's flags."""
        return self.autotunes
