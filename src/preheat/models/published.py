"""Which published model a single file is, from its tensor names and shapes alone.

    infer_file(path)   -> Published   (headers only: no tensor is read)
    infer(shapes)      -> Published   ({name: shape}, e.g. a file's header)
    config_folder(p)   -> Path        the published component configs preheat ships for p

``preheat.load("model.safetensors")`` with no ``config=`` asks this which model the file holds, as
diffusers' ``from_single_file`` does, by the tensors each original layout is known to hold and the
shapes that tell the published models apart:

    SD 1.5           LDM UNet, cross-attention width 768, 4 input channels
    SD 2.1           LDM UNet, cross-attention width 1024 (the 768 px v-prediction model)
    SDXL base 1.0    SGM: OpenCLIP bigG under conditioner.embedders.1.model.*, label_emb of 2816
    SD3 medium       MMDiT (joint_blocks.*): 24 blocks of 1536, pos_embed of 192 x 192
    SD3.5 medium     24 blocks of 1536, pos_embed of 384 x 384, dual attention (x_block.attn2)
    SD3.5 large      38 blocks of 2432
    FLUX.1 schnell   BFL (double_blocks.*): 19 double and 38 single blocks of 3072, no guidance_in
    FLUX.1 dev       the same with guidance_in.*

Transformer names may sit under ComfyUI's ``model.diffusion_model.``. A file that is none of these
(an inpainting UNet, an SDXL refiner, FLUX.1 Fill, another width) is one ``ModelFormatError``
naming every model tried.

The published configs (``model_index.json`` and each component's ``config.json`` /
``scheduler_config.json``, as diffusers publishes them) ship under
``preheat/assets/single_file_configs/<name>/``. Their tokenizer files are too large to ship, so a
load still needs a folder that has them: ``config=`` a whole diffusers folder, or a folder holding
only the tokenizer folders the model's ``model_index.json`` names (``tokenizer/``, ``tokenizer_2/``,
...), which ``with_tokenizers`` puts beside the shipped configs. Without either, the one-line error
names the model inferred and its published repository.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Mapping, NamedTuple

from preheat.errors import InvalidArgumentError, ModelFormatError

__all__ = ["Published", "PUBLISHED", "infer", "infer_file", "config_folder", "with_tokenizers", "CONFIGS"]

CONFIGS = Path(__file__).resolve().parent.parent / "assets" / "single_file_configs"
Shapes = Mapping[str, tuple[int, ...]]
_UNET = "model.diffusion_model."


class Published(NamedTuple):
    """One published model a single file may be."""

    name: str  # its folder of configs under CONFIGS
    title: str  # as people call it
    repo: str  # the published diffusers repository (hf://<repo>)
    layout: str  # the single file's original layout (preheat.models.single_file.LAYOUTS; mmdit: SD3's)
    signs: str  # what in the file tells it apart (named in the error for an unknown file)
    fits: Callable[[Shapes], bool]


def _dm(shapes: Shapes, key: str) -> tuple[int, ...] | None:
    """A transformer tensor's shape, bare or under ComfyUI's ``model.diffusion_model.``."""
    return shapes.get(key) or shapes.get(_UNET + key)


def _count(shapes: Shapes, block: str) -> int:
    """How many ``<block>.N.`` blocks the file holds (bare or prefixed)."""
    pattern = re.compile(rf"^(?:{re.escape(_UNET)})?{re.escape(block)}\.(\d+)\.")
    return len({m[1] for k in shapes if (m := pattern.match(k))})


def _ldm_unet(shapes: Shapes, context: int) -> bool:
    """An LDM UNet (SD 1.x/2.x) of 4 input channels whose cross-attention reads ``context`` wide tokens."""
    to_k = shapes.get(_UNET + "input_blocks.1.1.transformer_blocks.0.attn2.to_k.weight")
    conv_in = shapes.get(_UNET + "input_blocks.0.0.weight")
    return (to_k == (320, context) and conv_in is not None and conv_in[1] == 4
            and not any(k.startswith("conditioner.") for k in shapes))


def _sdxl(shapes: Shapes) -> bool:
    label = shapes.get(_UNET + "label_emb.0.0.weight")
    conv_in = shapes.get(_UNET + "input_blocks.0.0.weight")
    return (label == (1280, 2816) and conv_in is not None and conv_in[1] == 4
            and any(k.startswith("conditioner.embedders.1.model.") for k in shapes))


def _mmdit(shapes: Shapes, blocks: int, width: int, positions: int, dual: bool) -> bool:
    x = _dm(shapes, "x_embedder.proj.weight")
    pos = _dm(shapes, "pos_embed")
    return (_count(shapes, "joint_blocks") == blocks and x is not None and x[:2] == (width, 16)
            and pos is not None and pos[1] == positions
            and (_dm(shapes, "joint_blocks.0.x_block.attn2.qkv.weight") is not None) == dual)


def _flux(shapes: Shapes, guidance: bool) -> bool:
    return (_dm(shapes, "img_in.weight") == (3072, 64) and _count(shapes, "double_blocks") == 19
            and _count(shapes, "single_blocks") == 38
            and (_dm(shapes, "guidance_in.in_layer.weight") is not None) == guidance)


PUBLISHED: tuple[Published, ...] = (
    Published("stable-diffusion-v1-5", "SD 1.5", "stable-diffusion-v1-5/stable-diffusion-v1-5", "ldm",
              "LDM UNet, attn2.to_k (320, 768)", lambda s: _ldm_unet(s, 768)),
    Published("stable-diffusion-2-1", "SD 2.1 (768 px, v-prediction)", "stabilityai/stable-diffusion-2-1", "ldm",
              "LDM UNet, attn2.to_k (320, 1024)", lambda s: _ldm_unet(s, 1024)),
    Published("stable-diffusion-xl-base-1.0", "SDXL base 1.0", "stabilityai/stable-diffusion-xl-base-1.0", "sgm",
              "SGM, conditioner.embedders.1.model.*, label_emb (1280, 2816)", _sdxl),
    Published("stable-diffusion-3-medium", "SD3 medium", "stabilityai/stable-diffusion-3-medium-diffusers", "mmdit",
              "24 joint_blocks of 1536, pos_embed 36864", lambda s: _mmdit(s, 24, 1536, 36864, False)),
    Published("stable-diffusion-3.5-medium", "SD3.5 medium", "stabilityai/stable-diffusion-3.5-medium", "mmdit",
              "24 joint_blocks of 1536 with x_block.attn2, pos_embed 147456",
              lambda s: _mmdit(s, 24, 1536, 147456, True)),
    Published("stable-diffusion-3.5-large", "SD3.5 large", "stabilityai/stable-diffusion-3.5-large", "mmdit",
              "38 joint_blocks of 2432", lambda s: _mmdit(s, 38, 2432, 36864, False)),
    Published("FLUX.1-schnell", "FLUX.1 schnell", "black-forest-labs/FLUX.1-schnell", "bfl",
              "19 double_blocks, 38 single_blocks, img_in (3072, 64), no guidance_in",
              lambda s: _flux(s, False)),
    Published("FLUX.1-dev", "FLUX.1 dev", "black-forest-labs/FLUX.1-dev", "bfl",
              "the same with guidance_in", lambda s: _flux(s, True)),
)


def infer(shapes: Shapes, source: str = "the single file") -> Published:
    """The published model whose tensors ``shapes`` ({name: shape}) are; a one-line
    ``ModelFormatError`` naming every model tried (and a few of the file's keys) otherwise."""
    shapes = {k: tuple(v) for k, v in shapes.items()}
    for published in PUBLISHED:
        if published.fits(shapes):
            return published
    tried = "; ".join(f"{p.title} ({p.signs})" for p in PUBLISHED)
    seen = ", ".join(sorted(shapes)[:4]) or "no tensors"
    raise ModelFormatError(f"{source}: cannot tell which published model this single file is (pass config=<its "
                           f"diffusers folder>): tried {tried}; its keys start {seen}")


def infer_file(path: str | Path) -> Published:
    """``infer`` on a safetensors file's header (no tensor is read; a torn file is one line)."""
    from preheat.models.weights import read_header

    return infer({k: info.shape for k, info in read_header(Path(path)).items()}, str(path))


def config_folder(published: Published) -> Path:
    """The shipped configs of ``published`` (model_index.json and each component's config)."""
    return CONFIGS / published.name


def _holds(keys: list[str], layout: str) -> tuple[str, ...]:
    """The diffusers components a single file of ``layout`` with tensors ``keys`` fills (its
    weights): a FLUX.1 or SD3 transformer file only the transformer, a ComfyUI bundle its VAE and
    text encoders too."""
    from preheat.models.single_file import LAYOUTS, held_components

    found = next((lay for lay in LAYOUTS if lay.name == layout), None)
    return ("transformer",) if found is None else held_components(keys, found)


def with_tokenizers(file: str | Path, tokenizers: str | Path, root: Path) -> Path:
    """A config folder for single ``file`` when ``config=`` is a folder of tokenizer folders only:
    the shipped configs of the model ``file`` is inferred to be, with ``tokenizers``' folders
    beside them (kept under ``<root>/models/single-configs/``, named by their content). One line
    names the model when a tokenizer folder is missing, or when the file does not hold every
    component's weights (a FLUX.1 or SD3 transformer file: the VAE and text encoders are not in it)."""
    from preheat.models.weights import read_header

    header = read_header(Path(file))  # read once: which model, and which components it holds
    published = infer({k: info.shape for k, info in header.items()}, str(file))
    tokenizers = Path(tokenizers)
    shipped = config_folder(published)
    index = json.loads((shipped / "model_index.json").read_text())
    named = sorted(k for k, v in index.items() if isinstance(v, list) and None not in v and not k.startswith("_"))
    wanted = [k for k in named if k.startswith("tokenizer")]
    hint = f"a {published.title} diffusers folder, e.g. hf://{published.repo}"
    missing = [k for k in wanted if not (tokenizers / k).is_dir()]
    if missing:
        raise InvalidArgumentError(f"{file} is a {published.title} single file; config={tokenizers} has no "
                                   f"{', '.join(m + '/' for m in missing)}: pass a folder with "
                                   f"{', '.join(k + '/' for k in wanted)}, or {hint}", argument="config")
    weights = [k for k in named if k not in wanted and k not in ("scheduler", "feature_extractor", "safety_checker")]
    elsewhere = [k for k in weights if k not in _holds(list(header), published.layout)]
    if elsewhere:
        raise InvalidArgumentError(f"{file} is a {published.title} single file ({published.layout} layout) without "
                                   f"the weights of {', '.join(elsewhere)}: pass config=<{hint}>", argument="config")
    h = hashlib.sha256(published.name.encode())
    for p in sorted(q for k in wanted for q in (tokenizers / k).rglob("*") if q.is_file()):
        h.update(p.relative_to(tokenizers).as_posix().encode() + b"\0" + p.read_bytes())
    out = root / "models" / "single-configs" / f"{published.name}-{h.hexdigest()[:16]}"
    if (out / "model_index.json").is_file():
        return out
    from preheat.files import publish_folder

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=out.parent))
    try:
        shutil.copytree(shipped, tmp, dirs_exist_ok=True)
        for k in wanted:
            shutil.copytree(tokenizers / k, tmp / k)
        publish_folder(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
