"""Train the built-in text-to-image model: a tiny Stable Diffusion on scikit-learn's digits.

``preheat train-text-digits --out DIR`` writes a ``StableDiffusionPipeline`` folder (what
``preheat/assets/text_digits`` ships), trained here in JAX with optax, with a fixed seed:

    component       what                                          trained
    --------------  --------------------------------------------  -----------------------------------
    tokenizer       CLIP byte-level BPE (vocab.json, merges.txt)  no: written, one token per word
    text_encoder    CLIPTextModel, width 32, 2 layers             with the UNet (from random, seed + 1)
    vae             AutoencoderKL, 16x16 RGB <-> 8x8x4 latents    first: reconstruction + small KL
    unet            UNet2DConditionModel, cross-attention to the  then, with the text encoder: epsilon
                    text encoder's last hidden state (77, 32)     prediction on the VAE's latents, EMA
    scheduler       DDIMScheduler (SD 1.x's scaled_linear betas)  --

The text encoder trains together with the UNet: a frozen random one was tried first, and its
prompts' hidden states differ too little for a short run's cross-attention to read (the gate
measured chance). The prompts are a fixed table (``text_digits_data.prompt_table``), tokenized
once before training.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from preheat.models.clip import CLIPTextConfig, CLIPTextModel
from preheat.models.loading import save_component
from preheat.models.unet2d_condition import UNet2DConditionConfig, UNet2DConditionModule
from preheat.models.vae import AutoencoderKL, AutoencoderKLConfig, LatentStat
from preheat.train.digits import lr_schedule
from preheat.train.text_digits_data import IMAGE_SIZE, STYLES, WORDS, digit_images, prompt_table, styled, to_rgb

__all__ = ["TextDigitsConfig", "TINY", "train_text_digits", "VAE_CONFIG", "UNET_CONFIG", "SCHEDULER", "DEFAULTS"]

NULL_P = 0.15  # share of examples whose prompt is replaced by "" (classifier-free guidance)
LATENT = IMAGE_SIZE // 2

# diffusers' / transformers' config.json kwargs (what is saved; preheat parses the same dicts)
VAE_CONFIG: dict[str, Any] = dict(
    in_channels=3, out_channels=3, latent_channels=4, block_out_channels=[8, 16], layers_per_block=1,
    down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2, norm_num_groups=4,
    act_fn="silu", sample_size=IMAGE_SIZE, mid_block_add_attention=False, force_upcast=False)
UNET_CONFIG: dict[str, Any] = dict(
    sample_size=LATENT, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=[32, 64],
    down_block_types=["CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
    up_block_types=["CrossAttnUpBlock2D", "CrossAttnUpBlock2D"], cross_attention_dim=32, attention_head_dim=4,
    norm_num_groups=8)
TEXT_CONFIG: dict[str, Any] = dict(
    hidden_size=32, intermediate_size=64, projection_dim=32, num_hidden_layers=2, num_attention_heads=4,
    max_position_embeddings=77, hidden_act="quick_gelu", layer_norm_eps=1e-5, pad_token_id=1)
SCHEDULER: dict[str, Any] = {
    "_class_name": "DDIMScheduler", "num_train_timesteps": 1000, "beta_schedule": "scaled_linear",
    "beta_start": 0.00085, "beta_end": 0.012, "prediction_type": "epsilon", "clip_sample": False,
    "set_alpha_to_one": False, "steps_offset": 1, "timestep_spacing": "leading"}
DEFAULTS = {"sampler": "ddim", "steps": 30, "guidance": 7.5}  # the SD family's, stated in the card


class TextDigitsConfig(NamedTuple):
    """What a run trains; ``TINY`` is a few-step run for tests of the command."""

    vae_steps: int = 400
    unet_steps: int = 5000  # the shipped run: 100% agreement (2000 steps: 51%)
    batch: int = 32
    seed: int = 0
    lr: float = 2e-3
    vae_lr: float = 2e-3
    kl_weight: float = 1e-3
    vae: dict[str, Any] = VAE_CONFIG
    unet: dict[str, Any] = UNET_CONFIG


TINY = TextDigitsConfig(vae_steps=3, unet_steps=3, batch=8,
                        unet={**UNET_CONFIG, "block_out_channels": [16, 32], "norm_num_groups": 8})


def _adamw(steps: int, lr: float) -> optax.GradientTransformation:
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(lr_schedule(steps, lr), weight_decay=1e-4))


def train_vae(config: TextDigitsConfig, images: np.ndarray, log: Callable[[str], None]) -> tuple[Any, float]:
    """Train the AutoencoderKL on ``images`` (N, 16, 16, 3) in [-1, 1]; -> (params, scaling_factor).

    scaling_factor is 1 / the std of the posterior means over the data, as SD's 0.18215 was measured."""
    vc = AutoencoderKLConfig.from_dict({**config.vae, "scaling_factor": 1.0})
    model = AutoencoderKL(vc, rngs=nnx.Rngs(config.seed))
    graphdef, params, stats = nnx.split(model, nnx.Param, LatentStat)
    tx = _adamw(config.vae_steps, config.vae_lr)
    opt_state = tx.init(params)

    def loss_fn(p: Any, x: jax.Array, key: jax.Array) -> jax.Array:
        vae = nnx.merge(graphdef, p, stats)
        mean, logvar = vae.encode(x)  # (B, 8, 8, 4) each
        z = mean + jnp.exp(0.5 * logvar) * jax.random.normal(key, mean.shape)
        recon = jnp.mean(jnp.square(vae.decode(z) - x))
        kl = 0.5 * jnp.mean(jnp.square(mean) + jnp.exp(logvar) - 1.0 - logvar)
        return recon + config.kl_weight * kl

    @jax.jit
    def step_fn(p: Any, opt_state: Any, x: jax.Array, key: jax.Array) -> tuple[Any, Any, jax.Array]:
        loss, grads = jax.value_and_grad(loss_fn)(p, x, key)
        updates, opt_state = tx.update(grads, opt_state, p)
        return optax.apply_updates(p, updates), opt_state, loss

    rng = np.random.default_rng(config.seed)
    key = jax.random.key(config.seed)
    start = time.perf_counter()
    for step in range(1, config.vae_steps + 1):
        key, sub = jax.random.split(key)
        params, opt_state, loss = step_fn(params, opt_state, images[rng.integers(0, len(images), config.batch)], sub)
        if step % 250 == 0 or step == config.vae_steps:
            log(f"vae step {step}/{config.vae_steps}  loss {float(loss):.4f}  ({time.perf_counter() - start:.0f}s)")
    means = _encode_means(graphdef, params, stats, images)
    return params, float(1.0 / means.std())


