"""Diffusers' ``ControlNetModel`` (SD 1.x / 2.x and SDXL ControlNets) in JAX (Flax NNX).

A ControlNet is a copy of the UNet's down half -- ``conv_in``, the time embedding (SDXL's
"text_time" addition too), the down blocks and the mid block -- fed the latent sample *plus* a
small conv stack's embedding of a control image (an edge map, a depth map, a pose), and read out
through one 1x1 "zero" conv per skip connection and one after the mid block::

    control (B, H, W, 3) in [0, 1] --controlnet_cond_embedding--> (B, h, w, C0)   h = H / 2^(k-1)
    sample (B, h, w, Cin) --conv_in--> + that --down blocks, mid block--> skips, mid
    skips[i] --controlnet_down_blocks[i]--> down residual i     mid --controlnet_mid_block--> mid residual

Each residual is multiplied by ``conditioning_scale`` (data: a scalar, one per image, or one per
image and residual) and added to the UNet's own skips and mid block output
(``UNet2DConditionModule(..., residuals=...)``). Guess mode's scales are data too
(:func:`residual_scales`: diffusers' ramp from 0.1 at the first skip to 1 at the mid block).
The down half is the UNet's own code (``unet2d_condition.DownHalf``), not a copy; its names are
diffusers', so a parameter path is its checkpoint key, as everywhere in ``preheat.models``.
``global_pool_conditions`` (the shuffle ControlNet) averages each residual over the image.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from preheat.errors import InvalidArgumentError, ModelNotFoundError, UnsupportedConfigError
from preheat.models import weights
from preheat.models.config import JsonConfig
from preheat.models.layers import Conv2d
from preheat.models.safetensors_files import DIFFUSERS_STEM, read_json, read_tensors, weight_files
from preheat.models.stacking import scanned, stack
from preheat.models.storage import layerwise, upcast
from preheat.models.unet2d_condition import DownHalf, Residuals, UNet2DConditionConfig, check_unet_inputs
from preheat.models.weights import LoadOptions, check_dtype, fill

__all__ = ["ControlNetConfig", "ControlNetModule", "LoadedControlNet", "Residuals", "skip_widths",
           "residual_scales", "resolve_controlnet_dir", "read_controlnet_config", "load_controlnet", "build_abstract"]

Array = jax.Array

# The up half's block for each down block: a ControlNet has no up half, but its config is checked
# by the UNet's own rules, which want one (mirrored, as a UNet of the same down half would have).
_UP_OF = {"CrossAttnDownBlock2D": "CrossAttnUpBlock2D", "DownBlock2D": "UpBlock2D"}
# Keys a ControlNet config shares with a UNet2DConditionModel's (same meaning, same defaults)
_SHARED = ("in_channels", "flip_sin_to_cos", "freq_shift", "down_block_types", "mid_block_type",
           "only_cross_attention", "block_out_channels", "layers_per_block", "downsample_padding",
           "mid_block_scale_factor", "act_fn", "norm_num_groups", "norm_eps", "cross_attention_dim",
           "transformer_layers_per_block", "encoder_hid_dim", "encoder_hid_dim_type", "attention_head_dim",
           "num_attention_heads", "use_linear_projection", "class_embed_type", "addition_embed_type",
           "addition_time_embed_dim", "num_class_embeds", "upcast_attention", "resnet_time_scale_shift",
           "projection_class_embeddings_input_dim", "addition_embed_type_num_heads")


@dataclass(frozen=True)
class ControlNetConfig(JsonConfig):
    """diffusers' ``ControlNetModel`` config (same names, same defaults); the down half's keys mean
    what a UNet's do and are checked by its rules (:meth:`unet_config`)."""

    in_channels: int = 4
    conditioning_channels: int = 3  # the control image's channels
    flip_sin_to_cos: bool = True
    freq_shift: int = 0
    down_block_types: tuple[str, ...] = ("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D",
                                         "DownBlock2D")
    mid_block_type: str | None = "UNetMidBlock2DCrossAttn"
    only_cross_attention: bool | tuple[bool, ...] = False
    block_out_channels: tuple[int, ...] = (320, 640, 1280, 1280)
    layers_per_block: int = 2  # one int: diffusers' ControlNetModel takes no per-block list
    downsample_padding: int = 1
    mid_block_scale_factor: float = 1.0
    act_fn: str = "silu"
    norm_num_groups: int | None = 32
    norm_eps: float = 1e-5
    cross_attention_dim: int = 1280
    transformer_layers_per_block: int | tuple[int, ...] = 1
    encoder_hid_dim: int | None = None
    encoder_hid_dim_type: str | None = None
    attention_head_dim: int | tuple[int, ...] = 8
    num_attention_heads: int | tuple[int, ...] | None = None
    use_linear_projection: bool = False
    class_embed_type: str | None = None
    addition_embed_type: str | None = None  # "text_time": an SDXL ControlNet
    addition_time_embed_dim: int | None = None
    num_class_embeds: int | None = None
    upcast_attention: bool | None = False
    resnet_time_scale_shift: str = "default"
    projection_class_embeddings_input_dim: int | None = None
    controlnet_conditioning_channel_order: str = "rgb"  # "bgr": the control image's channels are flipped first
    conditioning_embedding_out_channels: tuple[int, ...] = (16, 32, 96, 256)  # the control image's conv stack
    global_pool_conditions: bool = False  # each residual averaged over the image (diffusers then runs guess mode)
    addition_embed_type_num_heads: int = 64  # used only by addition_embed_type "text" (unsupported)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], source: str = "config.json") -> "ControlNetConfig":
        return cls.from_checked_dict(raw, source, "ControlNetModel")

    def unet_config(self) -> UNet2DConditionConfig:
        """The UNet config of the same down half (its up half mirrored): what builds and checks it."""
        shared = {name: getattr(self, name) for name in _SHARED}
        up = tuple(_UP_OF.get(b, b) for b in reversed(self.down_block_types))
        return UNet2DConditionConfig(**shared, up_block_types=up)

    @property
    def downscale(self) -> int:
        """Pixels of the control image per latent: 2 per stride-2 conv of its embedding."""
        return 2 ** (len(self.conditioning_embedding_out_channels) - 1)

    def architecture_dict(self) -> dict[str, Any]:
        """The fields that change the program (for cache keys): all of them."""
        return self.to_dict()

    def validate(self, source: str = "config") -> None:
        if self.mid_block_type != "UNetMidBlock2DCrossAttn":
            raise UnsupportedConfigError(f"unsupported ControlNetModel mid_block_type {self.mid_block_type!r} in "
                                         f"{source}; supported: 'UNetMidBlock2DCrossAttn'")
        if not isinstance(self.layers_per_block, int) or isinstance(self.layers_per_block, bool):
            raise UnsupportedConfigError(f"ControlNetModel layers_per_block must be one int in {source}, "
                                         f"got {self.layers_per_block!r}")
        if self.controlnet_conditioning_channel_order not in ("rgb", "bgr"):
            raise UnsupportedConfigError(
                f"unsupported controlnet_conditioning_channel_order {self.controlnet_conditioning_channel_order!r} "
                f"in {source}; supported: 'rgb', 'bgr'")
        channels = self.conditioning_embedding_out_channels
        if not channels or any(not isinstance(c, int) or c <= 0 for c in channels):
            raise UnsupportedConfigError(f"conditioning_embedding_out_channels must be positive ints in {source}, "
                                         f"got {channels!r}")
        self.unet_config().validate(source)


