"""LoRA files made with peft on a diffusers pipeline: the references the LoRA tests (JAX and torch)
and the hot-swap benchmark load; the same tensors under kohya's names (diffusers-layout and SDXL's
original-layout module names), as community and distilled LoRAs (SDXL-Lightning) ship."""

from __future__ import annotations

import copy
from pathlib import Path

# diffusers' Flux transformer layers a LoRA covers (attention, MLPs, modulation, x_embedder and the
# output layers) and the CLIP encoder's: the FLUX.1 parity tests' (text-to-image, Kontext, Fill)
FLUX_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "to_add_out", "proj_mlp", "ff.net.2",
                "norm1.linear", "x_embedder", "proj_out", "norm_out.linear"]
TE_TARGETS = ["q_proj", "v_proj", "fc1"]
# diffusers' UNet2DConditionModel layers the SD, SDXL and SDXL-refiner parity LoRAs cover (attention, proj_in, MLP)
UNET_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "proj_in", "ff.net.2"]


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


def save_flux_lora(pipe, directory: Path, seed: int) -> Path:
    """A FLUX.1 LoRA made on ``pipe`` (``FluxPipeline``, ``FluxKontextPipeline`` or ``FluxFillPipeline``:
    the shapes are its transformer's, Fill's wider x_embedder included): the transformer's
    ``FLUX_TARGETS`` at rank 4, alpha 4, and the CLIP encoder's ``TE_TARGETS`` at rank 4, alpha 8."""
    return save_lora(pipe, directory, "transformer", {
        "transformer": peft_layers(pipe.transformer, FLUX_TARGETS, 4, 4, seed=seed),
        "text_encoder": peft_layers(pipe.text_encoder, TE_TARGETS, 4, 8, seed=seed + 1)})


def scale_0(lora) -> dict:
    """The parity tests' negative control: ``lora`` at scale 0, the plain image through the LoRA's
    own program (a scale is data: no second program; that scale 0 is the plain image is
    tests/families/test_lora.py::test_switching_loras_scales_and_mixes_never_retraces's)."""
    return {"lora": lora, "lora_scale": 0.0}


def kohya_names(src: Path, dst: Path) -> Path:
    """The same tensors under kohya / A1111 names (``lora_unet_…``, ``lora_te_…``, ``.alpha``)."""
    import json

    import numpy as np
    from safetensors import safe_open
    from safetensors.numpy import save_file

    with safe_open(str(src), "np") as f:
        meta = json.loads(f.metadata()["lora_adapter_metadata"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    out = {}
    for key, value in tensors.items():
        prefix, rest = key.split(".", 1)
        module, role = rest.rsplit(".lora_", 1)
        kohya = {"unet": "lora_unet", "text_encoder": "lora_te"}[prefix]
        if prefix == "text_encoder" and not module.startswith("text_model."):
            module = "text_model." + module
        name = f"{kohya}_{module}".replace(".", "_")
        out[f"{name}.lora_{'down' if role.startswith('A') else 'up'}.weight"] = value
        out[f"{name}.alpha"] = np.asarray(meta[f"{prefix}.lora_alpha"], np.float32)
    save_file(out, str(dst))
    return dst


def kohya_sgm_names(src: Path, dst: Path, layers: tuple[int, ...]) -> Path:
    """An SDXL LoRA's UNet part in kohya's original-layout names (``lora_unet_input_blocks_4_1_…``),
    written by hand from the LDM layout: level l's transformers are input blocks after l levels of
    (layers + 1) blocks, output blocks count (layers + 1) per level."""
    import json

    import numpy as np
    from safetensors import safe_open
    from safetensors.numpy import save_file

    down_start = np.cumsum([1] + [n + 1 for n in layers])
    up_start = np.cumsum([0] + [n + 1 for n in reversed(layers)])
    with safe_open(str(src), "np") as f:
        meta = json.loads(f.metadata()["lora_adapter_metadata"])
        tensors = {k: f.get_tensor(k) for k in f.keys() if k.startswith("unet.")}
    out = {}
    for key, value in tensors.items():
        module, role = key[len("unet."):].rsplit(".lora_", 1)
        parts = module.split(".")
        if parts[0] == "mid_block":
            name, rest = "middle_block_1", parts[3:]
        else:
            level, j = int(parts[1]), int(parts[3])
            block = "input_blocks" if parts[0] == "down_blocks" else "output_blocks"
            start = (down_start if block == "input_blocks" else up_start)[level]
            name, rest = f"{block}_{start + j}_1", parts[4:]
        name = "lora_unet_" + "_".join([name, *rest])
        out[f"{name}.lora_{'down' if role.startswith('A') else 'up'}.weight"] = value
        out[f"{name}.alpha"] = np.asarray(meta["unet.lora_alpha"], np.float32)
    save_file(out, str(dst))
    return dst
