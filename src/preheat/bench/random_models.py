"""Random-weight stand-ins for published text-to-image architectures (no hub access needed).

``save_random_sd15(out)`` writes a full-size Stable Diffusion 1.5 pipeline folder -- the published
UNet, CLIP ViT-L/14 text encoder and VAE configs with random weights, built with diffusers and
transformers and saved with ``save_pretrained`` -- so that benchmarks measure the real
architecture's compile and run time. Its tokenizer is a small byte-level CLIP BPE vocabulary
made here (the real 49k-token vocabulary cannot be downloaded); token ids stay below the
encoder's vocab size, so every prompt encodes, and the compute is the real model's.

``save_random_flux_tiny(out)`` / ``save_random_sd1_tiny(out)`` write the same pipelines at the
scale of the test suite's tiny folders (``tests/families/*_fixtures.py``: one or two blocks of
width 32, 32x32 images, 16x16 latents), for benchmarks of compile behaviour rather than of
compute (``benchmarks/shapes.py``).

``save_random_flux(out)`` writes a ``FluxPipeline`` folder at FLUX.1-dev's published widths with
fewer layers (a full 12-billion-parameter model does not fit this benchmark): the transformer
with 1 double-stream + 1 single-stream block (of 19 + 38), T5 at T5-XXL widths with 2 layers (of
24), CLIP-L with 2 layers (of 12), the whole 16-channel FLUX VAE and FLUX.1-dev's scheduler.
Per layer, per token and per pixel the compute is the real model's. Its T5 tokenizer is a small
SentencePiece-style Unigram written here with ``tokenizers`` (ids far below T5's 32128).

``save_random_sdxl(out)``, ``save_random_flux_dev(out)`` and ``save_random_kontext_dev(out)``
write the whole published architectures (SDXL base 1.0: 2.6 B UNet parameters, CLIP-L and
OpenCLIP bigG; FLUX.1-dev: 19 + 38 blocks, 12 B parameters, T5-XXL's 24 layers), in bfloat16,
built on a CUDA device when torch has one (initialising 12 B parameters on a CPU takes minutes):
a GPU's head-to-head rows (docs/gpu.md), not a CPU's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple, Optional

from preheat.errors import InvalidArgumentError
from preheat.families.inputs import IMAGE_SIZE

__all__ = ["RANDOM_MODELS", "BOS", "materialize_model", "RandomModel", "random_name", "sized_inputs", "build_random", "OLD_NAMES", "bytes_to_unicode", "bpe_vocab", "write_clip_tokenizer", "write_t5_tokenizer", "save_random_sd15",
           "save_random_sd_small", "save_random_flux", "save_random_flux_tiny", "save_random_kontext_tiny",
           "save_random_fill_tiny", "save_random_sd1_tiny",
           "save_random_sdxl_tiny", "save_random_sd3_tiny", "save_random_sdxl", "save_random_flux_dev",
           "save_random_kontext_dev", "TEXT_ARCHITECTURES"]

from preheat.bench import RANDOM_PREFIX
from preheat.models import bpe_files
from preheat.models.bpe_files import BOS, EOS, bpe_vocab, bytes_to_unicode  # noqa: F401 (re-exported)
_WORDS = ("a photo of the cat dog fox watercolor painting portrait city night forest red blue green "
          "astronaut riding horse blurry low quality high detailed").split()

SD15_UNET: dict[str, Any] = dict(  # runwayml/stable-diffusion-v1-5 unet/config.json
    sample_size=64, in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(320, 640, 1280, 1280),
    down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=768, attention_head_dim=8, norm_num_groups=32, norm_eps=1e-5, act_fn="silu",
    flip_sin_to_cos=True, freq_shift=0, downsample_padding=1, mid_block_scale_factor=1)
SD15_TEXT: dict[str, Any] = dict(  # openai/clip-vit-large-patch14 text config
    vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
    max_position_embeddings=77, hidden_act="quick_gelu", layer_norm_eps=1e-5, projection_dim=768,
    bos_token_id=0, eos_token_id=2, pad_token_id=1)
SD15_VAE: dict[str, Any] = dict(
    in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(128, 256, 512, 512), layers_per_block=2,
    down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4, norm_num_groups=32,
    sample_size=512, scaling_factor=0.18215)
SD15_SCHEDULER: dict[str, Any] = dict(
    num_train_timesteps=1000, beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012, steps_offset=1,
    clip_sample=False, set_alpha_to_one=False, prediction_type="epsilon")

# FLUX.1-dev (black-forest-labs/FLUX.1-dev) configs at their published widths; the layer counts are
# this benchmark's (published: 19 double + 38 single blocks, T5 24 layers, CLIP 12 layers).
FLUX_TRANSFORMER: dict[str, Any] = dict(
    patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=128,
    num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
    axes_dims_rope=(16, 56, 56))
FLUX_T5: dict[str, Any] = dict(  # google/t5-v1_1-xxl encoder widths
    vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_heads=64, num_layers=2,
    relative_attention_num_buckets=32, relative_attention_max_distance=128, feed_forward_proj="gated-gelu",
    layer_norm_epsilon=1e-6, dropout_rate=0.1, is_encoder_decoder=True, tie_word_embeddings=False,
    pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
FLUX_CLIP: dict[str, Any] = {**SD15_TEXT, "num_hidden_layers": 2}  # FLUX.1-dev's text_encoder: CLIP-L, quick_gelu
FLUX_VAE: dict[str, Any] = dict(
    in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(128, 256, 512, 512), layers_per_block=2,
    down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4, norm_num_groups=32,
    act_fn="silu", sample_size=1024, scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False,
    use_post_quant_conv=False, mid_block_add_attention=True, force_upcast=True)
FLUX_SCHEDULER: dict[str, Any] = dict(
    num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
    base_image_seq_len=256, max_image_seq_len=4096)
# Published FLUX.1-dev splits the transformer (3 files) and T5 (2 files) into shards; so does this
# folder, so that loading streams shard by shard as it would there.
FLUX_SHARD = "1GB"

class RandomModel(NamedTuple):
    """One random-weight folder offered as ``random:NAME``."""

    builder: str  # the save_random_* function of this module (or "pixel": bench.common's JAX-built UNet)
    size: Optional[tuple[int, int]]  # (width, height) it defaults to where the family's default is not tiny
    about: str
    inputs: tuple[tuple[str, Any], ...] = ()  # other defaults its tiny scale needs (keyword, value)


# ``random:NAME`` on every command (sample, pull, warm, serve, bench). "Tiny" ones are the test
# suite's scale and default to their tiny size (32x32 images).
RANDOM_MODELS: dict[str, RandomModel] = {
    "sd1-tiny": RandomModel("save_random_sd1_tiny", (32, 32), "SD 1.x at the test suite's scale (13 MB)"),
    "sdxl-tiny": RandomModel("save_random_sdxl_tiny", (32, 32), "SDXL at the test suite's scale"),
    "sd3-tiny": RandomModel("save_random_sd3_tiny", (32, 32), "SD3 at the test suite's scale"),
    "flux-tiny": RandomModel("save_random_flux_tiny", (32, 32), "FLUX.1-dev at the test suite's scale (14 MB)"),
    # the reference keeps its own size: Kontext's preferred resolutions start at 672 pixels
    "kontext-tiny": RandomModel("save_random_kontext_tiny", (32, 32), "FLUX.1 Kontext at the test suite's scale "
                                "(flux-tiny's components, a FluxKontextPipeline)", (("image_resize", "none"),)),
    "fill-tiny": RandomModel("save_random_fill_tiny", (32, 32), "FLUX.1 Fill at the test suite's scale (flux-tiny's "
                             "encoders and VAE, a FluxFillPipeline whose transformer takes the masked image and mask)"),
    "sd-small": RandomModel("save_random_sd_small", None, "SD 1.x at a quarter of its widths (90 MB, 256x256)"),
    "sd15": RandomModel("save_random_sd15", None, "SD 1.5 at full size (4 GB, 512x512)"),
    "flux": RandomModel("save_random_flux", None, "FLUX.1-dev widths, 1+1 blocks (4.5 GB, 1024x1024)"),
    "ddpm-cifar10-32": RandomModel("pixel", None, "google/ddpm-cifar10-32's UNet2DModel (36 M parameters)"),
    # whole published architectures in bfloat16 (built on a GPU where torch has one): the GPU check's
    "sdxl": RandomModel("save_random_sdxl", None, "SDXL base 1.0 at full size (7 GB of bfloat16, 1024x1024)"),
    "flux-dev": RandomModel("save_random_flux_dev", None, "FLUX.1-dev at full size (33 GB of bfloat16, 1024x1024)"),
    "kontext-dev": RandomModel("save_random_kontext_dev", None, "FLUX.1 Kontext [dev] at full size (flux-dev's "
                               "components, a FluxKontextPipeline)"),
}
# The names bench used before ``random:NAME``; still accepted.
OLD_NAMES = {"sd15-random": "sd15", "flux-random": "flux", "sd-small-random": "sd-small",
             "flux-tiny-random": "flux-tiny", "sd1-tiny-random": "sd1-tiny"}
TEXT_ARCHITECTURES = {old: RANDOM_MODELS[new].builder for old, new in OLD_NAMES.items()}
PREFIX = RANDOM_PREFIX


def random_name(model: Optional[str]) -> Optional[str]:
    """``random:NAME`` (or an old bench name) -> NAME; anything else -> None. An unknown
    ``random:`` name fails naming the ones there are."""
    if model is None:
        return None
    if model in OLD_NAMES:
        return OLD_NAMES[model]
    if model == "ddpm-cifar10-32":
        return model
    if not model.startswith(PREFIX):
        return None
    name = model[len(PREFIX):]
    if name not in RANDOM_MODELS:
        raise InvalidArgumentError(f"unknown random model {model!r}; choose from "
                                   f"{', '.join(PREFIX + n for n in RANDOM_MODELS)}", argument="model")
    return name


def sized_inputs(name: Optional[str], inputs: Optional[dict[str, Any]]) -> dict[str, Any]:
    """``inputs`` with a tiny random model's width and height where they are not given (a tiny
    FLUX folder would otherwise run at the family's 128-latent default: 256x256), and its other
    tiny-scale defaults (``RandomModel.inputs``)."""
    inputs = dict(inputs or {})
    spec = RANDOM_MODELS.get(name) if name else None
    if spec is None:
        return inputs
    if spec.size is not None and not IMAGE_SIZE.given(inputs):
        inputs.update(IMAGE_SIZE.inputs(spec.size))
    return {**dict(spec.inputs), **inputs}


def build_random(name: str, out: Path) -> Path:
    """Write ``random:NAME``'s folder at ``out`` (once; assembled beside it and renamed, so that a
    folder at ``out`` is always complete). Needs torch, diffusers and transformers (the torch extra)."""
    if (out / "model_index.json").is_file():
        return out
    spec = RANDOM_MODELS[name]
    if spec.builder != "pixel":
        from preheat.errors import MissingExtraError

        for module in ("torch", "diffusers", "transformers"):
            try:
                __import__(module)
            except ImportError:  # `make run` installs the runtime only: the writers are the torch extra's
                raise MissingExtraError("torch", f"random:{name} (its folder is written with torch, diffusers and "
                                        "transformers)", module) from None
    import shutil
    import tempfile

    from preheat.files import publish_folder

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=out.parent))
    try:
        if spec.builder == "pixel":
            from preheat.bench.common import write_pixel_architecture

            write_pixel_architecture(name, tmp / "m")
        else:
            globals()[spec.builder](tmp / "m")
        publish_folder(tmp / "m", out)  # another process may have built it first
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def write_clip_tokenizer(directory: Path, words: tuple[str, ...] = tuple(_WORDS), pad_token: str = EOS) -> Path:
    """The four tokenizer files published diffusers folders hold (``bpe_files``), over the benchmark's words."""
    return bpe_files.write_clip_tokenizer(directory, words, pad_token)