def _encode_means(graphdef: Any, params: Any, stats: Any, images: np.ndarray) -> np.ndarray:
    """Posterior means (N, 8, 8, 4) of ``images``, in chunks of one shape (one compile)."""
    encode = jax.jit(lambda p, x: nnx.merge(graphdef, p, stats).encode(x)[0])
    chunk = 512
    padded = np.concatenate([images, np.zeros((-len(images) % chunk, *images.shape[1:]), images.dtype)])
    means = [np.asarray(encode(params, padded[i:i + chunk])) for i in range(0, len(padded), chunk)]
    return np.concatenate(means)[:len(images)]


class TextEncoderStart(NamedTuple):
    """The CLIPTextModel as training starts: random (seed + 1), and every prompt's token ids."""

    graphdef: Any
    params: Any
    ids: np.ndarray  # (P, 77) int32, through the folder's own tokenizer files, as the pipelines read them


def text_encoder_start(folder: Path, text_config: dict[str, Any], seed: int, prompts: tuple[str, ...]) -> TextEncoderStart:
    from preheat.models.tokenizer import CLIPTokenizer

    model = CLIPTextModel(CLIPTextConfig.from_dict(text_config), rngs=nnx.Rngs(seed + 1))
    graphdef, params = nnx.split(model)
    ids = np.asarray(CLIPTokenizer.from_folder(folder / "tokenizer").encode(list(prompts)), np.int32)
    return TextEncoderStart(graphdef, params, ids)


class Trained(NamedTuple):
    unet: Any  # EMA params
    text_encoder: Any  # EMA params


