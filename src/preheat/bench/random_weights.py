"""Random-weight pipeline folders written from preheat's own model definitions: no torch, no diffusers.

``bench.random_models`` builds its folders with diffusers and transformers (the independent
reference the tests need). A machine that only serves -- a TPU VM with the runtime alone -- has
neither, and initialising SDXL's 3.5 B parameters through torch on its host costs minutes of
accelerator time. Here each component is built abstractly (shapes only), every parameter gets
random values from one shared buffer (tiled: weights that serve timing and compile measurements,
not images), and the tensors are written in diffusers' layout and names (``weights.torch_key``,
``expected_torch_shape``): the folder loads through the same loaders as a published one.

Norm scales are ones and biases zeros, so that activations stay finite through a full-depth model.

FLUX.1 (``flux-schnell``, ``flux-dev``: the published configs preheat ships, ``models.published``;
``flux-kontext`` and ``flux-fill``: dev's, as FLUX.1 Kontext dev and Fill dev publish them)
is 12 B transformer parameters and 4.7 B of T5-XXL: each safetensors file is written tensor by tensor
(``_stream_file``: the header from the shapes, then each tensor's values; never the model in
memory). The transformer's matrices are stored in float8_e4m3fn, the rest in bfloat16: the TPU rows
load it with ``--weights-dtype int8 --weights-layers linear``, which places each matrix as stored and
quantises it on the chip, so fp8 halves the disk, the write and every load's read (12 GB, not 24:
it stays in the page cache of a 40 GiB host beside T5) and adds no host-side cast. T5 is stored in
bfloat16, the dtype it runs in (a cast of 4.7 B values on every load would cost more than reading
4.7 GB more). The T5 tokenizer is ``random_models``' (``tokenizers`` alone, no download). The transformer is two shards: the guidance embedder (dev only) apart, so that a
second variant beside the first (``link_from``) hard-links every file the two share.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any, Callable, NamedTuple

import jax
import numpy as np

from preheat.bench.random_models import (SD15_TEXT, SD15_UNET, SD15_VAE, SDXL_CLIP, SDXL_CLIP_G, SDXL_SCHEDULER,
                                         SDXL_UNET, SDXL_VAE, write_clip_tokenizer, write_t5_tokenizer)
from preheat.errors import InvalidArgumentError
from preheat.files import atomic_write_bytes

__all__ = ["ARCHITECTURES", "write_random_folder", "FLUX_ARCHITECTURES", "SMALL_FLUX"]

# FLUX.1's layout at a CPU's size: a few keys over the published configs (``configs=``), for the
# tests and the accelerator check's dry run, through the same streamed writer and the same loaders
SMALL_FLUX: dict[str, dict[str, Any]] = {
    "transformer": {"num_layers": 1, "num_single_layers": 2, "num_attention_heads": 2, "joint_attention_dim": 64,
                    "pooled_projection_dim": 64},
    "text_encoder_2": {"d_model": 64, "d_ff": 128, "num_layers": 1, "num_heads": 2, "d_kv": 32},
    "text_encoder": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 2,
                     "projection_dim": 64},
    "vae": {"block_out_channels": [32, 32], "layers_per_block": 1, "down_block_types": ["DownEncoderBlock2D"] * 2,
            "up_block_types": ["UpDecoderBlock2D"] * 2}}

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


# ---------------------------------------------------------------- FLUX.1, streamed

_SAFETENSORS_DTYPE = {"bfloat16": "BF16", "float8_e4m3fn": "F8_E4M3", "float32": "F32", "float16": "F16"}
_CHUNK = 1 << 22  # values per write of a constant tensor


class FluxVariant(NamedTuple):
    """A FLUX.1 folder's kind: the published configs it starts from and its pipeline class."""
    configs: str  # a folder of configs under ``models.published.CONFIGS``
    pipeline: str = "FluxPipeline"
    fill: bool = False  # FLUX.1 Fill: the transformer takes the masked image's latents and the folded mask too


FLUX_ARCHITECTURES = {"flux-schnell": FluxVariant("FLUX.1-schnell"), "flux-dev": FluxVariant("FLUX.1-dev"),
                      # FLUX.1 Kontext dev's and Fill dev's configs are dev's but for Fill's transformer inputs
                      "flux-kontext": FluxVariant("FLUX.1-dev", "FluxKontextPipeline"),
                      "flux-fill": FluxVariant("FLUX.1-dev", "FluxFillPipeline", fill=True)}