def save_random_sd15(out: Path, seed: int = 0) -> Path:
    """A full-size SD 1.5 folder with random weights (about 4 GB of float32)."""
    return _save_sd(out, SD15_UNET, SD15_TEXT, SD15_VAE, seed)


# A small SD 1.x (the LoRA benchmark on a CPU): SD 1.5's block layout and attention at a quarter of
# its widths, a 4-layer CLIP of width 256, a narrower VAE; 256x256 images (32x32 latents).
SD_SMALL_UNET: dict[str, Any] = {**SD15_UNET, "sample_size": 32, "block_out_channels": (64, 128, 256, 256),
                                 "cross_attention_dim": 256}
SD_SMALL_TEXT: dict[str, Any] = {**SD15_TEXT, "hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 4,
                                 "num_attention_heads": 4, "projection_dim": 256}
SD_SMALL_VAE: dict[str, Any] = {**SD15_VAE, "block_out_channels": (32, 64, 128, 128), "sample_size": 256}


def save_random_sd_small(out: Path, seed: int = 0) -> Path:
    """A small SD 1.x folder with random weights (``SD_SMALL_*``: about 90 MB of float32)."""
    return _save_sd(out, SD_SMALL_UNET, SD_SMALL_TEXT, SD_SMALL_VAE, seed)


