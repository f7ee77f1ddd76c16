"""Diffusers' ``AutoencoderKL`` in JAX (Flax NNX): the latent decoder and encoder of SD 1.x/2.x,
SDXL, SD3 and Flux, numerically matching the torch original.

Every submodule is named like its diffusers counterpart, so a weight's parameter path is its
checkpoint key (``decoder.up_blocks.0.upsamplers.0.conv.weight``); the blocks are unet2d's
(``ResnetBlock2D`` without a time embedding, ``Attention``, ``Downsample2D``, ``Upsample2D``).
Images and latents are NHWC; images are in [-1, 1] (raw decoder output, not clipped).

What changes the compiled program, and what is data::

    static (AutoencoderKLConfig.architecture_dict)      data (VAE.params, arguments)
    ---------------------------------------------       ------------------------------------------
    channels, blocks, layers, groups, act_fn,           the weights
    latent_channels, quant convs, mid attention,        latent_scale / latent_shift (LatentStat):
    sample_size (default tile size), force_upcast       scaling_factor, shift_factor,
    the dtype, the latent/image size, the tile layout   latents_mean, latents_std

The latent statistics are kept in ``params`` rather than baked into the program: SD 1.5's and
SDXL's VAEs share one architecture and differ only in ``scaling_factor`` (and the dtype), so one
cached executable serves both without a stale factor ever being read back from the cache.

Latent convention (diffusers' pipelines)::

    latents_to_images:  z = latents / scaling_factor + shift_factor         (SD, SDXL, SD3, Flux)
                        z = latents * latents_std / scaling_factor + latents_mean   (when set; SDXL pipeline)
    images_to_latents:  the exact inverse, from the posterior mean or a sample of it
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from preheat.errors import InvalidArgumentError, ModelNotFoundError, UnsupportedConfigError
from preheat.models import weights
from preheat.models.loading import legacy_unet_key
from preheat.models.config import JsonConfig
from preheat.models.layers import Conv2d, GroupNorm, ResnetBlock2D, Upsample2D, lift
from preheat.models.unet_blocks import BlockSpec, DownBlock, MidBlock
from preheat.models.safetensors_files import DIFFUSERS_STEM, read_json, read_tensors, weight_files
from preheat.models.weights import LoadOptions, check_dtype, fill

__all__ = ["AutoencoderKLConfig", "AutoencoderKL", "VAE", "LatentStat", "SUPPORTED", "load_vae", "read_vae_config",
           "resolve_vae_dir", "build_abstract", "effective_dtype"]

Array = jax.Array

# Everything published AutoencoderKL checkpoints use. Anything else is refused by name.
SUPPORTED: dict[str, tuple[Any, ...]] = {
    "down_block_types": ("DownEncoderBlock2D",),
    "up_block_types": ("UpDecoderBlock2D",),
    "act_fn": ("silu", "swish", "mish", "gelu", "relu"),
}

# Config fields that are data (carried in params as LatentStat), not architecture.
_DATA_KEYS = {"scaling_factor", "shift_factor", "latents_mean", "latents_std"}

_EPS = 1e-6  # diffusers hard-codes this eps for every VAE norm
_LOGVAR_RANGE = (-30.0, 20.0)  # DiagonalGaussianDistribution clamps logvar to this


@dataclass(frozen=True)
class AutoencoderKLConfig(JsonConfig):
    """The architecture and latent statistics, parsed from diffusers' ``config.json`` (same names, same defaults)."""

    in_channels: int = 3
    out_channels: int = 3
    down_block_types: tuple[str, ...] = ("DownEncoderBlock2D",)
    up_block_types: tuple[str, ...] = ("UpDecoderBlock2D",)
    block_out_channels: tuple[int, ...] = (64,)
    layers_per_block: int = 1  # encoder blocks; decoder blocks have one more
    act_fn: str = "silu"  # resnets only; the output head is always SiLU
    latent_channels: int = 4  # 4 (SD, SDXL) or 16 (SD3, Flux)
    norm_num_groups: int = 32
    sample_size: int | tuple[int, int] = 32  # native image size; the default tile of decode_tiled
    scaling_factor: float = 0.18215  # latent std at training time: latents = z * scaling_factor
    shift_factor: float | None = None  # latent mean (SD3, Flux): latents = (z - shift) * scaling
    latents_mean: tuple[float, ...] | None = None  # per-channel mean/std (SDXL pipeline convention)
    latents_std: tuple[float, ...] | None = None
    force_upcast: bool = True  # run in float32 even when the rest of the pipeline is fp16/bf16
    use_quant_conv: bool = True  # 1x1 convs around the latent (absent in SD3/Flux)
    use_post_quant_conv: bool = True
    mid_block_add_attention: bool = True

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> "AutoencoderKLConfig":
        return cls.from_checked_dict(raw, source, "AutoencoderKL")

    def architecture_dict(self) -> dict[str, Any]:
        """The fields that change the program (for cache keys): not the latent statistics, which are data."""
        return {k: v for k, v in self.to_dict().items() if k not in _DATA_KEYS}

    def validate(self, source: str = "config") -> None:
        def refuse(name: str, value: Any) -> None:
            allowed = ", ".join(repr(v) for v in SUPPORTED[name])
            raise UnsupportedConfigError(f"unsupported {name} {value!r}; supported: {allowed} (in {source})")

        for name in ("down_block_types", "up_block_types"):
            for block in getattr(self, name):
                if block not in SUPPORTED[name]:
                    refuse(name, block)
        if not isinstance(self.act_fn, str) or self.act_fn.lower() not in SUPPORTED["act_fn"]:
            refuse("act_fn", self.act_fn)
        n = len(self.block_out_channels)
        if n == 0 or len(self.down_block_types) != n or len(self.up_block_types) != n:
            raise UnsupportedConfigError(
                f"block_out_channels has {n} entries but down_block_types has {len(self.down_block_types)} "
                f"and up_block_types {len(self.up_block_types)}; they must be equal and non-zero"
            )
        for name in ("in_channels", "out_channels", "latent_channels", "layers_per_block", "norm_num_groups"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise UnsupportedConfigError(f"unsupported {name} {value!r}; must be a positive int")
        for ch in self.block_out_channels:
            if not isinstance(ch, int) or ch <= 0 or ch % self.norm_num_groups:
                raise UnsupportedConfigError(
                    f"block_out_channels entry {ch!r} is not a positive multiple of norm_num_groups {self.norm_num_groups}"
                )
        if not _is_number(self.scaling_factor) or self.scaling_factor <= 0:
            raise UnsupportedConfigError(f"unsupported scaling_factor {self.scaling_factor!r}; must be a positive number")
        if self.shift_factor is not None and not _is_number(self.shift_factor):
            raise UnsupportedConfigError(f"unsupported shift_factor {self.shift_factor!r}; must be a number or null")
        if (self.latents_mean is None) != (self.latents_std is None):
            raise UnsupportedConfigError("latents_mean and latents_std must be both set or both null")
        if self.latents_mean is not None:
            if self.shift_factor is not None:
                raise UnsupportedConfigError("shift_factor together with latents_mean/latents_std is ambiguous; set one")
            for name in ("latents_mean", "latents_std"):
                value = getattr(self, name)
                if len(value) != self.latent_channels or not all(_is_number(v) for v in value):
                    raise UnsupportedConfigError(
                        f"{name} must hold {self.latent_channels} numbers (latent_channels), got {list(value)!r}")
            if not all(v > 0 for v in self.latents_std):
                raise UnsupportedConfigError(f"latents_std entries must be positive, got {list(self.latents_std)!r}")
        size = self.sample_size
        sizes = size if isinstance(size, tuple) else (size,)
        if not 1 <= len(sizes) <= 2 or not all(isinstance(s, int) and s > 0 for s in sizes):
            raise UnsupportedConfigError(f"unsupported sample_size {size!r}; must be a positive int or a pair")

    @property
    def downscale(self) -> int:
        """Image pixels per latent pixel along each axis (8 for every published VAE)."""
        return 2 ** (len(self.block_out_channels) - 1)

    def latent_affine(self) -> tuple[np.ndarray, np.ndarray]:
        """(scale, shift), each (latent_channels,) float32, with ``z = latents * scale + shift``."""
        c = self.latent_channels
        if self.latents_mean is not None:
            scale = np.asarray(self.latents_std, np.float64) / self.scaling_factor
            shift = np.asarray(self.latents_mean, np.float64)
        else:
            scale = np.full((c,), 1.0 / self.scaling_factor)
            shift = np.full((c,), self.shift_factor or 0.0)
        return scale.astype(np.float32), shift.astype(np.float32)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# ----------------------------------------------------------------------------------------------


class LatentStat(nnx.Variable):
    """Per-channel latent statistics from the config, not from the checkpoint: data in ``params``."""


class UpDecoderBlock2D(nnx.Module):
    """Resnets (no skip connections, no time embedding), then an optional nearest x2 upsampler."""

    def __init__(self, cin: int, cout: int, layers: int, upsample: bool, s: BlockSpec, *, rngs: nnx.Rngs):
        self.resnets = nnx.List([
            ResnetBlock2D(cin if i == 0 else cout, cout, None, groups=s.groups, eps=s.eps, act=s.act,
                          scale_shift=False, output_scale_factor=1.0, rngs=rngs)
            for i in range(layers)
        ])
        self.upsamplers = nnx.List([Upsample2D(cout, rngs=rngs)]) if upsample else None

    def __call__(self, x: Array) -> Array:
        for resnet in self.resnets:
            x = resnet(x)
        if self.upsamplers is not None:
            x = self.upsamplers[0](x)
        return x


def _mid_block(c: AutoencoderKLConfig, s: BlockSpec, rngs: nnx.Rngs) -> MidBlock:
    # One attention head spanning all channels, normed with the resnets' groups.
    ch = c.block_out_channels[-1]
    return MidBlock(ch, ch, c.mid_block_add_attention, c.norm_num_groups, 1.0, s, rngs=rngs)


class Encoder(nnx.Module):
    """Image -> 2 * latent_channels moments (mean, logvar) at 1/downscale resolution."""

    def __init__(self, c: AutoencoderKLConfig, s: BlockSpec, *, rngs: nnx.Rngs):
        chans = c.block_out_channels
        self.conv_in = Conv2d(c.in_channels, chans[0], 3, padding=1, rngs=rngs)
        blocks = []
        out_ch = chans[0]
        for i in range(len(chans)):
            in_ch, out_ch = out_ch, chans[i]
            # DownEncoderBlock2D: unet2d's DownBlock without attention; padding 0 = diffusers' (0,1,0,1) pad.
            blocks.append(DownBlock(in_ch, out_ch, c.layers_per_block, False, None, i < len(chans) - 1, 0, s,
                                    rngs=rngs))
        self.down_blocks = nnx.List(blocks)
        self.mid_block = _mid_block(c, s, rngs)
        self.conv_norm_out = GroupNorm(c.norm_num_groups, chans[-1], _EPS)
        self.conv_out = Conv2d(chans[-1], 2 * c.latent_channels, 3, padding=1, rngs=rngs)

    def __call__(self, x: Array) -> Array:  # (B, H, W, Cin) -> (B, H/f, W/f, 2L)
        h = self.conv_in(x)
        for block in self.down_blocks:
            h, _ = block(h)
        h = self.mid_block(h)
        return self.conv_out(jax.nn.silu(self.conv_norm_out(h)))


class Decoder(nnx.Module):
    """Latent -> image at downscale x the resolution."""

    def __init__(self, c: AutoencoderKLConfig, s: BlockSpec, *, rngs: nnx.Rngs):
        rev = list(reversed(c.block_out_channels))
        self.conv_in = Conv2d(c.latent_channels, rev[0], 3, padding=1, rngs=rngs)
        self.mid_block = _mid_block(c, s, rngs)
        blocks = []
        out_ch = rev[0]
        for i in range(len(rev)):
            prev, out_ch = out_ch, rev[i]
            blocks.append(UpDecoderBlock2D(prev, out_ch, c.layers_per_block + 1, i < len(rev) - 1, s, rngs=rngs))
        self.up_blocks = nnx.List(blocks)
        self.conv_norm_out = GroupNorm(c.norm_num_groups, rev[-1], _EPS)
        self.conv_out = Conv2d(rev[-1], c.out_channels, 3, padding=1, rngs=rngs)

    def __call__(self, z: Array) -> Array:  # (B, h, w, L) -> (B, h*f, w*f, Cout)
        h = self.mid_block(self.conv_in(z))
        for block in self.up_blocks:
            h = block(h)
        return self.conv_out(jax.nn.silu(self.conv_norm_out(h)))


class AutoencoderKL(nnx.Module):
    """The network (NHWC). Latents here are raw (unscaled); see ``VAE`` for the pipeline convention."""

    def __init__(self, config: AutoencoderKLConfig, *, rngs: nnx.Rngs):
        c = config
        c.validate()
        self.config = c
        spec = BlockSpec(c.norm_num_groups, _EPS, c.act_fn, False, None)
        self.encoder = Encoder(c, spec, rngs=rngs)
        self.decoder = Decoder(c, spec, rngs=rngs)
        lat = c.latent_channels
        self.quant_conv = Conv2d(2 * lat, 2 * lat, 1, rngs=rngs) if c.use_quant_conv else None
        self.post_quant_conv = Conv2d(lat, lat, 1, rngs=rngs) if c.use_post_quant_conv else None
        scale, shift = c.latent_affine()
        self.latent_scale = LatentStat(jnp.asarray(scale))  # (L,)
        self.latent_shift = LatentStat(jnp.asarray(shift))  # (L,)

    def encode(self, x: Array) -> tuple[Array, Array]:
        """(B, H, W, Cin) images -> mean, logvar, each (B, H/f, W/f, L); logvar clamped like diffusers."""
        moments = self.encoder(x)
        if self.quant_conv is not None:
            moments = self.quant_conv(moments)
        mean, logvar = jnp.split(moments, 2, axis=-1)
        return mean, jnp.clip(logvar, *_LOGVAR_RANGE)

    def decode(self, z: Array) -> Array:
        """(B, h, w, L) raw latents -> (B, h*f, w*f, Cout) images in about [-1, 1]."""
        if self.post_quant_conv is not None:
            z = self.post_quant_conv(z)
        return self.decoder(z)

    def unscale(self, latents: Array) -> Array:
        """Diffusion latents -> raw latents (float32 math): ``latents * scale + shift``."""
        nd = latents.ndim
        return latents.astype(jnp.float32) * lift(self.latent_scale[...], nd) + lift(self.latent_shift[...], nd)

    def scale(self, z: Array) -> Array:
        """Raw latents -> diffusion latents, the inverse of ``unscale``."""
        nd = z.ndim
        return (z.astype(jnp.float32) - lift(self.latent_shift[...], nd)) / lift(self.latent_scale[...], nd)


# ----------------------------------------------------------------------------------------------
# Tiled decoding (diffusers' AutoencoderKL.tiled_decode), with a layout fixed by the latent size.


def _blend(a: Array, b: Array, extent: int, axis: int) -> Array:
    """b's first ``extent`` rows (axis 1) or columns (axis 2) faded in linearly from a's last ones."""
    extent = min(a.shape[axis], b.shape[axis], extent)
    if extent <= 0:
        return b
    shape = [1, 1, 1, 1]
    shape[axis] = extent
    w = jnp.asarray((np.arange(extent) / extent).reshape(shape), dtype=b.dtype)  # (1, e, 1, 1) or (1, 1, e, 1)
    a_tail = jax.lax.slice_in_dim(a, a.shape[axis] - extent, a.shape[axis], axis=axis)
    b_head = jax.lax.slice_in_dim(b, 0, extent, axis=axis)
    b_rest = jax.lax.slice_in_dim(b, extent, b.shape[axis], axis=axis)
    return jnp.concatenate([a_tail * (1 - w) + b_head * w, b_rest], axis=axis)


# ----------------------------------------------------------------------------------------------


@dataclass
class VAE:
    """A loaded AutoencoderKL. Methods are pure functions of ``params`` (jit them with params as an argument).

    ``dtype`` is the effective dtype: float32 when the config says ``force_upcast`` and a half dtype was asked for.
    Inputs are cast to it; outputs come back in it.
    """

    config: AutoencoderKLConfig
    graphdef: nnx.GraphDef
    params: nnx.State
    dtype: Any = jnp.float32

    def _model(self, params: nnx.State) -> AutoencoderKL:
        return nnx.merge(self.graphdef, params)

    @property
    def latent_channels(self) -> int:
        return self.config.latent_channels

    @property
    def downscale(self) -> int:
        return self.config.downscale

    def decode(self, params: nnx.State, z: Array) -> Array:
        """(B, h, w, L) raw latents -> (B, h*f, w*f, Cout) images in [-1, 1] (not clipped)."""
        return self._model(params).decode(jnp.asarray(z).astype(self.dtype))

    def encode(self, params: nnx.State, x: Array) -> tuple[Array, Array]:
        """(B, H, W, Cin) images in [-1, 1] -> (mean, logvar) of the posterior, raw latents (B, H/f, W/f, L)."""
        return self._model(params).encode(jnp.asarray(x).astype(self.dtype))

    def unscale(self, params: nnx.State, latents: Array) -> Array:
        """Diffusion latents -> raw latents, float32 (``latents / scaling_factor + shift_factor``)."""
        return self._model(params).unscale(jnp.asarray(latents))

    def latents_to_images(self, params: nnx.State, latents: Array) -> Array:
        """Diffusion latents (the sampler's output) -> images, with the pipelines' scaling and shift.

        For large images, ``decode_tiled(params, unscale(params, latents))`` is the tiled equivalent.
        """
        return self.decode(params, self.unscale(params, latents))

    def images_to_latents(self, params: nnx.State, x: Array, key: Array | None = None,
                          noise: Array | None = None) -> Array:
        """Images -> diffusion latents (float32): the posterior mean, or a sample of it when ``key``
        (one draw for the batch) or ``noise`` (a standard-normal draw of the latent shape, e.g. one
        per image from its seed) is given -- diffusers' pipelines sample (``retrieve_latents``)."""
        model = self._model(params)
        mean, logvar = model.encode(jnp.asarray(x).astype(self.dtype))
        z = mean.astype(jnp.float32)
        if key is not None:
            noise = jax.random.normal(key, z.shape, jnp.float32)
        if noise is not None:
            z = z + jnp.exp(0.5 * logvar.astype(jnp.float32)) * noise.astype(jnp.float32)
        return model.scale(z)

    def tile_sizes(self, tile_latent_min_size: int | None = None,
                   tile_sample_min_size: int | None = None) -> tuple[int, int]:
        """(latent tile, image tile) edges: diffusers' defaults from ``sample_size``; one given implies the other."""
        f = self.downscale
        if tile_latent_min_size is None and tile_sample_min_size is None:
            size = self.config.sample_size
            tile_sample_min_size = size[0] if isinstance(size, tuple) else size
        if tile_latent_min_size is None:
            tile_latent_min_size = int(tile_sample_min_size / f)
        if tile_sample_min_size is None:
            tile_sample_min_size = tile_latent_min_size * f
        if tile_latent_min_size <= 0 or tile_sample_min_size <= 0:
            raise InvalidArgumentError(f"tile sizes must be positive, got latent {tile_latent_min_size} "
                                       f"and image {tile_sample_min_size}")
        return tile_latent_min_size, tile_sample_min_size

    def decode_tiled(self, params: nnx.State, z: Array, *, tile_latent_min_size: int | None = None,
                     tile_sample_min_size: int | None = None, tile_overlap_factor: float = 0.25) -> Array:
        """``decode`` in overlapping tiles blended linearly, as diffusers' ``enable_tiling()`` decodes.

        Latents no larger than one tile are decoded whole (diffusers does the same). The tile layout
        depends only on the latent size and the tile arguments, so a jitted call compiles once per
        size; tiles of one shape go through a single ``lax.map`` (at most four decoders in the
        program, each run tile after tile, so the decoder's working memory is one tile's).
        """
        z = jnp.asarray(z).astype(self.dtype)
        tl, ts = self.tile_sizes(tile_latent_min_size, tile_sample_min_size)
        _, h, w, _ = z.shape
        if h <= tl and w <= tl:
            return self.decode(params, z)
        overlap = int(tl * (1 - tile_overlap_factor))
        blend = int(ts * tile_overlap_factor)
        limit = ts - blend
        if overlap <= 0 or not 0 <= tile_overlap_factor < 1:
            raise InvalidArgumentError(f"tile_overlap_factor {tile_overlap_factor} leaves no stride between "
                                       f"{tl}-pixel latent tiles; use a value in [0, 1)")
        rows_at, cols_at = list(range(0, h, overlap)), list(range(0, w, overlap))
        tiles = {(i, j): z[:, i:i + tl, j:j + tl] for i in rows_at for j in cols_at}  # (B, <=tl, <=tl, L)

        def decode_one(t: Array) -> Array:
            return self._model(params).decode(t)

        decoded: dict[tuple[int, int], Array] = {}
        by_shape: dict[tuple[int, ...], list[tuple[int, int]]] = {}
        for pos, tile in tiles.items():
            by_shape.setdefault(tuple(tile.shape), []).append(pos)
        for positions in by_shape.values():
            stack = jnp.stack([tiles[p] for p in positions])  # (N, B, th, tw, L)
            out = jax.lax.map(decode_one, stack)  # (N, B, th*f, tw*f, C)
            for k, p in enumerate(positions):
                decoded[p] = out[k]

        # Blend in diffusers' order; like its in-place edits, each blended tile replaces the original.
        rows = [[decoded[(i, j)] for j in cols_at] for i in rows_at]
        result_rows = []
        for r, row in enumerate(rows):
            pieces = []
            for c, tile in enumerate(row):
                if r > 0:
                    tile = _blend(rows[r - 1][c], tile, blend, axis=1)
                if c > 0:
                    tile = _blend(row[c - 1], tile, blend, axis=2)
                row[c] = tile
                pieces.append(tile[:, :limit, :limit])
            result_rows.append(jnp.concatenate(pieces, axis=2))
        return jnp.concatenate(result_rows, axis=1)


# ----------------------------------------------------------------------------------------------
# Loading


def resolve_vae_dir(path: str | Path) -> Path:
    """The folder holding the VAE's config.json, from a VAE folder or a pipeline folder (``vae/``)."""
    p = Path(path).expanduser()
    if not p.is_dir():
        raise ModelNotFoundError(f"model path {p} {'is not a folder' if p.exists() else 'does not exist'}")
    if (p / "model_index.json").is_file() or (p / "vae").is_dir():
        p = p / "vae"
        if not p.is_dir():
            raise ModelNotFoundError(f"pipeline folder {p.parent} has no vae/ folder")
    if not (p / "config.json").is_file():
        raise ModelNotFoundError(f"{p} has no config.json (expected a diffusers AutoencoderKL folder)")
    return p


def read_vae_config(vae_dir: Path) -> AutoencoderKLConfig:
    path = vae_dir / "config.json"
    return AutoencoderKLConfig.from_dict(read_json(path), str(path))


def build_abstract(config: AutoencoderKLConfig) -> tuple[nnx.GraphDef, nnx.State]:
    """Graph definition and a State of ShapeDtypeStructs (weights and LatentStat); no FLOPs, no memory."""
    return weights.build_abstract(lambda rngs: AutoencoderKL(config, rngs=rngs))


def effective_dtype(config: AutoencoderKLConfig, dtype: Any) -> jnp.dtype:
    """float32 where ``force_upcast`` overrides a half dtype (SDXL's VAE overflows in fp16), else ``dtype``."""
    dt = check_dtype(dtype)
    if config.force_upcast and dt in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)):
        return jnp.dtype(jnp.float32)
    return dt


