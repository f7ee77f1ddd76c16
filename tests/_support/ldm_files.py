"""SD 1.x / 2.x and SDXL folders' weights written back in the original LDM and SGM layouts, by
hand from the original code's module structure (independent of preheat's tables; diffusers'
loader checks them)::

    to_original(folder, "sd1" | "sd2" | "sdxl" | "sdxl-refiner", load_file=None) -> {original name: tensor}
"""

from __future__ import annotations

import json
import re

import numpy as np


def to_original(folder, model: str, load_file=None) -> dict[str, np.ndarray]:
    """The folder's weights under the original names -- LDM for SD 1.x and SD 2.x, SGM for SDXL and its refiner --
    written out by hand from the original code's module structure (the test's own inverse;
    diffusers' loader checks it). ``load_file(path)``: a component's tensors (default: the file's;
    ``test_published`` passes shapes-only stand-ins)."""
    if load_file is None:
        from safetensors.numpy import load_file

    unet_cfg = json.loads((folder / "unet" / "config.json").read_text())
    vae_cfg = json.loads((folder / "vae" / "config.json").read_text())
    L = unet_cfg["layers_per_block"]
    attn_up = ["CrossAttn" in t for t in unet_cfg["up_block_types"]]
    res = {"norm1": "in_layers.0", "conv1": "in_layers.2", "time_emb_proj": "emb_layers.1", "norm2": "out_layers.0",
           "conv2": "out_layers.3", "conv_shortcut": "skip_connection"}
    out: dict[str, np.ndarray] = {}

    def inner(kind: str, rest: str) -> str:
        """A block's slot in its LDM sequential (0: the resnet, 1: the attention) and the leaf name."""
        if kind != "resnets":
            return f"1.{rest}"
        leaf = rest.split(".")[0]
        return f"0.{rest.replace(leaf, res.get(leaf, leaf), 1)}"

    for k, v in load_file(str(folder / "unet" / "diffusion_pytorch_model.safetensors")).items():
        m = re.match(r"down_blocks\.(\d+)\.(resnets|attentions|downsamplers)\.(\d+)\.(.*)", k)
        if m:
            b, kind, j, rest = int(m[1]), m[2], int(m[3]), m[4]
            if kind == "downsamplers":
                name = f"input_blocks.{1 + b * (L + 1) + L}.0.op.{rest.removeprefix('conv.')}"
            else:
                name = f"input_blocks.{1 + b * (L + 1) + j}.{inner(kind, rest)}"
        elif m := re.match(r"up_blocks\.(\d+)\.(resnets|attentions|upsamplers)\.(\d+)\.(.*)", k):
            b, kind, j, rest = int(m[1]), m[2], int(m[3]), m[4]
            if kind == "upsamplers":
                name = f"output_blocks.{b * (L + 1) + L}.{2 if attn_up[b] else 1}.{rest}"
            else:
                name = f"output_blocks.{b * (L + 1) + j}.{inner(kind, rest)}"
        elif m := re.match(r"mid_block\.(resnets|attentions)\.(\d+)\.(.*)", k):
            kind, j, rest = m[1], int(m[2]), m[3]
            name = f"middle_block.{2 * j if kind == 'resnets' else 1}.{inner(kind, rest)[2:]}"
        else:
            top = {"time_embedding.linear_1": "time_embed.0", "time_embedding.linear_2": "time_embed.2",
                   "conv_in": "input_blocks.0.0", "conv_norm_out": "out.0", "conv_out": "out.2",
                   "add_embedding.linear_1": "label_emb.0.0", "add_embedding.linear_2": "label_emb.0.2"}
            head, _, tail = k.rpartition(".")
            name = f"{top[head]}.{tail}"
        out["model.diffusion_model." + name] = v
    n = len(vae_cfg["block_out_channels"])
    att = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}
    for k, v in load_file(str(folder / "vae" / "diffusion_pytorch_model.safetensors")).items():
        name = k.replace("conv_norm_out", "norm_out").replace("conv_shortcut", "nin_shortcut")
        name = re.sub(r"encoder\.down_blocks\.(\d+)\.resnets\.", r"encoder.down.\1.block.", name)
        name = re.sub(r"encoder\.down_blocks\.(\d+)\.downsamplers\.0\.", r"encoder.down.\1.downsample.", name)
        name = re.sub(r"decoder\.up_blocks\.(\d+)\.resnets\.", lambda m: f"decoder.up.{n - 1 - int(m[1])}.block.", name)
        name = re.sub(r"decoder\.up_blocks\.(\d+)\.upsamplers\.0\.", lambda m: f"decoder.up.{n - 1 - int(m[1])}.upsample.",
                      name)
        name = name.replace("mid_block.resnets.0.", "mid.block_1.").replace("mid_block.resnets.1.", "mid.block_2.")
        if "mid_block.attentions.0." in name:
            pre, rest = name.split("mid_block.attentions.0.")
            layer, _, tail = rest.rpartition(".")
            name = f"{pre}mid.attn_1.{att[layer]}.{tail}"
            if tail == "weight" and v.ndim == 2:
                v = v[:, :, None, None]  # the original's 1x1 convolutions
        out["first_stage_model." + name] = v
    if model == "sdxl-refiner":  # OpenCLIP bigG alone, as the SGM conditioner's first and only text embedder
        out.update(_open_clip(load_file(str(folder / "text_encoder_2" / "model.safetensors")),
                              "conditioner.embedders.0.model."))
        out["conditioner.embedders.0.model.logit_scale"] = np.array(4.6052, np.float32)  # CLIP's, unused
        return out
    text = load_file(str(folder / "text_encoder" / "model.safetensors"))
    if model == "sd2":  # OpenCLIP ViT-H, with the last block and the projection diffusers' folder leaves out
        out.update(_open_clip(text, "cond_stage_model.model.", _past_the_penultimate(text)))
        return out
    clip_l = "cond_stage_model.transformer." if model == "sd1" else "conditioner.embedders.0.transformer."
    for k, v in text.items():
        # transformers 5 saves CLIPTextModel without the text_model. prefix; the original files have it
        out[clip_l + (k if k.startswith("text_model.") else "text_model." + k)] = v
    if model == "sdxl":
        out.update(_open_clip(load_file(str(folder / "text_encoder_2" / "model.safetensors")),
                              "conditioner.embedders.1.model."))
    return out