def skip_widths(unet: UNet2DConditionConfig) -> tuple[int, ...]:
    """The channels of each skip a UNet's down half keeps (conv_in's, each resnet's, each
    downsampler's): what a ControlNet's residuals must match, one for one."""
    chans, n = unet.block_out_channels, len(unet.block_out_channels)
    widths = [chans[0]]
    for i, (ch, layers) in enumerate(zip(chans, unet.layers)):
        widths += [ch] * (layers + (1 if i < n - 1 else 0))
    return tuple(widths)


def residual_scales(config: ControlNetConfig, guess_mode: bool = False) -> np.ndarray:
    """(K,) float32: each residual's factor beside the conditioning scale (the down residuals, then
    the mid block's). Guess mode: diffusers' ``torch.logspace(-1, 0, K)``, 0.1 at the first skip to
    1 at the mid block, so the coarse residuals steer most; 1s otherwise, and for a
    ``global_pool_conditions`` ControlNet, which diffusers leaves unramped in guess mode too."""
    k = len(skip_widths(config.unet_config())) + 1
    if not guess_mode or config.global_pool_conditions:
        return np.ones((k,), np.float32)
    return np.logspace(-1, 0, k).astype(np.float32)  # equal to torch's float32 logspace


class ControlNetConditioningEmbedding(nnx.Module):
    """The control image's conv stack: conv_in, then per level a 3x3 conv and a stride-2 3x3 conv,
    SiLU after each, then conv_out to the UNet's first width (zero-initialised when trained)."""

    def __init__(self, cin: int, channels: tuple[int, ...], cout: int, *, rngs: nnx.Rngs):
        self.conv_in = Conv2d(cin, channels[0], 3, padding=1, rngs=rngs)
        blocks = []
        for a, b in zip(channels[:-1], channels[1:]):
            blocks += [Conv2d(a, a, 3, padding=1, rngs=rngs), Conv2d(a, b, 3, stride=2, padding=1, rngs=rngs)]
        self.blocks = nnx.List(blocks)
        self.conv_out = Conv2d(channels[-1], cout, 3, padding=1, rngs=rngs)

    def __call__(self, x: Array) -> Array:  # (B, H, W, Ccond) -> (B, H / 2^(k-1), W / 2^(k-1), C0)
        x = jax.nn.silu(self.conv_in(x))
        for block in self.blocks:
            x = jax.nn.silu(block(x))
        return self.conv_out(x)


