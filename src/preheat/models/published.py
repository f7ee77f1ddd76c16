"""Which published model a single file is, from its tensor names and shapes alone.

    infer_file(path)   -> Published   (headers only: no tensor is read; safetensors or GGUF)
    infer(shapes)      -> Published   ({name: shape}, e.g. a file's header)
    config_folder(p)   -> Path        the published component configs preheat ships for p

``preheat.load("model.safetensors")`` with no ``config=`` asks this which model the file holds, as
diffusers' ``from_single_file`` does, by the tensors each original layout is known to hold and the
shapes that tell the published models apart:

    SD 1.5           LDM UNet, cross-attention width 768, 4 input channels
    SD 2.1           LDM UNet, cross-attention width 1024 (the 768 px v-prediction model)
    SD 2.1 base      the same tensors (512 px, epsilon): never inferred, chosen by name (below)
    SDXL base 1.0    SGM: OpenCLIP bigG under conditioner.embedders.1.model.*, label_emb of 2816
    SDXL refiner 1.0 SGM: OpenCLIP bigG alone, under conditioner.embedders.0.model.*, label_emb of 2560
                     into 1536 (384 model channels)
    SD3 medium       MMDiT (joint_blocks.*): 24 blocks of 1536, pos_embed of 192 x 192
    SD3.5 medium     24 blocks of 1536, pos_embed of 384 x 384, dual attention (x_block.attn2)
    SD3.5 large      38 blocks of 2432
    FLUX.1 schnell   BFL (double_blocks.*): 19 double and 38 single blocks of 3072, no guidance_in
    FLUX.1 dev       the same with guidance_in.*

Transformer names may sit under ComfyUI's ``model.diffusion_model.``. A file that is none of these
(an inpainting UNet, FLUX.1 Fill, another width) is one ``ModelFormatError``
naming every model tried.

SD 2.x: the 512 px base model (epsilon) and the 768 px model (v-prediction) have the same tensor
names and shapes, and a safetensors file carries no training step to tell them apart (diffusers'
``from_single_file`` guesses from a ``.ckpt``'s ``global_step``; for safetensors it takes
stabilityai/stable-diffusion-2-1, the 768 px v-prediction model). preheat takes the same default,
and ``config="stable-diffusion-2-1-base"`` (a published name, its repository id, or
``hf://<repository>``: ``named``) picks the other.

The published configs (``model_index.json`` and each component's ``config.json`` /
``scheduler_config.json``, as diffusers publishes them) ship under
``preheat/assets/single_file_configs/<name>/``. What a file still lacks (``needed``) is its
tokenizer folders (too large to ship) and the weights of any component it does not hold (a
FLUX.1 transformer file: the VAE and text encoders). ``preheat.load`` fetches exactly those
folders from the published repository (``preheat.engine``, through the weights store), or takes
them from ``config=`` a folder holding them; ``with_components`` puts them beside the shipped
configs.
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

__all__ = ["Published", "PUBLISHED", "Needed", "infer", "infer_file", "file_shapes", "named", "needed", "config_folder",
           "with_components", "CONFIGS"]

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


def _sdxl_refiner(shapes: Shapes) -> bool:
    """The refiner's UNet (384 model channels, so a 1536-wide time embedding; 2560 = the pooled
    1280 + 5 ids x 256 into label_emb) with OpenCLIP bigG as its only text embedder."""
    label = shapes.get(_UNET + "label_emb.0.0.weight")
    conv_in = shapes.get(_UNET + "input_blocks.0.0.weight")
    return (label == (1536, 2560) and conv_in is not None and conv_in[:2] == (384, 4)
            and any(k.startswith("conditioner.embedders.0.model.") for k in shapes)
            and not any(k.startswith("conditioner.embedders.1.") for k in shapes))


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
    # the same tensors: infer() never reaches it (the entry above fits first); chosen by name only
    Published("stable-diffusion-2-1-base", "SD 2.1 base (512 px, epsilon)", "stabilityai/stable-diffusion-2-1-base",
              "ldm", "as SD 2.1: named only", lambda s: _ldm_unet(s, 1024)),
    Published("stable-diffusion-xl-base-1.0", "SDXL base 1.0", "stabilityai/stable-diffusion-xl-base-1.0", "sgm",
              "SGM, conditioner.embedders.1.model.*, label_emb (1280, 2816)", _sdxl),
    Published("stable-diffusion-xl-refiner-1.0", "SDXL refiner 1.0", "stabilityai/stable-diffusion-xl-refiner-1.0",
              "sgm-refiner", "SGM, conditioner.embedders.0.model.* alone, label_emb (1536, 2560)", _sdxl_refiner),
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


def file_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """{name: shape} of a single file's tensors from its header (no tensor is read; a torn file is
    one line): a safetensors file's, or a GGUF file's in torch's axis order (its stored tensors: a
    Q8_0 weight's shape is the weight's)."""
    from preheat.models.gguf_file import GGUFTensors, is_gguf
    from preheat.models.safetensors_files import read_header

    if is_gguf(path):
        return GGUFTensors(path).shapes()
    return {k: tuple(info.shape) for k, info in read_header(Path(path)).items()}


def infer_file(path: str | Path) -> Published:
    """``infer`` on a single file's header (``file_shapes``: safetensors or GGUF)."""
    return infer(file_shapes(path), str(path))


def config_folder(published: Published) -> Path:
    """The shipped configs of ``published`` (model_index.json and each component's config)."""
    return CONFIGS / published.name