def train_unet(config: TextDigitsConfig, latents: np.ndarray, labels: np.ndarray, table: Any, text: TextEncoderStart,
               log: Callable[[str], None]) -> Trained:
    """Epsilon prediction on ``latents`` (S, N, 8, 8, 4) (one set per style), the UNet and the text
    encoder together -> their EMA params.

    The text encoder trains with the UNet: a random frozen one maps each prompt to hidden states
    that differ only at the word's position (mean |diff| 0.02 of 1), and a 1000-step UNet did not
    learn to read them (10% agreement, chance). Each example draws a style, then one of the table's
    prompts for its digit in that style; NULL_P of them the empty prompt instead."""
    uc = UNet2DConditionConfig.from_dict(config.unet)
    model = UNet2DConditionModule(uc, rngs=nnx.Rngs(config.seed + 2))
    graphdef, unet_params = nnx.split(model)
    params = (unet_params, text.params)
    ema = params
    tx = _adamw(config.unet_steps, config.lr)
    opt_state = tx.init(params)
    c = SCHEDULER  # scaled_linear: betas evenly spaced in sqrt
    betas = np.linspace(c["beta_start"] ** 0.5, c["beta_end"] ** 0.5, c["num_train_timesteps"]) ** 2
    acp = jnp.asarray(np.cumprod(1 - betas), jnp.float32)  # (1000,)
    ids = jnp.asarray(text.ids)  # (P, 77)
    null = len(table.prompts) - 1
    # choices[d, s]: the prompt rows for digit d in style s (the same count for every pair)
    choices = np.stack([np.stack([np.flatnonzero((table.digit == d) & (table.style == s)) for s in range(len(STYLES))])
                        for d in range(10)])  # (10, S, K)

    def loss_fn(p: Any, x0: jax.Array, rows: jax.Array, key: jax.Array) -> jax.Array:
        k_t, k_n, k_drop = jax.random.split(key, 3)
        b = x0.shape[0]
        t = jax.random.randint(k_t, (b,), 0, acp.shape[0])
        noise = jax.random.normal(k_n, x0.shape)
        a = acp[t][:, None, None, None]
        xt = jnp.sqrt(a) * x0 + jnp.sqrt(1 - a) * noise
        rows = jnp.where(jax.random.uniform(k_drop, (b,)) < NULL_P, null, rows)
        context = nnx.merge(text.graphdef, p[1])(ids[rows]).last_hidden_state  # (B, 77, D)
        pred = nnx.merge(graphdef, p[0])(xt, t.astype(jnp.float32), context)
        return jnp.mean(jnp.square(pred - noise))

    @jax.jit
    def step_fn(p: Any, ema: Any, opt_state: Any, x0: jax.Array, rows: jax.Array, key: jax.Array,
                step: jax.Array) -> tuple[Any, Any, Any, jax.Array]:
        loss, grads = jax.value_and_grad(loss_fn)(p, x0, rows, key)
        updates, opt_state = tx.update(grads, opt_state, p)
        p = optax.apply_updates(p, updates)
        decay = jnp.minimum(0.999, (1.0 + step) / (10.0 + step))  # EMA warm-up: forget the init fast
        ema = jax.tree.map(lambda e, q: decay * e + (1 - decay) * q, ema, p)
        return p, ema, opt_state, loss

    rng = np.random.default_rng(config.seed + 3)
    key = jax.random.key(config.seed + 3)
    start = time.perf_counter()
    n = latents.shape[1]
    for step in range(1, config.unet_steps + 1):
        idx = rng.integers(0, n, config.batch)
        style = rng.integers(0, len(STYLES), config.batch)
        rows = choices[labels[idx], style, rng.integers(0, choices.shape[2], config.batch)]
        key, sub = jax.random.split(key)
        params, ema, opt_state, loss = step_fn(params, ema, opt_state, latents[style, idx], rows, sub,
                                               jnp.float32(step))
        if step % 250 == 0 or step == config.unet_steps:
            log(f"unet step {step}/{config.unet_steps}  loss {float(loss):.4f}  ({time.perf_counter() - start:.0f}s)")
    return Trained(*ema)


def train_text_digits(out: str | Path, config: TextDigitsConfig = TextDigitsConfig(),
                      log: Callable[[str], None] = print) -> Path:
    """Train every component and write the pipeline folder at ``out`` (see the module docstring)."""
    from preheat.models.bpe_files import BOS, EOS, bpe_vocab, write_clip_tokenizer

    out = Path(out)
    ink, labels = digit_images()
    images = np.stack([to_rgb(styled(ink, s)) for s in STYLES])  # (S, N, 16, 16, 3)
    vae_params, scaling = train_vae(config, images.reshape(-1, *images.shape[2:]), log)
    vae_config = {**config.vae, "scaling_factor": scaling}
    vc = AutoencoderKLConfig.from_dict(vae_config)
    graphdef, _, stats = nnx.split(AutoencoderKL(vc, rngs=nnx.Rngs(0)), nnx.Param, LatentStat)
    latents = np.stack([_encode_means(graphdef, vae_params, stats, im) for im in images]) * scaling  # (S, N, 8, 8, 4)

    write_clip_tokenizer(out / "tokenizer", words=WORDS)
    vocab, _ = bpe_vocab(WORDS)
    text_config = {**TEXT_CONFIG, "vocab_size": len(vocab), "bos_token_id": vocab[BOS], "eos_token_id": vocab[EOS]}
    table = prompt_table()
    text = text_encoder_start(out, text_config, config.seed, table.prompts)
    unet_params, te_params = train_unet(config, latents, labels, table, text, log)

    save_component(vae_params, out / "vae", {"_class_name": "AutoencoderKL", **vae_config})
    save_component(unet_params, out / "unet", {"_class_name": "UNet2DConditionModel", **config.unet})
    save_component(te_params, out / "text_encoder", {"architectures": ["CLIPTextModel"],
                                                     "model_type": "clip_text_model", **text_config},
                   weights_name="model.safetensors")
    return write_pipeline_files(out, config, scaling)


