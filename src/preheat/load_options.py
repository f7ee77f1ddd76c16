"""What ``preheat.load`` hands a family's loader beside the folder -- the second model folders
(a ControlNet, an SDXL refiner), the text encoders' offloading and their placement on the host -- checked against what that
loader takes as its family declares it (``Family.loader_takes``), in one line, before any weight is read. Both backends refuse a second folder in the
same words (:func:`companion_refused`)."""

from __future__ import annotations

from pathlib import Path
from typing import AbstractSet, Any, Mapping

from preheat.errors import InvalidArgumentError
from preheat.model_source import BUILTIN_PREFIX, RANDOM_PREFIX, model_root
from preheat.models.footprint import ENCODERS_ON, encoders_placement

__all__ = ["COMPANION_MODELS", "ENCODERS_ON", "companion_refused", "encoders_placement", "loader_options", "source_id"]

# whom each second model folder of ``load`` applies to (its family's loader takes it by that name)
COMPANION_MODELS = {"controlnet": "Stable Diffusion 1.x/2.x and SDXL models", "refiner": "SDXL base models"}


def companion_refused(name: str, root: Path | str) -> InvalidArgumentError:
    """The error for a second model folder ``name`` given with a model (``root``) it does not apply to."""
    return InvalidArgumentError(f"{name} applies to {COMPANION_MODELS[name]}; {root} is not one", argument=name)


def loader_options(takes: AbstractSet[str], root: Path, offload_encoders: bool,
                   companions: Mapping[str, Any], variant: str | None, encoders_on: str = "device") -> dict[str, Any]:
    """The keywords for a loader that ``takes`` these beyond the common ones: each second folder
    resolved to its local folder (hf://: pulled once; a refiner reads ``variant`` too), offloading,
    and the encoders kept on the host; one line for one this family's loader does not take."""
    options: dict[str, Any] = {}
    offload_encoders, encoders_on = encoders_placement(offload_encoders, encoders_on)
    if offload_encoders:
        if "offload_encoders" not in takes:
            raise InvalidArgumentError(f"offload_encoders applies to text-to-image models; {root} has no text "
                                       "encoders", argument="offload_encoders")
        options["offload_encoders"] = True
    if encoders_on == "host":
        if "encoders_on" not in takes:
            raise InvalidArgumentError(f"encoders_on='host' applies to FLUX.1 models (their T5-XXL on the host's "
                                       f"CPU); {root} is not one", argument="encoders_on")
        if offload_encoders:
            raise InvalidArgumentError("encoders_on='host' keeps the text encoders on the host and runs them there; "
                                       "offload_encoders moves them in to encode: give one", argument="encoders_on")
        options["encoders_on"] = "host"
    for name, folder in companions.items():
        if folder is None:
            continue
        if name not in takes:
            raise companion_refused(name, root)
        options[name] = model_root(folder, variant if name == "refiner" else None)
    return options


def source_id(source: str | Path) -> str:
    """A model source as a start-up's identity: a folder's absolute path; a URI or a built-in or
    random name as given."""
    text = str(source)
    if "://" in text or text.startswith((BUILTIN_PREFIX, RANDOM_PREFIX)):
        return text
    return str(Path(text).resolve())
