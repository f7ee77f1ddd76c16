"""Random-weight stand-ins for published text-to-image architectures (no hub access needed).

``save_random_sd15(out)`` writes a full-size Stable Diffusion 1.5 pipeline folder -- the published
UNet, CLIP ViT-L/14 text encoder and VAE configs with random weights, built with diffusers and
transformers and saved with ``save_pretrained`` -- so that benchmarks measure the real
architecture's compile and run time. Its tokenizer is a small byte-level CLIP BPE vocabulary
made here (the real 49k-token vocabulary cannot be downloaded); token ids stay below the
encoder's vocab size, so every prompt encodes, and the compute is the real model's.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

__all__ = ["bytes_to_unicode", "bpe_vocab", "write_clip_tokenizer", "save_random_sd15", "TEXT_ARCHITECTURES"]

BOS, EOS = "<|startoftext|>", "<|endoftext|>"
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

TEXT_ARCHITECTURES = {"sd15-random": "save_random_sd15"}


def bytes_to_unicode() -> dict[int, str]:
    """CLIP's (GPT-2's) byte -> printable unicode character table, in CLIP's vocab order."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


@lru_cache(maxsize=8)
def bpe_vocab(words: tuple[str, ...]) -> tuple[dict[str, int], tuple[str, ...]]:
    """A CLIP-style byte-level BPE vocab: 256 bytes, the same with ``</w>``, merges that make each
    of ``words`` one token, then ``<|startoftext|>`` and ``<|endoftext|>`` (the last ids, as in CLIP)."""
    table = bytes_to_unicode()
    vocab: dict[str, int] = {}
    for c in table.values():
        vocab[c] = len(vocab)
    for c in table.values():
        vocab[c + "</w>"] = len(vocab)
    merges: list[str] = []
    for word in words:
        symbols = [table[b] for b in word.encode("utf-8")]
        symbols[-1] += "</w>"
        left = symbols[0]
        for right in symbols[1:]:
            if left + right not in vocab:
                vocab[left + right] = len(vocab)
                merges.append(f"{left} {right}")
            left = left + right
    vocab[BOS] = len(vocab)
    vocab[EOS] = len(vocab)
    return vocab, tuple(merges)


def write_clip_tokenizer(directory: Path, words: tuple[str, ...] = tuple(_WORDS), pad_token: str = EOS) -> Path:
    """The four tokenizer files published diffusers folders hold."""
    directory.mkdir(parents=True, exist_ok=True)
    vocab, merges = bpe_vocab(words)
    (directory / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (directory / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    (directory / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": BOS, "eos_token": EOS, "pad_token": pad_token, "unk_token": EOS}))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": BOS, "eos_token": EOS, "pad_token": pad_token, "unk_token": EOS, "do_lower_case": True,
         "model_max_length": 77, "tokenizer_class": "CLIPTokenizer", "errors": "replace"}))
    return directory


def save_random_sd15(out: Path, seed: int = 0) -> Path:
    """A full-size SD 1.5 folder with random weights (about 4 GB of float32)."""
    import torch
    from diffusers import AutoencoderKL, DDIMScheduler, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(seed)
    with torch.no_grad():
        UNet2DConditionModel(**SD15_UNET).save_pretrained(out / "unet")
        CLIPTextModel(CLIPTextConfig(**SD15_TEXT)).save_pretrained(out / "text_encoder")
        AutoencoderKL(**SD15_VAE).save_pretrained(out / "vae")
    DDIMScheduler(**SD15_SCHEDULER).save_pretrained(out / "scheduler")
    write_clip_tokenizer(out / "tokenizer")
    index = {"_class_name": "StableDiffusionPipeline", "text_encoder": ["transformers", "CLIPTextModel"],
             "tokenizer": ["transformers", "CLIPTokenizer"], "unet": ["diffusers", "UNet2DConditionModel"],
             "vae": ["diffusers", "AutoencoderKL"], "scheduler": ["diffusers", "DDIMScheduler"],
             "safety_checker": [None, None], "feature_extractor": [None, None], "requires_safety_checker": False}
    (out / "model_index.json").write_text(json.dumps(index, indent=2))  # written last: marks the folder complete
    return out