# The test suite's tiny scale (tests/families/*_fixtures.py): a two-level VAE (x2: 32 px images,
# 16 px latents), a 2-layer CLIP and T5 of width 32, one block of each kind.
TINY_VAE: dict[str, Any] = dict(
    in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(32, 64), layers_per_block=1,
    down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2, norm_num_groups=8,
    sample_size=32)
TINY_CLIP: dict[str, Any] = {**SD15_TEXT, "hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 2,
                             "num_attention_heads": 4, "projection_dim": 32}
TINY_SD1_UNET: dict[str, Any] = dict(
    sample_size=16, in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(32, 64),
    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=32, attention_head_dim=2, norm_num_groups=8)
TINY_FLUX_TRANSFORMER: dict[str, Any] = dict(
    patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
    joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(4, 4, 8), guidance_embeds=True)
TINY_T5: dict[str, Any] = {**FLUX_T5, "d_model": 32, "d_kv": 8, "d_ff": 37, "num_heads": 4, "num_layers": 2,
                           "relative_attention_num_buckets": 8}
TINY_FLUX_VAE: dict[str, Any] = {**TINY_VAE, "scaling_factor": 0.3611, "shift_factor": 0.1159, "use_quant_conv": False,
                                 "use_post_quant_conv": False}


def save_random_sd1_tiny(out: Path, seed: int = 0) -> Path:
    """An SD 1.x folder at the test suite's tiny scale (13 MB, most of it CLIP's 49408-token embedding)."""
    return _save_sd(out, TINY_SD1_UNET, TINY_CLIP, TINY_VAE, seed)