def _past_the_penultimate(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """What an SD 2.x file holds beyond diffusers' CLIPTextModel: OpenCLIP's last block (SD 2.x
    conditions on the penultimate block's output, so diffusers' config stops before it) and the
    [D, P] text projection; random, so a preheat that used them would give another image."""
    rng = np.random.default_rng(7)
    last = max(int(m[1]) for k in tensors if (m := re.match(r"(?:text_model\.)?encoder\.layers\.(\d+)\.", k)))
    out = {}
    for k, v in tensors.items():
        if m := re.match(r"((?:text_model\.)?encoder\.layers\.)(\d+)(\..*)", k):
            if int(m[2]) == last:
                out[f"{m[1]}{last + 1}{m[3]}"] = rng.standard_normal(v.shape).astype(v.dtype)
    width = tensors[next(k for k in tensors if k.endswith("final_layer_norm.weight"))].shape[0]
    out["text_projection.weight"] = rng.standard_normal((width, width)).astype(np.float32)  # transformers' [P, D]
    return out


def _open_clip(tensors: dict[str, np.ndarray], top: str,
               extra: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """A CLIP text encoder in OpenCLIP's names under ``top`` (SDXL's second encoder; SD 2.x's only
    one, with ``extra`` tensors in transformers' names)."""
    tensors = {**tensors, **(extra or {})}
    leaf = {"layer_norm1": "ln_1", "layer_norm2": "ln_2", "mlp.fc1": "mlp.c_fc", "mlp.fc2": "mlp.c_proj",
            "self_attn.out_proj": "attn.out_proj"}
    out, qkv = {}, {}
    for k, v in tensors.items():
        k = k.removeprefix("text_model.")
        if k == "text_projection.weight":
            out[top + "text_projection"] = np.ascontiguousarray(v.T)
        elif k in ("embeddings.token_embedding.weight", "embeddings.position_embedding.weight"):
            out[top + ("token_embedding.weight" if "token" in k else "positional_embedding")] = v
        elif k.startswith("final_layer_norm."):
            out[top + "ln_final." + k.rsplit(".", 1)[1]] = v
        elif m := re.match(r"encoder\.layers\.(\d+)\.self_attn\.([qkv])_proj\.(weight|bias)", k):
            qkv.setdefault((m[1], m[3]), {})[m[2]] = v
        elif m := re.match(r"encoder\.layers\.(\d+)\.(.*)\.(weight|bias)", k):
            out[f"{top}transformer.resblocks.{m[1]}.{leaf[m[2]]}.{m[3]}"] = v
        elif k != "embeddings.position_ids":
            raise AssertionError(f"unexpected CLIP text encoder tensor {k}")
    for (i, kind), parts in qkv.items():
        out[f"{top}transformer.resblocks.{i}.attn.in_proj_{kind}"] = np.concatenate([parts[c] for c in "qkv"])
    return out