class ControlNetModule(DownHalf):
    """diffusers' ``ControlNetModel`` as a Flax NNX module (NHWC); ``LoadedControlNet`` wraps it."""

    def __init__(self, config: ControlNetConfig, *, rngs: nnx.Rngs, stacked: bool = False):
        """``stacked``: the serving form, deep transformer stages scanned (``preheat.models.stacking``)."""
        config.validate()
        self.config = config
        self.down_config = u = config.unet_config()
        self.build_down_half(u, rngs, stacked)
        chans = u.block_out_channels
        self.controlnet_cond_embedding = ControlNetConditioningEmbedding(
            config.conditioning_channels, config.conditioning_embedding_out_channels, chans[0], rngs=rngs)
        widths = skip_widths(u)  # one 1x1 conv per skip the down half keeps
        self.controlnet_down_blocks = nnx.List([Conv2d(w, w, 1, rngs=rngs) for w in widths])
        self.controlnet_mid_block = Conv2d(chans[-1], chans[-1], 1, rngs=rngs)

    def check_inputs(self, x: Array, control: Array) -> None:
        """Shapes are static under jit: a control image the sample's size does not fit is one line at trace time."""
        c = self.config
        if control.ndim != 4 or control.shape[0] != x.shape[0] or control.shape[-1] != c.conditioning_channels:
            raise InvalidArgumentError(f"controlnet_cond must be ({x.shape[0]}, H, W, {c.conditioning_channels}) "
                                       f"NHWC, got shape {tuple(control.shape)}")
        want = (x.shape[1] * c.downscale, x.shape[2] * c.downscale)
        if tuple(control.shape[1:3]) != want:
            raise InvalidArgumentError(f"the control image is {control.shape[2]}x{control.shape[1]} but this "
                                       f"ControlNet needs {want[1]}x{want[0]} for a {x.shape[2]}x{x.shape[1]} sample")

    def __call__(self, x: Array, t: Array, context: Array, control: Array, scale: Any = 1.0,
                 added: Mapping[str, Array] | None = None) -> Residuals:
        """(B, h, w, Cin) sample, (B,) timesteps, (B, L, D) text states, (B, H, W, 3) control image in
        [0, 1], scale () or (B,) or (B, K) (one per residual: down, then mid), SDXL's added ids ->
        the residuals, each times its scale (then pooled, with ``global_pool_conditions``)."""
        u = self.down_config
        check_unet_inputs(u, x, t, context, added)
        self.check_inputs(x, control)
        dtype = x.dtype
        b = x.shape[0]
        if self.config.controlnet_conditioning_channel_order == "bgr":
            control = control[..., ::-1]
        emb = self.embed(u, t, added, b, dtype)  # (B, T)
        h = self.conv_in(x) + self.controlnet_cond_embedding(control.astype(dtype))  # (B, h, w, C0)
        h, skips = self.down_half(h, emb, context.astype(dtype))
        k = len(skips) + 1
        s = jnp.asarray(scale, dtype)
        s = jnp.broadcast_to(s[:, None] if s.ndim == 1 else s, (b, k)).reshape(b, k, 1, 1, 1)  # (B, K, 1, 1, 1)
        down = tuple(conv(skip) * s[:, i] for i, (conv, skip) in enumerate(zip(self.controlnet_down_blocks, skips)))
        mid = self.controlnet_mid_block(h) * s[:, -1]
        if self.config.global_pool_conditions:  # (B, 1, 1, C) each: added everywhere in the UNet's maps
            down = tuple(jnp.mean(r, axis=(1, 2), keepdims=True) for r in down)
            mid = jnp.mean(mid, axis=(1, 2), keepdims=True)
        return Residuals(down=down, mid=mid)