def load_vae(folder: str | Path, dtype: Any = jnp.float32, variant: str | None = None,
             options: LoadOptions | None = None) -> VAE:
    """Load a diffusers AutoencoderKL folder (or a pipeline folder's ``vae/``) into JAX.

    ``variant="fp16"`` reads ``diffusion_pytorch_model.fp16.safetensors`` (or its shard index).
    Old attention names (``query``/``key``/``value``/``proj_attn``) are renamed on load.
    """
    check_dtype(dtype)
    vae_dir = resolve_vae_dir(folder)
    config = read_vae_config(vae_dir)
    dt = effective_dtype(config, dtype)
    graphdef, abstract = build_abstract(config)
    weight_abstract, stat_abstract = nnx.split_state(abstract, nnx.Param, LatentStat)
    tensors = read_tensors(weight_files(vae_dir, (DIFFUSERS_STEM,), variant), rename=legacy_unet_key)
    filled = fill(weight_abstract, tensors, dt, str(vae_dir), options=options)
    scale, shift = config.latent_affine()
    stats = nnx.from_flat_state([
        (path, var.replace(jnp.asarray(scale if str(path[-1]) == "latent_scale" else shift)))
        for path, var in nnx.to_flat_state(stat_abstract)
    ])
    return VAE(config=config, graphdef=graphdef, params=nnx.merge_state(filled, stats), dtype=dt)