_GUIDANCE = "time_text_embed.guidance_embedder."  # FLUX.1-dev's alone: its own shard


def _entries(build: Callable[[], tuple[Any, Any]], rename: Callable[[str], str] = str
             ) -> list[tuple[str, str, tuple[int, ...]]]:
    """(torch name, leaf kind, torch shape) of every checkpoint tensor of an abstract model."""
    from preheat.models.weights import _LEAF_TO_TORCH, expected_torch_shape, torch_key

    _, state = build()
    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        names = tuple(n for n in (getattr(p, "key", getattr(p, "name", getattr(p, "idx", p))) for p in path)
                      if n != "value")
        kind = str(names[-1])
        if kind in _LEAF_TO_TORCH:
            out.append((rename(torch_key(names)), kind, expected_torch_shape(tuple(leaf.shape), kind)))
    return out


def _stream_file(path: Path, entries: list[tuple[str, str, tuple[int, ...]]], low: str, std: float = 0.02) -> int:
    """One safetensors file written tensor by tensor: matrices (2-D and up, not norms) random in ``low``,
    norm weights ones and biases zeros in bfloat16; returns its bytes. At most one pool and one chunk
    are in memory. Written to a temporary name and renamed: a file present is complete."""
    import ml_dtypes  # noqa: F401 (numpy's bfloat16 and float8_e4m3fn)

    dtypes = {name: (low if len(shape) >= 2 and kind in ("kernel", "embedding", "weight") else "bfloat16")
              for name, kind, shape in entries}
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, _, shape in entries:
        n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtypes[name]).itemsize
        header[name] = {"dtype": _SAFETENSORS_DTYPE[dtypes[name]], "shape": list(shape),
                        "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    pools = {d: (np.random.default_rng(0).standard_normal(_POOL) * std).astype(d) for d in set(dtypes.values())}
    tmp = path.with_name(f".{path.name}.partial")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(tmp, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for name, kind, shape in entries:
            n, dtype = int(np.prod(shape, dtype=np.int64)), np.dtype(dtypes[name])
            if dtypes[name] != low:  # norms' weights ones, biases zeros, in bfloat16
                block = (np.zeros if kind == "bias" else np.ones)(min(n, _CHUNK), dtype)
            else:
                block = pools[dtypes[name]]
            for start in range(0, n, len(block)):
                f.write(block[:min(len(block), n - start)].tobytes())
    tmp.rename(path)
    return 8 + len(raw) + offset


def _write_or_link(out: Path, rel: str, link_from: Path | None, write: Callable[[Path], Any]) -> None:
    """``out / rel`` hard-linked from ``link_from / rel`` (another variant's folder) when that is
    there, else written (a file present is complete: it is kept)."""
    path = out / rel
    if path.exists():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    if link_from is not None and (link_from / rel).is_file():
        try:
            path.hardlink_to(link_from / rel)
            return
        except OSError:  # another filesystem: written instead
            pass
    write(path)


def _flux(architecture: str, out: Path, low: np.dtype, configs: dict[str, dict[str, Any]],
          link_from: Path | None = None) -> None:
    """A FLUX.1 folder from the published configs (``configs``: a component's config, or a few of
    its keys, in their place: the tests' depth-reduced folders)."""
    from preheat.models import clip, flux, t5, vae
    from preheat.models.published import CONFIGS

    variant = FLUX_ARCHITECTURES[architecture]
    src = CONFIGS / variant.configs
    cfg = {name: {**json.loads((src / name / "config.json").read_text()), **configs.get(name, {})}
           for name in ("transformer", "text_encoder", "text_encoder_2", "vae")}
    if variant.fill:  # per latent pixel: the noise's, the masked image's and the mask's s² channels, packed 2x2
        latent, scale = cfg["vae"]["latent_channels"], 2 ** (len(cfg["vae"]["block_out_channels"]) - 1)
        cfg["transformer"] |= {"in_channels": 4 * (2 * latent + scale * scale), "out_channels": 4 * latent}
    shared = link_from is not None and _same_blocks(cfg["transformer"], link_from / "transformer" / "config.json")
    transformer = _entries(lambda: flux.build_abstract(flux.FluxTransformerConfig.from_dict(cfg["transformer"], "flux")))
    shards = {"diffusion_pytorch_model-00001-of-00002.safetensors": [e for e in transformer
                                                                     if not e[0].startswith(_GUIDANCE)],
              "diffusion_pytorch_model-00002-of-00002.safetensors": [e for e in transformer
                                                                     if e[0].startswith(_GUIDANCE)]}
    shards = {name: entries for name, entries in shards.items() if entries}
    for name, entries in shards.items():
        _write_or_link(out, f"transformer/{name}", link_from if shared else None,
                       lambda p, e=entries: _stream_file(p, e, low.name))
    weight_map = {key: name for name, entries in shards.items() for key, _, _ in entries}
    (out / "transformer" / "diffusion_pytorch_model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
    parts = {"text_encoder_2": lambda: t5.build_abstract(t5.T5Config.from_dict(cfg["text_encoder_2"], "t5")),
             "text_encoder": lambda: clip.build_abstract(clip.CLIPTextConfig.from_dict(cfg["text_encoder"], "clip")),
             "vae": lambda: vae.build_abstract(vae.AutoencoderKLConfig.from_dict(cfg["vae"], "vae"))}
    for name, build in parts.items():
        stem = "diffusion_pytorch_model" if name == "vae" else "model"
        _write_or_link(out, f"{name}/{stem}.safetensors", link_from,
                       lambda p, b=build: _stream_file(p, _entries(b), "bfloat16"))
    for name in cfg:
        (out / name / "config.json").write_text(json.dumps(cfg[name], indent=1))
    (out / "scheduler").mkdir(parents=True, exist_ok=True)
    (out / "scheduler" / "scheduler_config.json").write_text((src / "scheduler" / "scheduler_config.json").read_text())
    write_clip_tokenizer(out / "tokenizer")
    write_t5_tokenizer(out / "tokenizer_2")
    index = {**json.loads((src / "model_index.json").read_text()), "_class_name": variant.pipeline}
    atomic_write_bytes(out / "model_index.json", json.dumps(index, indent=1).encode())  # last: the folder is complete


def _same_blocks(transformer: dict[str, Any], other: Path) -> bool:
    """Whether another folder's transformer (its config.json) has this one's tensors but for the
    guidance embedder (its own shard): FLUX.1-dev's and -schnell's do, Fill's does not (its input layer)."""
    try:
        theirs = json.loads(other.read_text())
    except (OSError, ValueError):
        return False
    return {k: v for k, v in theirs.items() if k != "guidance_embeds"} == \
        {k: v for k, v in transformer.items() if k != "guidance_embeds"}


ARCHITECTURES: dict[str, Callable[..., None]] = {"sd15": _sd15, "sdxl": _sdxl,
                                                 **{name: functools.partial(_flux, name) for name in FLUX_ARCHITECTURES}}


def write_random_folder(architecture: str, out: Path, dtype: str | None = None,
                        configs: dict[str, dict[str, Any]] | None = None, link_from: Path | None = None) -> Path:
    """A diffusers pipeline folder of ``architecture`` (``sd15``: SD 1.5's published configs;
    ``sdxl``: SDXL base 1.0's; ``flux-schnell``, ``flux-dev``, ``flux-kontext``, ``flux-fill``: FLUX.1's,
    full depth) with random
    weights (``dtype``: float16 for SD, the transformer's matrices' float8_e4m3fn for FLUX.1); an
    existing complete folder is kept. ``configs``: a component's config in place of the published
    one (``unet``, ``vae``, ``text_encoder``, ``text_encoder_2``; FLUX.1's ``transformer`` too, a few
    keys over the published ones: ``{"num_layers": 2}``), as the tests' small folders.
    ``link_from``: another FLUX.1 variant's folder, whose identical files are hard-linked, not written."""
    if architecture not in ARCHITECTURES:
        raise InvalidArgumentError(f"unknown architecture {architecture!r}; known: {', '.join(ARCHITECTURES)}",
                                   argument="architecture")
    out = Path(out)
    if (out / "model_index.json").is_file():
        return out
    if architecture in FLUX_ARCHITECTURES:
        _flux(architecture, out, np.dtype(dtype or "float8_e4m3fn"), configs or {},
              None if link_from is None else Path(link_from))
    else:
        ARCHITECTURES[architecture](out, np.dtype(dtype or "float16"), configs or {})
    return out