def _card_args(config: TextDigitsConfig) -> str:
    return (f"--vae-steps {config.vae_steps} --unet-steps {config.unet_steps} --batch {config.batch} "
            f"--seed {config.seed} --lr {config.lr}")


def record_agreement(out: Path, config: TextDigitsConfig) -> Any:
    """Run the ship gate (``text_digits_check``) on ``out`` and write its result into the card."""
    from preheat.files import atomic_write_bytes
    from preheat.models.safetensors_files import read_json
    from preheat.train.text_digits_check import check_folder

    agreement = check_folder(out)
    scaling = float(read_json(out / "vae" / "config.json")["scaling_factor"])
    measured = (f"{agreement.accuracy:.0%} of {agreement.samples} samples (prompts \"a 0\"..\"a nine\", seed 0, "
                f"{DEFAULTS['sampler']} {DEFAULTS['steps']} steps, guidance {DEFAULTS['guidance']}); mean ink "
                f"of \"a bold D\" {agreement.bold_ink:.3f} vs \"a thin D\" {agreement.thin_ink:.3f}")
    atomic_write_bytes(out / "README.md", model_card(_card_args(config), scaling, measured).encode())
    return agreement


def write_pipeline_files(out: Path, config: TextDigitsConfig, scaling: float) -> Path:
    """scheduler/, README.md, then model_index.json (last: it marks the folder complete)."""
    from preheat.files import atomic_write_bytes

    atomic_write_bytes(out / "scheduler" / "scheduler_config.json", (json.dumps(SCHEDULER, indent=2) + "\n").encode())
    atomic_write_bytes(out / "README.md", model_card(_card_args(config), scaling).encode())
    index = {"_class_name": "StableDiffusionPipeline", "_diffusers_version": "0.36.0",
             "text_encoder": ["transformers", "CLIPTextModel"], "tokenizer": ["transformers", "CLIPTokenizer"],
             "unet": ["diffusers", "UNet2DConditionModel"], "vae": ["diffusers", "AutoencoderKL"],
             "scheduler": ["diffusers", "DDIMScheduler"], "safety_checker": [None, None],
             "feature_extractor": [None, None], "image_encoder": [None, None], "requires_safety_checker": False}
    atomic_write_bytes(out / "model_index.json", (json.dumps(index, indent=2) + "\n").encode())
    return out


def model_card(args: str, scaling: float, accuracy: str = "not measured (`--no-check`)") -> str:
    return f"""# preheat built-in model: text-digits-16

A tiny text-to-image `StableDiffusionPipeline` (diffusers layout) that draws 16x16 handwritten
digits from prompts such as "a seven", "a 7", "a bold 3", "a thin 0", "an eight".

- Data: scikit-learn's bundled `load_digits` (1,797 8x8 images), upsampled bilinearly to 16x16,
  white ink on black. Styles: "bold" = strokes dilated (2x2 maximum filter), "thin" = strokes
  eroded and faded; no style word = the digit as it is.
- Prompts: the digit's word or numeral, with or without "a"/"an" and a style; the empty prompt
  replaces 15% of them (classifier-free guidance).
- Components: CLIP BPE tokenizer (one token per prompt word); CLIPTextModel (width 32, 2 layers)
  trained with the UNet from random (seed + 1; a frozen random one left the prompts unread);
  AutoencoderKL (8/16 channels) 16x16x3 <-> 8x8x4, trained first (MSE + 1e-3 KL,
  scaling_factor {scaling:.5f} = 1 / std of the latents); UNet2DConditionModel (32/64 channels,
  cross-attention to the text states), trained second, with the text encoder: epsilon
  prediction, SD 1.x's scaled_linear schedule (1000 steps), EMA weights (0.999). DDIM scheduler.
- Trained by preheat itself, in JAX with optax, on a CPU, with a fixed seed:

      preheat train-text-digits --out DIR {args}

- Agreement of an independent classifier (scikit-learn SVC on the real 8x8 digits) with the
  prompted digit: {accuracy}.
- Loads in torch too: `diffusers.StableDiffusionPipeline.from_pretrained(DIR)`.
"""