TINY_SDXL_UNET: dict[str, Any] = dict(
    sample_size=16, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
    cross_attention_dim=32, attention_head_dim=(2, 4), use_linear_projection=True, transformer_layers_per_block=(1, 2),
    addition_embed_type="text_time", addition_time_embed_dim=8, projection_class_embeddings_input_dim=16 + 6 * 8,
    norm_num_groups=8)
TINY_SDXL_CLIP: dict[str, Any] = {**TINY_CLIP, "hidden_size": 16, "num_attention_heads": 2, "projection_dim": 16}
SDXL_SCHEDULER: dict[str, Any] = dict(num_train_timesteps=1000, beta_schedule="scaled_linear", beta_start=0.00085,
                                      beta_end=0.012, steps_offset=1, timestep_spacing="leading")


# stabilityai/stable-diffusion-xl-base-1.0: unet/, text_encoder/ (CLIP-L), text_encoder_2/ (OpenCLIP
# bigG with projection) and vae/ config.json
SDXL_UNET: dict[str, Any] = dict(
    sample_size=128, in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(320, 640, 1280),
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=2048,
    attention_head_dim=(5, 10, 20), use_linear_projection=True, transformer_layers_per_block=(1, 2, 10),
    addition_embed_type="text_time", addition_time_embed_dim=256, projection_class_embeddings_input_dim=2816,
    norm_num_groups=32, norm_eps=1e-5, act_fn="silu", flip_sin_to_cos=True, freq_shift=0)
SDXL_CLIP: dict[str, Any] = {**SD15_TEXT, "projection_dim": 768}
SDXL_CLIP_G: dict[str, Any] = {**SD15_TEXT, "hidden_size": 1280, "intermediate_size": 5120, "num_hidden_layers": 32,
                               "num_attention_heads": 20, "hidden_act": "gelu", "projection_dim": 1280}
SDXL_VAE: dict[str, Any] = {**SD15_VAE, "sample_size": 1024, "scaling_factor": 0.13025, "force_upcast": True}


