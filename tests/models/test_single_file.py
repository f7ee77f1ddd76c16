"""Single-file checkpoints (issue 28 item 1), LDM layout (SD 1.x): a tiny SD 1.x folder written
back in the original layout (``model.diffusion_model.*``, ``first_stage_model.*``,
``cond_stage_model.transformer.*``); diffusers' own ``from_single_file(path, config=folder)``
loads that file to the folder's image (so the file is real), and ``preheat.load(path,
config=folder)`` gives diffusers' image from the folder."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

import preheat
from preheat.errors import InvalidArgumentError, ModelFormatError, WeightsError
from tests._support.sd_fixtures import reference_pipeline, reference_pixels, save_tiny_sd

MEAN_TOL = 1.0  # mean |pixel difference| <= 1 level of 255


def _to_ldm(folder) -> dict[str, np.ndarray]:
    """The folder's weights under the original LDM names, written out by hand from the LDM code's
    module structure (the test's own inverse; diffusers' loader below checks it)."""
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
                   "conv_in": "input_blocks.0.0", "conv_norm_out": "out.0", "conv_out": "out.2"}
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
    for k, v in load_file(str(folder / "text_encoder" / "model.safetensors")).items():
        # transformers 5 saves CLIPTextModel without the text_model. prefix; the original files have it
        out["cond_stage_model.transformer." + (k if k.startswith("text_model.") else "text_model." + k)] = v
    return out


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    from safetensors.numpy import save_file

    base = tmp_path_factory.mktemp("single")
    folder = save_tiny_sd(base / "sd1", kind="sd1")
    path = base / "tiny-sd1-ldm.safetensors"
    save_file(_to_ldm(folder), str(path))
    return folder, path


def _noise() -> np.ndarray:
    return np.random.default_rng(3).standard_normal((1, 4, 16, 16)).astype(np.float32)


def test_single_file_matches_the_folder_it_was_converted_from(single, tmp_path, monkeypatch, record_property):
    import torch
    from diffusers import StableDiffusionPipeline

    folder, path = single
    monkeypatch.setenv("PREHEAT_HOME", str(tmp_path / "home"))
    call = dict(num_inference_steps=3, guidance_scale=5.0, height=32, width=32)
    theirs = reference_pixels(reference_pipeline(folder, "ddim"), "a lighthouse at dusk", _noise(), **call)

    # diffusers reads the same file back to the folder's image: the file is a real LDM checkpoint
    ref = StableDiffusionPipeline.from_single_file(str(path), config=str(folder), safety_checker=None,
                                                   torch_dtype=torch.float32)
    ref.scheduler = reference_pipeline(folder, "ddim").scheduler
    ref.set_progress_bar_config(disable=True)
    from_file = reference_pixels(ref, "a lighthouse at dusk", _noise(), **call)
    assert np.abs(from_file.astype(int) - theirs.astype(int)).mean() <= MEAN_TOL

    pipe = preheat.load(path, config=folder, cache="off")
    ours = pipe.generate("a lighthouse at dusk", noise=_noise(), steps=3, sampler="ddim", guidance=5.0,
                         width=32, height=32)
    diff = float(np.abs(ours.astype(np.int32) - theirs.astype(np.int32)).mean())
    record_property("mean_abs_px", diff)
    assert diff <= MEAN_TOL, diff
    assert ours.std() > 5
    converted = list((tmp_path / "home" / "models" / "single").iterdir())
    assert len(converted) == 1  # converted once ...
    again = preheat.load(path, config=folder, cache="off")  # ... and read again as it is
    assert list((tmp_path / "home" / "models" / "single").iterdir()) == converted
    assert np.array_equal(again.generate("a lighthouse at dusk", noise=_noise(), steps=3, sampler="ddim",
                                         guidance=5.0, width=32, height=32), ours)


def test_bad_single_files_are_one_line(single, tmp_path, monkeypatch):
    from safetensors.numpy import load_file, save_file

    folder, path = single
    monkeypatch.setenv("PREHEAT_HOME", str(tmp_path / "home"))
    with pytest.raises(InvalidArgumentError) as err:
        preheat.load(path, cache="off")
    assert err.value.argument == "config" and "\n" not in str(err.value)

    odd = tmp_path / "odd.safetensors"
    save_file({"double_blocks.0.img_attn.qkv.weight": np.zeros((2, 2), np.float32)}, str(odd))
    with pytest.raises(ModelFormatError, match=r"unknown layout: tried ldm \(model\.diffusion_model\.\*\); its keys "
                                               r"start double_blocks"):
        preheat.load(odd, config=folder, cache="off")

    tensors = load_file(str(path))
    tensors["model.diffusion_model.input_blocks.9.0.in_layers.0.weight"] = np.zeros(4, np.float32)  # no such block
    extra = tmp_path / "extra.safetensors"
    save_file(tensors, str(extra))
    with pytest.raises(WeightsError, match="do not fit the blocks") as err:
        preheat.load(extra, config=folder, cache="off")
    assert "\n" not in str(err.value)
