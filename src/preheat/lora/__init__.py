"""LoRA files in, runtime adapters out: reading, key mapping, rank buckets, per-image slots.

``pipe(prompt, lora="style.safetensors", lora_scale=0.8)`` never merges a LoRA into the weights
and never recompiles for a new one: the factors are arguments of the compiled programs
(``preheat.models.adapters`` says how a layer uses them). This module is the host side:

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
                       original layout, lora_unet_input_blocks_4_1_... (``families.sd_loading.sgm_lora_names``)
    Flux, BFL names    lora_unet_double_blocks_0_img_attn_qkv (kohya), diffusion_model.double_blocks.0...
                       (ComfyUI), double_blocks.0.processor.qkv_lora1.down.weight (XLabs): a fused
                       q/k/v (/mlp) layer shares A and splits B's rows (``families.flux.bfl_lora_names``)

A layer's update is ``scale * alpha / rank * B @ A`` (alpha = rank when the file gives none, as
diffusers does). Several LoRAs in one slot sit side by side in the rank dimension, so a mix is
one product; the bucket must hold their summed ranks. Keys that match no layer of the model (or
name a part it lacks: an SDXL refiner's first text encoder), a rank above the largest bucket, DoRA
files, a corrupt file and a non-finite scale are one-line errors.

The package: ``files`` reads a file onto a model's target layers, ``request`` turns a call's
``lora=`` into slots, ``runtime`` holds what a pipeline keeps between calls (files, stacked
mixes on the device, rank buckets) and builds the programs' arguments.
"""

from __future__ import annotations

from preheat.lora.files import LoraFile, LoraTargets, read_lora
from preheat.lora.request import parse_cli, parse_request
from preheat.lora.runtime import (BUCKETS, LoraCache, LoraRequest, LoraRuntime, bucket_for, check_lora_ranks,
                                  denoiser_args, encoder_adapters)

__all__ = ["BUCKETS", "LoraCache", "LoraRuntime", "LoraFile", "LoraTargets", "LoraRequest", "read_lora", "parse_request",
           "parse_cli", "bucket_for", "check_lora_ranks", "denoiser_args", "encoder_adapters"]