def named(text: str | Path) -> Published | None:
    """The published model ``text`` names: its name here, its repository id or ``hf://<repository>``
    (``config="stable-diffusion-2-1-base"``); None for anything else (a folder, another repository)."""
    text = str(text).removeprefix("hf://").rstrip("/")
    return next((p for p in PUBLISHED if text in (p.name, p.repo)), None)


class Needed(NamedTuple):
    """What a single file of a published model needs besides itself: the component folders its
    published repository holds and the file does not."""

    published: Published
    tokenizers: tuple[str, ...]  # tokenizer folders: never in a single file, too large to ship
    weights: tuple[str, ...]  # components whose weights the file lacks (a FLUX.1 transformer file: VAE, text encoders)

    @property
    def components(self) -> tuple[str, ...]:
        return tuple(sorted(self.tokenizers + self.weights))

    @property
    def hint(self) -> str:
        return f"a {self.published.title} diffusers folder, e.g. hf://{self.published.repo}"


def needed(file: str | Path, as_model: Published | None = None) -> Needed:
    """What single ``file`` needs from its published repository (its header read once: no tensor).
    ``as_model``: the model the caller named (``named``), checked to fit; None: inferred."""
    shapes = file_shapes(file)  # the header read once: which model, and which components it holds
    published = infer(shapes, str(file)) if as_model is None else as_model
    if as_model is not None and not as_model.fits({k: tuple(v) for k, v in shapes.items()}):
        raise ModelFormatError(f"{file} is not a {as_model.title} single file (that model has {as_model.signs}); "
                               f"pass config=<its diffusers folder>")
    index = json.loads((config_folder(published) / "model_index.json").read_text())
    listed = sorted(k for k, v in index.items() if isinstance(v, list) and None not in v and not k.startswith("_"))
    tokenizers = tuple(k for k in listed if k.startswith("tokenizer"))
    held = _holds(list(shapes), published.layout)
    weights = tuple(k for k in listed if k not in tokenizers and k not in held
                    and k not in ("scheduler", "feature_extractor", "safety_checker"))
    return Needed(published, tokenizers, weights)


def _holds(keys: list[str], layout: str) -> tuple[str, ...]:
    """The diffusers components a single file of ``layout`` with tensors ``keys`` fills (its
    weights): a FLUX.1 or SD3 transformer file only the transformer, a ComfyUI bundle its VAE and
    text encoders too."""
    from preheat.models.single_file import LAYOUTS, held_components

    found = next((lay for lay in LAYOUTS if lay.name == layout), None)
    return ("transformer",) if found is None else held_components(keys, found)


_WEIGHTS = (".safetensors", ".bin")


def with_components(file: str | Path, folder: str | Path, root: Path, needs: Needed) -> Path:
    """A config folder for single ``file`` (``needs = needed(file)``): the shipped configs of its
    published model, with ``folder``'s copies of the components it lacks beside them (their weights
    linked, not copied), kept under ``<root>/models/single-configs/`` and named by their content.
    One line names the model when ``folder`` lacks a tokenizer folder, or the weights of a
    component the file does not hold (a FLUX.1 or SD3 transformer file: the VAE, text encoders)."""
    published, folder = needs.published, Path(folder)
    missing = [k for k in needs.tokenizers if not (folder / k).is_dir()]
    if missing:
        raise InvalidArgumentError(f"{file} is a {published.title} single file; config={folder} has no "
                                   f"{', '.join(m + '/' for m in missing)}: pass a folder with "
                                   f"{', '.join(k + '/' for k in needs.components)}, or {needs.hint}",
                                   argument="config")
    elsewhere = [k for k in needs.weights if not (folder / k).is_dir()]
    if elsewhere:
        raise InvalidArgumentError(f"{file} is a {published.title} single file ({published.layout} layout) without "
                                   f"the weights of {', '.join(elsewhere)}: pass config=<a folder with "
                                   f"{', '.join(k + '/' for k in needs.components)}, or {needs.hint}>",
                                   argument="config")
    files = sorted(q for k in needs.components for q in (folder / k).rglob("*") if q.is_file())
    h = hashlib.sha256(published.name.encode())
    for p in files:  # small files by content; weights by where they are (a store's blobs never change)
        st = p.stat()
        body = (f"{p.resolve()}\0{st.st_size}\0{st.st_mtime_ns}".encode() if p.name.endswith(_WEIGHTS)
                else p.read_bytes())
        h.update(p.relative_to(folder).as_posix().encode() + b"\0" + body)
    out = root / "models" / "single-configs" / f"{published.name}-{h.hexdigest()[:16]}"
    if (out / "model_index.json").is_file():
        return out
    from preheat.files import publish_folder, write_made_from

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=out.parent))
    try:
        shutil.copytree(config_folder(published), tmp, dirs_exist_ok=True)
        for p in files:  # the folder's configs of a component replace the shipped ones: they came with its weights
            dst = tmp / p.relative_to(folder)
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.unlink(missing_ok=True)
            if p.name.endswith(_WEIGHTS):
                dst.symlink_to(p.resolve())
            else:
                shutil.copyfile(p, dst)
        weights = [p for p in files if p.name.endswith(_WEIGHTS)]  # collected with them (store gc), stale once
        write_made_from(tmp, weights, contents=[p for p in files if not p.name.endswith(_WEIGHTS)],  # one is edited,
                        config_weights=weights)  # or one is deleted from the folder still there
        publish_folder(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
