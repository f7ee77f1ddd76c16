"""Model families: which loader a diffusers folder gets, chosen from its ``_class_name``.

    _class_name (model_index.json, or a bare model's config.json)   family
    ----------------------------------------------------------------  ----------------------------
    DDPMPipeline, DDIMPipeline, (bare) UNet2DModel, preheat's digits   pixel (``families.pixel``)
    StableDiffusionPipeline                                            stable-diffusion (1.x, 2.x)
    StableDiffusionXLPipeline                                          stable-diffusion-xl
    StableDiffusion[XL]Img2ImgPipeline, ...InpaintPipeline (9-ch UNet) the same families, image in
    StableDiffusionXLImg2ImgPipeline + requires_aesthetics_score       stable-diffusion-xl-refiner
    StableDiffusion3Pipeline                                           stable-diffusion-3 (3, 3.5)
    FluxPipeline                                                       flux (FLUX.1 schnell, dev)
    FluxKontextPipeline                                                flux-kontext (FLUX.1 Kontext dev)

Each family module has a ``load_<family>(root, *, scheduler, dtype, variant, options[, offload_encoders, encoders_on,
controlnet, refiner])`` that returns a ``LoadedModel`` (the engine builds its ``Pipeline`` from it); what it
takes in brackets its family declares (``Family.loader_takes``); ``families.base`` says what a family
contributes to the engine. Families never import the engine: they see a pipeline through
``EngineView``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional

from preheat.errors import ModelNotFoundError, UnsupportedConfigError
from preheat.families.base import Conditioning, EngineView, Family, LoadedModel, Request, StageSignature

__all__ = ["Family", "Conditioning", "EngineView", "LoadedModel", "Request", "StageSignature", "family_loader",
           "FamilyEntry", "Loader", "FAMILY_OF_CLASS", "class_name_of", "declared_families", "declared_family"]


class FamilyEntry(NamedTuple):
    """Where a ``_class_name``'s family lives."""

    module: str
    loader: str  # the module's load_<family> function
    family: str = ""  # the module's Family instance: the folder's declared inputs before any weight is read


_SD, _FLUX = "preheat.families.stable_diffusion", "preheat.families.flux"
FAMILY_OF_CLASS: dict[str, FamilyEntry] = {
    "UNet2DModel": FamilyEntry("preheat.families.pixel", "load_pixel", "PIXEL"),
    "DDPMPipeline": FamilyEntry("preheat.families.pixel", "load_pixel", "PIXEL"),
    "DDIMPipeline": FamilyEntry("preheat.families.pixel", "load_pixel", "PIXEL"),
    "StableDiffusionPipeline": FamilyEntry(_SD, "load_stable_diffusion", "SD"),
    "StableDiffusionXLPipeline": FamilyEntry(_SD, "load_stable_diffusion_xl", "SDXL"),
    # the same folders saved by the image pipelines; an inpainting one has a 9-channel UNet
    "StableDiffusionImg2ImgPipeline": FamilyEntry(_SD, "load_stable_diffusion", "SD"),
    "StableDiffusionInpaintPipeline": FamilyEntry(_SD, "load_stable_diffusion", "SD"),
    "StableDiffusionXLImg2ImgPipeline": FamilyEntry(_SD, "load_stable_diffusion_xl", "SDXL"),
    "StableDiffusionXLInpaintPipeline": FamilyEntry(_SD, "load_stable_diffusion_xl", "SDXL"),
    "StableDiffusion3Pipeline": FamilyEntry("preheat.families.sd3", "load_stable_diffusion_3", "SD3"),
    "FluxPipeline": FamilyEntry(_FLUX, "load_flux", "FLUX"),
    "FluxKontextPipeline": FamilyEntry("preheat.families.kontext", "load_flux_kontext", "KONTEXT"),
    "FluxFillPipeline": FamilyEntry("preheat.families.fill", "load_flux_fill", "FILL"),
}


def class_name_of(root: Path) -> str:
    """The ``_class_name`` that picks a folder's family (pipeline index first, then a bare model)."""
    from preheat.models.safetensors_files import read_json

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


class Loader(NamedTuple):
    """A folder's family loader and what it accepts beyond the common keywords, as its family
    declares it (``Family.loader_takes``; an entry naming no family instance: nothing)."""

    load: Callable[..., LoadedModel]
    takes: frozenset[str]


def _entry_of(root: Path) -> tuple[Any, FamilyEntry, Optional[Family]]:
    """The folder's family module (imported), its entry and the family instance the entry names
    (None: none), or a one-line error naming the supported classes."""
    import importlib

    name = class_name_of(root)
    if name not in FAMILY_OF_CLASS:
        raise UnsupportedConfigError(
            f"unsupported model class {name!r} in {root}; supported: {', '.join(sorted(FAMILY_OF_CLASS))}")
    entry = FAMILY_OF_CLASS[name]
    module = importlib.import_module(entry[0])
    family = getattr(module, entry[2]) if len(entry) > 2 and entry[2] else None
    return module, entry, family if isinstance(family, Family) else None


def family_loader(root: Path) -> Loader:
    """The loader for the folder's family, or a one-line error naming the supported classes."""
    module, entry, family = _entry_of(root)
    return Loader(getattr(module, entry[1]), frozenset() if family is None else family.loader_takes)


def declared_family(root: Path) -> Optional[Family]:
    """The folder's family as its module declares it and its configs refine it (``Family.for_folder``:
    an SDXL refiner's index), without reading a weight (a process that only passes the folder on: a
    bench's parent); None when the entry names no instance."""
    family = _entry_of(root)[2]
    return None if family is None else family.for_folder(root)


def declared_families() -> list[Family]:
    """Every family instance the modules of ``FAMILY_OF_CLASS`` define (imports them all: for
    help texts and schemas that list every family's inputs, never on a call's path)."""
    import importlib

    found: list[Family] = []
    for module in dict.fromkeys(entry[0] for entry in FAMILY_OF_CLASS.values()):
        for value in vars(importlib.import_module(module)).values():
            if isinstance(value, Family) and all(value is not f for f in found):
                found.append(value)
    return found
