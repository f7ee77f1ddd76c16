"""Google TPUs: jax's Pallas flash-attention kernel for long self-attention, XLA's attention for
the rest, and matrix-product convolutions where libtpu's convolution crashes its compiler.

Attention (measured on one v5e chip, bf16, issue 56): SDXL's 4096-token self-attention (2 x 10
heads x 64) takes 4.7 ms in XLA's attention and 2.0 ms in the flash kernel with 1024/1024 blocks
(8.9 ms with the kernel's default 128 blocks); a Flux-like 4608 tokens (24 x 128) 16.1 ms vs 2.75
ms; at 1024 tokens (2 x 20 x 64) XLA's is as fast or faster (0.2-1.1 ms vs 0.77 ms). So the kernel
takes layers whose queries and keys are both at least ``FLASH_MIN_TOKENS`` long, and XLA's
attention keeps cross-attention to 77/154/512 text tokens and short self-attention. The kernel
takes head dims up to 128 as they are and larger ones in multiples of 128 (SD 1.5's 160-wide heads
run at 256, zero-padded), and keys in multiples of its block (a longer sequence is padded and the
padding masked: ``preheat.models.attention``).

Convolutions: libtpu's compiler overflowed its stack (SIGSEGV in
``FusedSpatialMajorConvolution::MakeConvWindows``, twice) compiling SD 1.5's UNet at batch 8
(16 latents a convolution with classifier-free guidance, 64x64), while batch 1 and 2 (2 and 4)
compiled and ran, as did SDXL at batch 1 (2 latents, 128x128); with every convolution an im2col
matrix product (``PREHEAT_CONV=im2col``) batch 8 compiled and ran at 0.81 s/image. A crash cannot
be tested without the chip, and the batches between 4 and 16 were never tried, so the choice is
conservative: im2col from ``IM2COL_MIN_BATCH`` latents a convolution, XLA's convolution below.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

from preheat.platforms._base import Attention, AttentionLayer, ConvLayer, Platform, accelerator_xla_flags
from preheat.platforms._libtpu import tpu_fields

__all__ = ["TpuPlatform", "FLASH_MIN_TOKENS", "IM2COL_MIN_BATCH", "flash_block"]

FLASH_MIN_TOKENS = 2048  # queries and keys both this long: the flash kernel (module docstring)
IM2COL_MIN_BATCH = 8  # a convolution's batch from which im2col replaces XLA's convolution
_LANES = 128  # the kernel's blocks and a head dim above 128 are multiples of this
# Blocks tried longest first: the longest that divides the sequence, 1024 measured best at 4096 tokens
_BLOCKS = (1024, 512, 256, 128)
_PAD_BLOCK = 512  # a sequence no block divides is padded to a multiple of this


def flash_block(length: int) -> int:
    """The flash kernel's block for a sequence of ``length`` tokens: the longest of ``_BLOCKS`` that
    divides it, else ``_PAD_BLOCK`` (the sequence is then padded to its multiple)."""
    for block in _BLOCKS:
        if length >= block and length % block == 0:
            return block
    return _PAD_BLOCK if length >= _PAD_BLOCK else _LANES


class TpuPlatform(Platform):
    """TPUs (jax's "tpu" devices, libtpu)."""

    name = "tpu"

    def attention(self, layer: AttentionLayer, capability: Any = None, deviceless: bool = False) -> Attention:
        """"flash" with its blocks for long unmasked self- or joint attention, "xla" elsewhere."""
        long = min(layer.q_len, layer.kv_len) >= FLASH_MIN_TOKENS
        if not long or layer.masked or layer.dtype not in ("bfloat16", "float32"):
            return Attention("xla")
        head_dim = layer.head_dim if layer.head_dim <= _LANES else -(-layer.head_dim // _LANES) * _LANES
        return Attention("flash", block_q=flash_block(layer.q_len), block_k=flash_block(layer.kv_len),
                         head_dim=head_dim)

    def conv_form(self, layer: Optional[ConvLayer], deviceless: bool = False) -> str:
        if layer is not None and layer.kernel > 1 and layer.batch >= IM2COL_MIN_BATCH:
            return "im2col"
        return "conv"

    def device_fields(self, device: Any, mesh_size: Optional[int], target: Any = None) -> dict[str, Any]:
        """The slice's fields (``preheat.platforms._libtpu.tpu_fields``: this VM's devices, or a
        ``target``'s topology in a deviceless compile -- one function, so a VM finds what a CPU
        builder wrote), the program's device count and the XLA flags a TPU reads."""
        if target is not None:
            return super().device_fields(device, mesh_size, target)
        return {"platform": self.name, **_local_tpu_fields(), "device_count": 1 if mesh_size is None else mesh_size,
                "xla_flags": accelerator_xla_flags()}


@functools.lru_cache(maxsize=1)
def _local_tpu_fields() -> dict[str, Any]:
    """``tpu_fields`` of this process's TPU devices (they never change in a process)."""
    import jax

    return tpu_fields(jax.devices())