def _built(cls: Any, dtype: str, device: Optional[str], *args: Any, **config: Any) -> Any:
    """A random-weight model built on ``device`` (default: CUDA when torch has it), in ``dtype``."""
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    with torch.device(device):
        model = cls(*args, **config)
    return model.to(getattr(torch, dtype))


def save_random_sdxl(out: Path, seed: int = 0, *, dtype: str = "bfloat16", device: Optional[str] = None,
                     unet: dict[str, Any] = SDXL_UNET, clip: dict[str, Any] = SDXL_CLIP,
                     clip_g: dict[str, Any] = SDXL_CLIP_G, vae: dict[str, Any] = SDXL_VAE) -> Path:
    """A full-size SDXL base 1.0 folder with random ``dtype`` weights (about 7 GB in bfloat16);
    the keyword arguments replace the configs (a smaller one for a CPU's dry run)."""
    import torch
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    torch.manual_seed(seed)
    with torch.no_grad():
        for cls, config, folder in ((UNet2DConditionModel, unet, "unet"), (AutoencoderKL, vae, "vae")):
            model = _built(cls, dtype, device, **config)
            model.save_pretrained(out / folder)
            del model
        _built(CLIPTextModel, dtype, device, CLIPTextConfig(**clip)).save_pretrained(out / "text_encoder")
        _built(CLIPTextModelWithProjection, dtype, device, CLIPTextConfig(**clip_g)).save_pretrained(
            out / "text_encoder_2")
    return _finish_sdxl(out)


def _finish_sdxl(out: Path) -> Path:
    """An SDXL folder's scheduler, two tokenizers and model_index.json, beside its saved models."""
    from diffusers import EulerDiscreteScheduler

    EulerDiscreteScheduler(**SDXL_SCHEDULER).save_pretrained(out / "scheduler")
    write_clip_tokenizer(out / "tokenizer")
    write_clip_tokenizer(out / "tokenizer_2", pad_token="!")
    return _write_index(out, "StableDiffusionXLPipeline", text_encoder="CLIPTextModel",
                        text_encoder_2="CLIPTextModelWithProjection", tokenizer="CLIPTokenizer",
                        tokenizer_2="CLIPTokenizer", unet="UNet2DConditionModel", vae="AutoencoderKL",
                        scheduler="EulerDiscreteScheduler")


def save_random_sdxl_tiny(out: Path, seed: int = 0) -> Path:
    """An SDXL folder at the test suite's tiny scale: two CLIP encoders of width 16 (their hidden
    states concatenated: the UNet's 32), the text_time embedding, 32x32 images."""
    import torch
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    torch.manual_seed(seed)
    with torch.no_grad():
        UNet2DConditionModel(**TINY_SDXL_UNET).save_pretrained(out / "unet")
        CLIPTextModel(CLIPTextConfig(**TINY_SDXL_CLIP)).save_pretrained(out / "text_encoder")
        CLIPTextModelWithProjection(CLIPTextConfig(**{**TINY_SDXL_CLIP, "hidden_act": "gelu"})).save_pretrained(
            out / "text_encoder_2")
        AutoencoderKL(**TINY_VAE).save_pretrained(out / "vae")
    return _finish_sdxl(out)


TINY_SD3_TRANSFORMER: dict[str, Any] = dict(
    sample_size=16, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=4,
    caption_projection_dim=32, joint_attention_dim=64, pooled_projection_dim=64, out_channels=4, pos_embed_max_size=16)
TINY_SD3_CLIP: dict[str, Any] = {**TINY_CLIP, "hidden_act": "gelu"}  # two of width 32: pooled 64
TINY_SD3_VAE: dict[str, Any] = {**TINY_VAE, "scaling_factor": 1.5305, "shift_factor": 0.0609, "use_quant_conv": False,
                                "use_post_quant_conv": False}


