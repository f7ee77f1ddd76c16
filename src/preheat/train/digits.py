"""Train the built-in model: a class-conditional UNet2DModel on scikit-learn's bundled digits.

``preheat train-digits --out DIR`` reproduces the folder shipped in ``preheat/assets/digits``
(fixed seed; the result depends on the jax/XLA build only through float rounding).

Data: the 1,797 8x8 images of ``sklearn.datasets.load_digits`` (values 0..16), upsampled
bilinearly to 16x16 and scaled to [-1, 1]. Classes 0..9 plus a "null" class 10 that replaces
the label 15% of the time, so that classifier-free guidance works at sampling time.
Objective: epsilon prediction under diffusers' DDPM schedule (linear betas, 1000 steps), with
an exponential moving average of the weights (0.999, with warm-up), which is what is saved.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from preheat.models.loading import save_unet
from preheat.models.unet2d import UNet2DConfig, UNet2DModule

__all__ = ["DIGITS_UNET", "DIGITS_SCHEDULER", "NULL_CLASS", "train_digits", "digits_dataset", "lr_schedule"]

NULL_CLASS = 10
IMAGE_SIZE = 16

DIGITS_UNET = UNet2DConfig(
    sample_size=IMAGE_SIZE,
    in_channels=1,
    out_channels=1,
    block_out_channels=(32, 64, 64),
    layers_per_block=1,
    down_block_types=("DownBlock2D", "AttnDownBlock2D", "AttnDownBlock2D"),
    up_block_types=("AttnUpBlock2D", "AttnUpBlock2D", "UpBlock2D"),
    norm_num_groups=8,
    attention_head_dim=32,
    num_class_embeds=NULL_CLASS + 1,  # 10 digits + the null class for guidance
)

DIGITS_SCHEDULER = {
    "_class_name": "DDPMScheduler",
    "num_train_timesteps": 1000,
    "beta_schedule": "linear",
    "beta_start": 0.0001,
    "beta_end": 0.02,
    "prediction_type": "epsilon",
    "clip_sample": True,
    "clip_sample_range": 1.0,
    "variance_type": "fixed_small",
    "timestep_spacing": "leading",
    "steps_offset": 1,
    "set_alpha_to_one": False,
}

# What `preheat sample` uses for this model when the user does not say (also in model_index.json).
DIGITS_DEFAULTS = {"sampler": "dpmpp_2m", "steps": 20, "guidance": 2.0}


def digits_dataset() -> tuple[np.ndarray, np.ndarray]:
    """(N, 16, 16, 1) float32 in [-1, 1], (N,) int32 labels."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = digits.images.astype(np.float32)[..., None] / 16.0 * 2.0 - 1.0  # (N, 8, 8, 1)
    x = np.asarray(jax.image.resize(x, (x.shape[0], IMAGE_SIZE, IMAGE_SIZE, 1), "bilinear"))
    return x, digits.target.astype(np.int32)


