"""Random-weight pipeline folders written from preheat's own model definitions: no torch, no diffusers.

``bench.random_models`` builds its folders with diffusers and transformers (the independent
reference the tests need). A machine that only serves -- a TPU VM with the runtime alone -- has
neither, and initialising SDXL's 3.5 B parameters through torch on its host costs minutes of
accelerator time. Here each component is built abstractly (shapes only), every parameter gets
random values from one shared buffer (tiled: weights that serve timing and compile measurements,
not images), and the tensors are written in diffusers' layout and names (``weights.torch_key``,
``expected_torch_shape``): the folder loads through the same loaders as a published one.

Norm scales are ones and biases zeros, so that activations stay finite through a full-depth model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np

from preheat.bench.random_models import (SD15_TEXT, SD15_UNET, SD15_VAE, SDXL_CLIP, SDXL_CLIP_G, SDXL_SCHEDULER,
                                         SDXL_UNET, SDXL_VAE, write_clip_tokenizer)
from preheat.errors import InvalidArgumentError
from preheat.files import atomic_write_bytes

__all__ = ["ARCHITECTURES", "write_random_folder"]

_SD15_SCHEDULER: dict[str, Any] = dict(num_train_timesteps=1000, beta_schedule="scaled_linear", beta_start=0.00085,
                                       beta_end=0.012, steps_offset=1, set_alpha_to_one=False, clip_sample=False,
                                       prediction_type="epsilon", timestep_spacing="leading")
_POOL = 1 << 20  # values in the shared random buffer


def _tensors(build: Callable[[], tuple[Any, Any]], dtype: np.dtype, std: float, rename: Callable[[str], str]
             ) -> dict[str, np.ndarray]:
    """Every parameter of an abstract model as a checkpoint tensor: (torch name, torch layout) -> values."""
    from preheat.models.weights import _LEAF_TO_TORCH, expected_torch_shape, torch_key

    _, state = build()
    pool = (np.random.default_rng(0).standard_normal(_POOL) * std).astype(dtype)
    out: dict[str, np.ndarray] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        names = tuple(getattr(p, "key", getattr(p, "name", getattr(p, "idx", p))) for p in path)
        names = tuple(n for n in names if n != "value")
        kind = str(names[-1])
        if kind not in _LEAF_TO_TORCH:  # not a checkpoint tensor (a config constant the model keeps)
            continue
        shape = expected_torch_shape(tuple(leaf.shape), kind)
        size = int(np.prod(shape, dtype=np.int64))
        if kind == "scale":
            values = np.ones(shape, dtype)
        elif kind == "bias":
            values = np.zeros(shape, dtype)
        else:
            values = np.resize(pool, size).reshape(shape)
        out[rename(torch_key(names))] = values
    return out


def _save(folder: Path, config: dict[str, Any], tensors: dict[str, np.ndarray], stem: str) -> None:
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    save_file(tensors, str(folder / f"{stem}.safetensors"))


def _unet(folder: Path, config: dict[str, Any], dtype: np.dtype) -> None:
    from preheat.models.unet2d_condition import UNet2DConditionConfig, build_abstract

    parsed = UNet2DConditionConfig.from_dict(dict(config), "unet")
    full = {"_class_name": "UNet2DConditionModel", **{k: list(v) if isinstance(v, tuple) else v
                                                        for k, v in config.items()}}
    _save(folder, full, _tensors(lambda: build_abstract(parsed), dtype, 0.02, str), "diffusion_pytorch_model")


def _vae(folder: Path, config: dict[str, Any], dtype: np.dtype) -> None:
    from preheat.models.vae import AutoencoderKLConfig, build_abstract

    parsed = AutoencoderKLConfig.from_dict(dict(config), "vae")
    full = {"_class_name": "AutoencoderKL", **{k: list(v) if isinstance(v, tuple) else v for k, v in config.items()}}
    _save(folder, full, _tensors(lambda: build_abstract(parsed), dtype, 0.02, str), "diffusion_pytorch_model")


def _clip(folder: Path, config: dict[str, Any], projection: bool, dtype: np.dtype) -> None:
    from preheat.models.clip import CLIPTextConfig, build_abstract

    cls = "CLIPTextModelWithProjection" if projection else "CLIPTextModel"
    full = {"model_type": "clip_text_model", "architectures": [cls], **config}
    parsed = CLIPTextConfig.from_dict(full, "text_encoder")
    _save(folder, full, _tensors(lambda: build_abstract(parsed), dtype, 0.02, str), "model")


def _index(out: Path, class_name: str, **components: tuple[str, str]) -> None:
    """``model_index.json``, written last (atomically): it marks the folder complete."""
    index = {"_class_name": class_name, "_diffusers_version": "0.30.0",
             **{name: list(lib_cls) for name, lib_cls in components.items()}}
    atomic_write_bytes(out / "model_index.json", json.dumps(index, indent=1).encode())


def _sd15(out: Path, dtype: np.dtype, configs: dict[str, dict[str, Any]]) -> None:
    _unet(out / "unet", configs.get("unet", SD15_UNET), dtype)
    _vae(out / "vae", configs.get("vae", SD15_VAE), dtype)
    _clip(out / "text_encoder", configs.get("text_encoder", SD15_TEXT), False, dtype)
    _scheduler(out, "DDIMScheduler", _SD15_SCHEDULER)
    write_clip_tokenizer(out / "tokenizer")
    _index(out, "StableDiffusionPipeline", text_encoder=("transformers", "CLIPTextModel"),
           tokenizer=("transformers", "CLIPTokenizer"), unet=("diffusers", "UNet2DConditionModel"),
           vae=("diffusers", "AutoencoderKL"), scheduler=("diffusers", "DDIMScheduler"))


def _sdxl(out: Path, dtype: np.dtype, configs: dict[str, dict[str, Any]]) -> None:
    _unet(out / "unet", configs.get("unet", SDXL_UNET), dtype)
    _vae(out / "vae", configs.get("vae", SDXL_VAE), dtype)
    _clip(out / "text_encoder", configs.get("text_encoder", SDXL_CLIP), False, dtype)
    _clip(out / "text_encoder_2", configs.get("text_encoder_2", SDXL_CLIP_G), True, dtype)
    _scheduler(out, "EulerDiscreteScheduler", SDXL_SCHEDULER)
    write_clip_tokenizer(out / "tokenizer")
    write_clip_tokenizer(out / "tokenizer_2", pad_token="!")
    _index(out, "StableDiffusionXLPipeline", text_encoder=("transformers", "CLIPTextModel"),
           text_encoder_2=("transformers", "CLIPTextModelWithProjection"),
           tokenizer=("transformers", "CLIPTokenizer"), tokenizer_2=("transformers", "CLIPTokenizer"),
           unet=("diffusers", "UNet2DConditionModel"), vae=("diffusers", "AutoencoderKL"),
           scheduler=("diffusers", "EulerDiscreteScheduler"))


def _scheduler(out: Path, class_name: str, config: dict[str, Any]) -> None:
    (out / "scheduler").mkdir(parents=True, exist_ok=True)
    (out / "scheduler" / "scheduler_config.json").write_text(json.dumps({"_class_name": class_name, **config}, indent=1))


ARCHITECTURES: dict[str, Callable[[Path, np.dtype, dict[str, dict[str, Any]]], None]] = {"sd15": _sd15, "sdxl": _sdxl}


def write_random_folder(architecture: str, out: Path, dtype: str = "float16",
                        configs: dict[str, dict[str, Any]] | None = None) -> Path:
    """A diffusers pipeline folder of ``architecture`` (``sd15``: SD 1.5's published configs;
    ``sdxl``: SDXL base 1.0's) with random ``dtype`` weights; an existing complete folder is kept.
    ``configs``: a component's config in place of the published one (``unet``, ``vae``,
    ``text_encoder``, ``text_encoder_2``), as the tests' tiny folders."""
    if architecture not in ARCHITECTURES:
        raise InvalidArgumentError(f"unknown architecture {architecture!r}; known: {', '.join(ARCHITECTURES)}",
                                   argument="architecture")
    out = Path(out)
    if (out / "model_index.json").is_file():
        return out
    ARCHITECTURES[architecture](out, np.dtype(dtype), configs or {})
    return out