def resolve_controlnet_dir(folder: str | Path) -> Path:
    """The folder holding a ControlNet's config.json: the folder itself, or a pipeline folder's ``controlnet/``."""
    if "://" in str(folder):
        raise ModelNotFoundError(f"controlnet={folder}: a ControlNet is read from a local folder; store sources "
                                 "(hf://, http(s)://) are not supported for it yet (preheat pull it, then pass the "
                                 "folder)")
    p = Path(folder).expanduser()
    if not p.is_dir():
        raise ModelNotFoundError(f"ControlNet path {p} is not a folder (expected a diffusers ControlNetModel folder)")
    for candidate in (p, p / "controlnet"):
        if (candidate / "config.json").is_file():
            return candidate
    raise ModelNotFoundError(f"{p} has no config.json (expected a diffusers ControlNetModel folder)")


def read_controlnet_config(folder: Path) -> ControlNetConfig:
    return ControlNetConfig.from_dict(read_json(folder / "config.json"), str(folder / "config.json"))


def build_abstract(config: ControlNetConfig, stacked: bool = False) -> tuple[nnx.GraphDef, nnx.State]:
    """Graph definition and a State of ShapeDtypeStructs; costs no FLOPs and no memory.
    ``stacked``: the serving form (``preheat.models.stacking``); the default is the checkpoint's."""
    return weights.build_abstract(lambda rngs: ControlNetModule(config, rngs=rngs, stacked=stacked))


@dataclass
class LoadedControlNet:
    """A loaded ControlNet: ``apply`` is the pure NHWC function the denoising program calls (the
    weights an argument); ``__call__`` mirrors diffusers' NCHW ``forward``."""

    config: ControlNetConfig
    graphdef: nnx.GraphDef
    params: nnx.State
    dtype: Any = jnp.float32

    def apply(self, params: nnx.State, x: Array, t: Array, context: Array, control: Array, scale: Any = 1.0,
              added: Mapping[str, Array] | None = None) -> Residuals:
        """(B, h, w, C), (B,), (B, L, D), (B, H, W, 3) in [0, 1], () or (B,) or (B, K) -> Residuals (NHWC)."""
        model = nnx.merge(self.graphdef, upcast(params, self.dtype, tie=x))  # fp8-stored weights upcast here
        return model(x, t, context, control, scale, added)

    def __call__(self, sample: Any, timestep: Any, encoder_hidden_states: Any, controlnet_cond: Any,
                 conditioning_scale: Any = 1.0, added_cond_kwargs: Mapping[str, Any] | None = None,
                 guess_mode: bool = False) -> tuple[list[Array], Array]:
        """NCHW in, (down residuals, mid residual) NCHW out, as diffusers' ``return_dict=False``."""
        x = jnp.transpose(jnp.asarray(sample, self.dtype), (0, 2, 3, 1))  # NCHW -> NHWC
        control = jnp.transpose(jnp.asarray(controlnet_cond, self.dtype), (0, 2, 3, 1))
        added = None if added_cond_kwargs is None else {k: jnp.asarray(v) for k, v in added_cond_kwargs.items()}
        ramp = residual_scales(self.config, guess_mode)  # (K,): diffusers' forward(guess_mode=)
        scale = jnp.asarray(conditioning_scale, jnp.float32).reshape(-1, 1)  # (1, 1) or (B, 1)
        scale = jnp.broadcast_to(ramp[None] * scale, (x.shape[0], len(ramp)))  # (B, K)
        out = self.apply(self.params, x, jnp.asarray(timestep, jnp.float32),
                         jnp.asarray(encoder_hidden_states, self.dtype), control, scale, added)
        return ([jnp.transpose(r, (0, 3, 1, 2)) for r in out.down], jnp.transpose(out.mid, (0, 3, 1, 2)))


def load_controlnet(folder: str | Path, dtype: Any = jnp.float32, variant: str | None = None,
                    options: LoadOptions | None = None) -> LoadedControlNet:
    """Load a diffusers ControlNetModel folder (``config.json`` + safetensors; or a pipeline
    folder's ``controlnet/``) into JAX; the weights cast to ``dtype``."""
    dtype = check_dtype(dtype)
    cn_dir = resolve_controlnet_dir(folder)
    config = read_controlnet_config(cn_dir)
    graphdef, abstract = build_abstract(config)
    tensors = read_tensors(weight_files(cn_dir, (DIFFUSERS_STEM,), variant=variant))
    params = fill(abstract, tensors, dtype, str(cn_dir), options=options, low=layerwise(("norm",), options))
    if any(scanned(n) for n in config.unet_config().transformer_layers):  # weights stacked once, here
        graphdef, params = stack(lambda rngs: ControlNetModule(config, rngs=rngs, stacked=True), params, options)
    return LoadedControlNet(config=config, graphdef=graphdef, params=params, dtype=dtype)