def lr_schedule(steps: int, lr: float) -> optax.Schedule:
    """Linear warm-up, then cosine decay to 5% of ``lr`` at ``steps``. The warm-up is 200 steps (the
    shipped model's 3000-step run), or half of a shorter run (any ``steps`` >= 1 trains)."""
    return optax.warmup_cosine_decay_schedule(0.0, lr, min(200, steps // 2), steps, lr * 0.05)


def train_digits(out: str | Path, *, steps: int = 3000, batch: int = 64, seed: int = 0, lr: float = 2e-3,
                 log: Callable[[str], None] = print) -> Path:
    images, labels = digits_dataset()
    # alphas_cumprod of the linear schedule, in float64. (preheat.samplers reproduces diffusers'
    # float32 table bit for bit for sampling; the 1e-7 difference is irrelevant to training, and
    # keeping this line keeps the shipped weights reproducible by the command in the model card.)
    c = DIGITS_SCHEDULER
    acp = jnp.asarray(np.cumprod(1 - np.linspace(c["beta_start"], c["beta_end"], c["num_train_timesteps"])), jnp.float32)
    model = UNet2DModule(DIGITS_UNET, rngs=nnx.Rngs(seed))
    graphdef, params = nnx.split(model)
    ema = params
    schedule = lr_schedule(steps, lr)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=1e-4))
    opt_state = tx.init(params)

    def loss_fn(p, x0, y, key):
        k_t, k_n, k_drop = jax.random.split(key, 3)
        b = x0.shape[0]
        t = jax.random.randint(k_t, (b,), 0, acp.shape[0])
        noise = jax.random.normal(k_n, x0.shape)
        a = acp[t][:, None, None, None]
        xt = jnp.sqrt(a) * x0 + jnp.sqrt(1 - a) * noise
        y = jnp.where(jax.random.uniform(k_drop, (b,)) < 0.15, NULL_CLASS, y)
        pred = nnx.merge(graphdef, p)(xt, t.astype(jnp.float32), y)
        return jnp.mean(jnp.square(pred - noise))

    @jax.jit
    def train_step(p, ema, opt_state, x0, y, key, step):
        loss, grads = jax.value_and_grad(loss_fn)(p, x0, y, key)
        updates, opt_state = tx.update(grads, opt_state, p)
        p = optax.apply_updates(p, updates)
        decay = jnp.minimum(0.999, (1.0 + step) / (10.0 + step))  # EMA warm-up: forget the init fast
        ema = jax.tree.map(lambda e, q: decay * e + (1 - decay) * q, ema, p)
        return p, ema, opt_state, loss

    rng = np.random.default_rng(seed)
    key = jax.random.key(seed)
    start = time.perf_counter()
    running = None
    for step in range(1, steps + 1):
        idx = rng.integers(0, images.shape[0], batch)
        key, sub = jax.random.split(key)
        params, ema, opt_state, loss = train_step(params, ema, opt_state, images[idx], labels[idx], sub, jnp.float32(step))
        if step % 250 == 0 or step == steps:
            loss = float(loss)
            running = loss if running is None else 0.9 * running + 0.1 * loss
            log(f"step {step}/{steps}  loss {loss:.4f}  ({time.perf_counter() - start:.0f}s)")
    return write_digits_folder(out, ema, steps=steps, batch=batch, seed=seed, lr=lr)


def write_digits_folder(out: str | Path, params: nnx.State, **training: object) -> Path:
    """The diffusers-format pipeline folder: model_index.json, unet/, scheduler/, README.md."""
    from preheat.files import atomic_write_bytes

    out = Path(out)
    save_unet(DIGITS_UNET, params, out / "unet")
    atomic_write_bytes(out / "scheduler" / "scheduler_config.json", (json.dumps(DIGITS_SCHEDULER, indent=2) + "\n").encode())
    index = {
        "_class_name": "DDPMPipeline",
        "scheduler": ["diffusers", "DDPMScheduler"],
        "unet": ["diffusers", "UNet2DModel"],
        "preheat": {"defaults": DIGITS_DEFAULTS, "null_class": NULL_CLASS,
                    "labels": [str(i) for i in range(10)], "image_size": IMAGE_SIZE},
    }
    atomic_write_bytes(out / "model_index.json", (json.dumps(index, indent=2) + "\n").encode())
    args = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in training.items())
    card = f"""# preheat built-in model: digits-16

A class-conditional `UNet2DModel` (diffusers format) that draws 16x16 handwritten digits.

- Data: scikit-learn's bundled `load_digits` (1,797 8x8 images), upsampled bilinearly to 16x16.
- Classes: 0-9, plus class {NULL_CLASS} = "no class" (used for classifier-free guidance).
- Objective: epsilon prediction, DDPM linear schedule, 1000 steps; EMA weights (0.999).
- Trained by preheat itself, with optax, on a CPU, with a fixed seed:

      preheat train-digits --out DIR {args}

- Defaults used by `preheat sample`: {json.dumps(DIGITS_DEFAULTS)}.
- Loads in torch too: `diffusers.UNet2DModel.from_pretrained(DIR, subfolder="unet")`.
"""
    atomic_write_bytes(out / "README.md", card.encode())
    return out