def save_random_sd3_tiny(out: Path, seed: int = 0) -> Path:
    """A ``StableDiffusion3Pipeline`` folder at the test suite's tiny scale: two CLIP encoders of
    width 32 and a T5 of width 64 (the transformer's joint width), 32x32 images."""
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    torch.manual_seed(seed)
    with torch.no_grad():
        model: Any = SD3Transformer2DModel(**TINY_SD3_TRANSFORMER)
        _fill_zeros(model)
        model.save_pretrained(out / "transformer")
        CLIPTextModelWithProjection(CLIPTextConfig(**TINY_SD3_CLIP)).save_pretrained(out / "text_encoder")
        CLIPTextModelWithProjection(CLIPTextConfig(**TINY_SD3_CLIP)).save_pretrained(out / "text_encoder_2")
        T5EncoderModel(T5Config(**{**TINY_T5, "d_model": 64})).save_pretrained(out / "text_encoder_3")
        model = AutoencoderKL(**TINY_SD3_VAE)
        _fill_zeros(model)
        model.save_pretrained(out / "vae")
    FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0).save_pretrained(out / "scheduler")
    write_clip_tokenizer(out / "tokenizer")
    write_clip_tokenizer(out / "tokenizer_2", pad_token="!")
    write_t5_tokenizer(out / "tokenizer_3")
    return _write_index(out, "StableDiffusion3Pipeline", scheduler="FlowMatchEulerDiscreteScheduler",
                        text_encoder="CLIPTextModelWithProjection", text_encoder_2="CLIPTextModelWithProjection",
                        text_encoder_3="T5EncoderModel", tokenizer="CLIPTokenizer", tokenizer_2="CLIPTokenizer",
                        tokenizer_3="T5TokenizerFast", transformer="SD3Transformer2DModel", vae="AutoencoderKL")


def _write_index(out: Path, class_name: str, **components: str) -> Path:
    """``model_index.json`` (written last: it marks the folder complete) naming each component's
    class, in the library diffusers loads it with."""
    import diffusers

    def library(cls: str) -> str:
        return "diffusers" if hasattr(diffusers, cls) else "transformers"

    index = {"_class_name": class_name, "_diffusers_version": diffusers.__version__,
             **{name: [library(cls), cls] for name, cls in components.items()}}
    (out / "model_index.json").write_text(json.dumps(index, indent=2))
    return out


def _save_sd(out: Path, unet: dict[str, Any], text: dict[str, Any], vae: dict[str, Any], seed: int) -> Path:
    import torch
    from diffusers import AutoencoderKL, DDIMScheduler, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(seed)
    with torch.no_grad():
        UNet2DConditionModel(**unet).save_pretrained(out / "unet")
        CLIPTextModel(CLIPTextConfig(**text)).save_pretrained(out / "text_encoder")
        AutoencoderKL(**vae).save_pretrained(out / "vae")
    DDIMScheduler(**SD15_SCHEDULER).save_pretrained(out / "scheduler")
    write_clip_tokenizer(out / "tokenizer")
    index = {"_class_name": "StableDiffusionPipeline", "text_encoder": ["transformers", "CLIPTextModel"],
             "tokenizer": ["transformers", "CLIPTokenizer"], "unet": ["diffusers", "UNet2DConditionModel"],
             "vae": ["diffusers", "AutoencoderKL"], "scheduler": ["diffusers", "DDIMScheduler"],
             "safety_checker": [None, None], "feature_extractor": [None, None], "requires_safety_checker": False}
    (out / "model_index.json").write_text(json.dumps(index, indent=2))  # written last: marks the folder complete
    return out


T5_EXTRA_IDS = 100  # T5's <extra_id_0..99> sentinels


def t5_pieces(words: tuple[str, ...] = tuple(_WORDS), extra_ids: int = T5_EXTRA_IDS) -> list[tuple[str, float]]:
    """A small Unigram vocab in T5's id order: <pad>=0, </s>=1, <unk>=2, "▁", whole words, single
    characters (with and without "▁"), then the sentinels last, in reverse (as T5's)."""
    chars = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,;:!?'\"()-_/&"
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [("▁" + w, -3.0 - 0.01 * i) for i, w in enumerate(dict.fromkeys(words))]
    words_set = {p for p, _ in pieces}
    pieces += [("▁" + c, -8.0 - 0.001 * i) for i, c in enumerate(chars) if "▁" + c not in words_set]
    pieces += [(c, -9.0 - 0.001 * i) for i, c in enumerate(chars)]
    return pieces + [(f"<extra_id_{i}>", 0.0) for i in range(extra_ids - 1, -1, -1)]


