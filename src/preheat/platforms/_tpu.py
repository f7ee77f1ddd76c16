"""Google TPUs: jax's Pallas flash-attention kernel for long self-attention, XLA's attention for
the rest, and matrix-product convolutions where libtpu's convolution crashes its compiler.

Attention, measured on one v5e chip (bf16, median of 10 calls, jax 0.10.2; issue 56 and the block
sweep of 2026-12-06, ``scripts/tpu_attention.py``), XLA's attention vs the flash kernel's best blocks:

=======================================  ========  ============================  ==================
layer (B x heads x tokens x head dim)    XLA       flash                         kernel's default
=======================================  ========  ============================  ==================
SDXL 1024^2, 2 x 10 x 4096 x 64          4.72 ms   2.03 ms (1024 x 1024)         9.55 ms (128 x 128)
SDXL batch 4 + CFG, 8 x 10 x 4096 x 64   17.8 ms   6.56 ms (1024 x 1024)         40.9 ms
SDXL 32^2 blocks, 2 x 20 x 1024 x 64     1.16 ms   0.78 ms (1024 x 1024)         1.82 ms
SD 1.5 512^2, 2 x 8 x 4096 x 40 (->64)   3.86 ms   1.78 ms (1024 x 1024)         7.70 ms
SD 1.5, 2 x 8 x 1024 x 80 (->128)        0.67 ms   0.62 ms (1024 x 1024)         1.16 ms
Flux-like, 1 x 24 x 4608 x 128           16.1 ms   2.75 ms
=======================================  ========  ============================  ==================

So the kernel takes every unmasked layer whose queries and keys are both at least
``FLASH_MIN_TOKENS`` long, with the longest block up to 1024 that divides the sequence (512 x 512
measured 6% slower than 1024 x 1024 at 4096 tokens, 256 x 256 1.8x, 2048 x 2048 fails to compile:
VMEM), and XLA's attention keeps cross-attention to 77/154/512 text tokens (not measured yet) and
shorter self-attention. Head dims run as measured: below 128 zero-padded to a multiple of 64
(40 -> 64, 80 -> 128), above 128 to a multiple of 128 as the kernel requires (SD 1.5's 160 -> 256);
keys in multiples of the block (a sequence no block divides is padded, the padding masked:
``preheat.models.attention``).

Convolutions: libtpu's compiler overflowed its stack (SIGSEGV in
``FusedSpatialMajorConvolution::MakeConvWindows``, twice) compiling SD 1.5's UNet at batch 8
(16 latents a convolution with classifier-free guidance, 64x64), while batch 1 and 2 (2 and 4)
compiled and ran, as did SDXL at batch 1 (2 latents, 128x128); with every convolution an im2col
matrix product (``PREHEAT_CONV=im2col``) batch 8 compiled and ran at 0.81 s/image. A crash cannot
be tested without the chip, and the batches between 4 and 16 were never tried, so the choice is
conservative: from ``IM2COL_MIN_BATCH`` latents a convolution, every convolution is a matrix
product (3x3 ones im2col, 1x1 ones a plain product: no convolution is left for libtpu's convolution
emitter), XLA's convolution below. ``scripts/tpu_conv.py`` measures where the line should be.

The key (``device_fields``): the chip's kind, libtpu's version as the runtime reports it, the
program's device count (1 for a single-chip program on a 4-chip host, as on a GPU), the XLA flags a
TPU reads (not XLA:CPU's) and ``LIBTPU_INIT_ARGS`` (libtpu's own compiler flags, as libtpu reads them
on a VM: jax adds its launch-barrier flag there and only there, ``preheat.platforms._libtpu``). A deviceless
target (``preheat warm --target`` for a TPU) supplies the first two from ``target.key_fields()``,
so that a builder's key is the one the chip's host computes for itself.
"""

from __future__ import annotations

from typing import Any, Optional

from preheat.platforms._base import Attention, AttentionLayer, ConvLayer, Platform, accelerator_xla_flags
from preheat.platforms._libtpu import libtpu_init_args

__all__ = ["TpuPlatform", "FLASH_MIN_TOKENS", "IM2COL_MIN_BATCH", "chip_fields", "flash_block", "flash_choice"]

FLASH_MIN_TOKENS = 1024  # queries and keys both this long: the flash kernel (module docstring)
IM2COL_MIN_BATCH = 8  # a convolution's batch from which im2col replaces XLA's convolution
_LANES = 128  # the kernel's blocks and a head dim above 128 are multiples of this
_HEAD_ALIGN = 64  # a head dim below 128 runs at a multiple of this (as measured)
# Blocks tried longest first: the longest that divides the sequence, 1024 measured best at 4096 tokens
_BLOCKS = (1024, 512, 256, 128)
_PAD_BLOCK = 512  # a sequence no block divides is padded to a multiple of this


def chip_fields(device: Any) -> dict[str, str]:
    """The key's chip fields of a TPU device, a VM's own or a builder's compile-only one: its kind and
    its client's ``platform_version`` (libtpu's build)."""
    return {"device_kind": str(device.device_kind), "platform_version": str(device.client.platform_version)}


def flash_block(length: int) -> int:
    """The flash kernel's block for a sequence of ``length`` tokens: the longest of ``_BLOCKS`` that
    divides it, else ``_PAD_BLOCK`` (the sequence is then padded to its multiple)."""
    for block in _BLOCKS:
        if length >= block and length % block == 0:
            return block
    return _PAD_BLOCK if length >= _PAD_BLOCK else _LANES


def flash_choice(layer: AttentionLayer) -> Attention:
    """The flash kernel for ``layer``: its blocks, and its head dim (up to 128 in multiples of 64,
    above in multiples of 128)."""
    align = _HEAD_ALIGN if layer.head_dim <= _LANES else _LANES
    head_dim = -(-layer.head_dim // align) * align
    return Attention("flash", block_q=flash_block(layer.q_len), block_k=flash_block(layer.kv_len), head_dim=head_dim)


class TpuPlatform(Platform):
    """TPUs (jax's "tpu" devices, libtpu)."""

    name = "tpu"
    compact_weights = "int8"  # the matrix units take int8 at twice the bf16 rate; no fp8 on a v5e
    fences = True  # XLA:TPU fused q/k/v's heads-first transpose into their projection: half the MXU rate

    def attention(self, layer: AttentionLayer, capability: Any = None, deviceless: bool = False) -> Attention:
        """"flash" with its blocks for long unmasked self- or joint attention, "xla" elsewhere."""
        long = min(layer.q_len, layer.kv_len) >= FLASH_MIN_TOKENS
        if not long or layer.masked or layer.dtype not in ("bfloat16", "float32"):
            return Attention("xla")
        return flash_choice(layer)

    def device_fields(self, device: Any, mesh_size: Optional[int], target: Any = None) -> dict[str, Any]:
        """The module docstring's fields, the device's own or ``target.key_fields()``'s
        (``device_kind``, ``platform_version``)."""
        chip = target.key_fields() if target is not None else chip_fields(device)
        return {"platform": "tpu", **chip, "device_count": 1 if mesh_size is None else mesh_size,
                "xla_flags": accelerator_xla_flags(),
                "libtpu_init_args": libtpu_init_args()}

    def conv_form(self, layer: Optional[ConvLayer], deviceless: bool = False) -> str:
        if layer is not None and layer.batch >= IM2COL_MIN_BATCH:  # 1x1 kernels too: a matrix product
            return "im2col"
        return "conv"
