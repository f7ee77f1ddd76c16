"""LoRA files made with peft on a diffusers pipeline: the references the LoRA tests (JAX and torch)
and the hot-swap benchmark load."""

from __future__ import annotations

import copy
from pathlib import Path


def peft_layers(module, targets: list[str], rank: int, alpha: float, seed: int) -> tuple[dict, dict]:
    """(peft state dict, adapter config) of a random LoRA on a copy of ``module``."""
    import torch
    from peft import LoraConfig, inject_adapter_in_model
    from peft.utils import get_peft_model_state_dict

    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=False)
    model = inject_adapter_in_model(config, copy.deepcopy(module))
    with torch.no_grad():  # peft's non-default init is small; make the effect clearly visible
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(2.0)
    return get_peft_model_state_dict(model), config.to_dict()


def save_lora(pipe, directory: Path, denoiser: str, parts: dict[str, tuple[dict, dict]]) -> Path:
    """A diffusers LoRA file (``pytorch_lora_weights.safetensors``) with peft's metadata."""
    kwargs = {}
    for name, (layers, config) in parts.items():
        kwargs[f"{name}_lora_layers"] = layers
        kwargs[f"{name}_lora_adapter_metadata"] = config
    type(pipe).save_lora_weights(directory, **kwargs)
    return directory / "pytorch_lora_weights.safetensors"
