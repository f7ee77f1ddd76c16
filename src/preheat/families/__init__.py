"""Model families: which loader a diffusers folder gets, chosen from its ``_class_name``.

    _class_name (model_index.json, or a bare model's config.json)   family
    ----------------------------------------------------------------  ----------------------------
    DDPMPipeline, DDIMPipeline, (bare) UNet2DModel, preheat's digits   pixel (``families.pixel``)
    StableDiffusionPipeline                                            stable-diffusion (1.x, 2.x)
    StableDiffusionXLPipeline                                          stable-diffusion-xl
    StableDiffusion[XL]Img2ImgPipeline, ...InpaintPipeline (9-ch UNet) the same families, image in
    StableDiffusion3Pipeline                                           stable-diffusion-3 (3, 3.5)
    FluxPipeline                                                       flux (FLUX.1 schnell, dev)

Each family module has a ``load_<family>(root, *, scheduler, dtype, variant[, offload_encoders])`` that returns a
``LoadedModel`` (the engine builds its ``Pipeline`` from it); ``families.base`` says what a family
contributes to the engine. Families never import the engine: they see a pipeline through
``EngineView``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from preheat.errors import ModelNotFoundError, UnsupportedConfigError
from preheat.families.base import Conditioning, EngineView, Family, LoadedModel, Request, StageSignature

__all__ = ["Family", "Conditioning", "EngineView", "LoadedModel", "Request", "StageSignature", "family_loader",
           "FAMILY_OF_CLASS", "class_name_of", "declared_families"]

# _class_name -> (module, loader function)
FAMILY_OF_CLASS: dict[str, tuple[str, str]] = {
    "UNet2DModel": ("preheat.families.pixel", "load_pixel"),
    "DDPMPipeline": ("preheat.families.pixel", "load_pixel"),
    "DDIMPipeline": ("preheat.families.pixel", "load_pixel"),
    "StableDiffusionPipeline": ("preheat.families.stable_diffusion", "load_stable_diffusion"),
    "StableDiffusionXLPipeline": ("preheat.families.stable_diffusion", "load_stable_diffusion_xl"),
    # the same folders saved by the image pipelines; an inpainting one has a 9-channel UNet
    "StableDiffusionImg2ImgPipeline": ("preheat.families.stable_diffusion", "load_stable_diffusion"),
    "StableDiffusionInpaintPipeline": ("preheat.families.stable_diffusion", "load_stable_diffusion"),
    "StableDiffusionXLImg2ImgPipeline": ("preheat.families.stable_diffusion", "load_stable_diffusion_xl"),
    "StableDiffusionXLInpaintPipeline": ("preheat.families.stable_diffusion", "load_stable_diffusion_xl"),
    "StableDiffusion3Pipeline": ("preheat.families.sd3", "load_stable_diffusion_3"),
    "FluxPipeline": ("preheat.families.flux", "load_flux"),
}


def class_name_of(root: Path) -> str:
    """The ``_class_name`` that picks a folder's family (pipeline index first, then a bare model)."""
    from preheat.models.weights import read_json

    root = Path(root).expanduser()
    if not root.exists():
        raise ModelNotFoundError(f"model path {root} does not exist")
    if not root.is_dir():
        raise ModelNotFoundError(f"model path {root} is not a folder (expected a diffusers-format folder)")
    index = root / "model_index.json"
    if index.is_file():
        raw = read_json(index, "pipeline index")
        name = raw.get("_class_name")
        if name is None and (root / "unet").is_dir():  # preheat's own folders before _class_name was written
            return "UNet2DModel"
        return str(name)
    if (root / "unet").is_dir():
        root = root / "unet"
    config = root / "config.json"
    if not config.is_file():
        raise ModelNotFoundError(f"{root} has no model_index.json or config.json (expected a diffusers-format folder)")
    return str(read_json(config).get("_class_name", "UNet2DModel"))


def family_loader(root: Path) -> Callable[..., Any]:
    """The loader for the folder's family, or a one-line error naming the supported classes."""
    import importlib

    name = class_name_of(root)
    if name not in FAMILY_OF_CLASS:
        raise UnsupportedConfigError(
            f"unsupported model class {name!r} in {root}; supported: {', '.join(sorted(FAMILY_OF_CLASS))}")
    module, attr = FAMILY_OF_CLASS[name]
    return getattr(importlib.import_module(module), attr)


def declared_families() -> list[Family]:
    """Every family instance the modules of ``FAMILY_OF_CLASS`` define (imports them all: for
    help texts and schemas that list every family's inputs, never on a call's path)."""
    import importlib

    found: list[Family] = []
    for module in dict.fromkeys(m for m, _ in FAMILY_OF_CLASS.values()):
        for value in vars(importlib.import_module(module)).values():
            if isinstance(value, Family) and all(value is not f for f in found):
                found.append(value)
    return found