def write_t5_tokenizer(directory: Path, words: tuple[str, ...] = tuple(_WORDS), max_length: int = 512) -> Path:
    """A T5 tokenizer folder as published FLUX.1 folders hold it (tokenizer.json, tokenizer_config.json,
    special_tokens_map.json; no spiece.model), built with ``tokenizers`` alone. Its normalizer only
    collapses whitespace runs: T5's NFKC charsmap cannot be built without sentencepiece."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    directory.mkdir(parents=True, exist_ok=True)
    pieces = t5_pieces(words)
    tok = Tokenizer(models.Unigram(pieces, unk_id=2, byte_fallback=False))
    tok.normalizer = normalizers.Replace(Regex(" {2,}"), " ")
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", pair="$A </s> $B </s>",
                                                       special_tokens=[("</s>", 1)])
    sentinels = [f"<extra_id_{i}>" for i in range(T5_EXTRA_IDS)]
    tok.add_special_tokens([AddedToken(t, normalized=False) for t in ("<pad>", "</s>", "<unk>", *sentinels[::-1])])
    tok.save(str(directory / "tokenizer.json"))
    ids = {p: i for i, (p, _) in enumerate(pieces)}
    special = {"content": None, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
               "special": True}
    added = {str(ids[t]): {**special, "content": t} for t in ("<pad>", "</s>", "<unk>", *sentinels)}
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "added_tokens_decoder": dict(sorted(added.items(), key=lambda kv: int(kv[0]))),
        "additional_special_tokens": sentinels, "clean_up_tokenization_spaces": True, "eos_token": "</s>",
        "extra_ids": T5_EXTRA_IDS, "legacy": True, "model_max_length": max_length, "pad_token": "<pad>",
        "sp_model_kwargs": {}, "tokenizer_class": "T5Tokenizer", "unk_token": "<unk>"}, indent=2))
    named = {k: {**{f: v for f, v in special.items() if f != "special"}, "content": v}
             for k, v in (("eos_token", "</s>"), ("pad_token", "<pad>"), ("unk_token", "<unk>"))}
    (directory / "special_tokens_map.json").write_text(json.dumps(
        {"additional_special_tokens": sentinels, **named}, indent=2))
    return directory


def _fill_zeros(model: Any, std: float = 0.02) -> None:
    """Random values in the tensors diffusers initialises to zero (AdaLN and output layers): an
    all-zero layer would make the benchmark's output, and the cross-backend agreement, trivial."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            if not p.any():
                p.normal_(0.0, std)


def save_random_flux_tiny(out: Path, seed: int = 0) -> Path:
    """A ``FluxPipeline`` folder at the test suite's tiny scale (14 MB, most of it the text encoders' embeddings)."""
    return save_random_flux(out, seed, transformer=TINY_FLUX_TRANSFORMER, t5=TINY_T5, clip=TINY_CLIP,
                            vae=TINY_FLUX_VAE)


def save_random_kontext_tiny(out: Path, seed: int = 0) -> Path:
    """A ``FluxKontextPipeline`` folder: flux-tiny's components (Kontext is FLUX.1-dev's
    transformer reading reference tokens beside the noise)."""
    save_random_flux_tiny(out, seed)
    return _write_index(out, "FluxKontextPipeline", scheduler="FlowMatchEulerDiscreteScheduler",
                        text_encoder="CLIPTextModel", text_encoder_2="T5EncoderModel", tokenizer="CLIPTokenizer",
                        tokenizer_2="T5TokenizerFast", transformer="FluxTransformer2DModel", vae="AutoencoderKL")


def save_random_fill_tiny(out: Path, seed: int = 0) -> Path:
    """A ``FluxFillPipeline`` folder: flux-tiny's encoders and VAE; the transformer takes 4 x (4
    noise + 4 masked-image + 2² mask) channels per token and gives the noise's 16."""
    save_random_flux(out, seed, transformer={**TINY_FLUX_TRANSFORMER, "in_channels": 48, "out_channels": 16},
                     t5=TINY_T5, clip=TINY_CLIP, vae=TINY_FLUX_VAE)
    return _write_index(out, "FluxFillPipeline", scheduler="FlowMatchEulerDiscreteScheduler",
                        text_encoder="CLIPTextModel", text_encoder_2="T5EncoderModel", tokenizer="CLIPTokenizer",
                        tokenizer_2="T5TokenizerFast", transformer="FluxTransformer2DModel", vae="AutoencoderKL")


def save_random_flux(out: Path, seed: int = 0, *, transformer: dict[str, Any] = FLUX_TRANSFORMER,
                     t5: dict[str, Any] = FLUX_T5, clip: dict[str, Any] = FLUX_CLIP,
                     vae: dict[str, Any] = FLUX_VAE, dtype: str = "float32", device: Optional[str] = "cpu") -> Path:
    """A FLUX.1-dev-width ``FluxPipeline`` folder with few layers and random float32 weights (about
    4.5 GB: transformer 2.2 GB, T5 2.1 GB, CLIP 0.2 GB, VAE 0.3 GB). Components are built and
    saved one at a time, so peak memory stays near the largest one. The keyword arguments
    replace the configs (``save_random_flux_tiny``, ``save_random_flux_dev``); ``device`` None:
    CUDA when torch has it."""
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    torch.manual_seed(seed)
    with torch.no_grad():
        model: Any = _built(FluxTransformer2DModel, dtype, device, **transformer)
        _fill_zeros(model)
        model.save_pretrained(out / "transformer", max_shard_size=FLUX_SHARD)
        del model
        model = _built(T5EncoderModel, dtype, device, T5Config(**t5))
        model.save_pretrained(out / "text_encoder_2", max_shard_size=FLUX_SHARD)
        del model
        _built(CLIPTextModel, dtype, device, CLIPTextConfig(**clip)).save_pretrained(out / "text_encoder")
        model = _built(AutoencoderKL, dtype, device, **vae)
        _fill_zeros(model)
        model.save_pretrained(out / "vae")
        del model
    FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULER).save_pretrained(out / "scheduler")
    write_clip_tokenizer(out / "tokenizer")
    write_t5_tokenizer(out / "tokenizer_2")
    return _write_index(out, "FluxPipeline", scheduler="FlowMatchEulerDiscreteScheduler", text_encoder="CLIPTextModel",
                        text_encoder_2="T5EncoderModel", tokenizer="CLIPTokenizer", tokenizer_2="T5TokenizerFast",
                        transformer="FluxTransformer2DModel", vae="AutoencoderKL")


# FLUX.1-dev's published layer counts (FLUX_* above keep its widths with fewer layers)
FLUX_DEV_TRANSFORMER: dict[str, Any] = {**FLUX_TRANSFORMER, "num_layers": 19, "num_single_layers": 38}
FLUX_DEV_T5: dict[str, Any] = {**FLUX_T5, "num_layers": 24}
FLUX_DEV_CLIP: dict[str, Any] = {**FLUX_CLIP, "num_hidden_layers": 12}


def save_random_flux_dev(out: Path, seed: int = 0) -> Path:
    """FLUX.1-dev at full size with random bfloat16 weights (transformer 23.8 GB, T5-XXL 9.5 GB),
    built on the GPU when torch has one."""
    return save_random_flux(out, seed, transformer=FLUX_DEV_TRANSFORMER, t5=FLUX_DEV_T5, clip=FLUX_DEV_CLIP,
                            dtype="bfloat16", device=None)


def save_random_kontext_dev(out: Path, seed: int = 0) -> Path:
    """FLUX.1 Kontext [dev] at full size: flux-dev's components under a ``FluxKontextPipeline``."""
    save_random_flux_dev(out, seed)
    return _write_index(out, "FluxKontextPipeline", scheduler="FlowMatchEulerDiscreteScheduler",
                        text_encoder="CLIPTextModel", text_encoder_2="T5EncoderModel", tokenizer="CLIPTokenizer",
                        tokenizer_2="T5TokenizerFast", transformer="FluxTransformer2DModel", vae="AutoencoderKL")


def materialize_model(name_or_path: str | None, workdir: Path) -> str | None:
    """A model argument for preheat.load: a path, None (built-in), or the folder of a random model
    (``random:NAME`` or an old bench name, see ``preheat.bench.random_models``) written once under
    ``workdir``."""
    name = random_name(name_or_path)
    if name is None:
        return name_or_path
    return str(build_random(name, workdir / name))
