"""preheat.load_options: the loader's keywords beside the folder, refused in one line by a family
that does not declare them (no weights read); each family's declaration matches its loader."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import pytest

from preheat.errors import InvalidArgumentError
from preheat.families import FAMILY_OF_CLASS
from preheat.load_options import companion_refused, loader_options, source_id

PIXEL_TAKES: frozenset[str] = frozenset()  # a pixel family's loader: nothing beyond the common keywords
SDXL_TAKES = frozenset({"offload_encoders", "controlnet", "refiner"})  # an SDXL base's


def test_a_loader_gets_what_it_takes_each_folder_resolved(tmp_path: Path) -> None:
    options = loader_options(SDXL_TAKES, tmp_path, True, {"controlnet": str(tmp_path), "refiner": None}, "fp16")
    assert options == {"offload_encoders": True, "controlnet": tmp_path}
    assert loader_options(PIXEL_TAKES, tmp_path, False, {"controlnet": None, "refiner": None}, None) == {}


@pytest.mark.parametrize("class_name", sorted(FAMILY_OF_CLASS))
def test_a_family_declares_exactly_what_its_loader_takes(class_name: str) -> None:
    """The declaration (``Family.loader_takes``) is what ``preheat.load`` reads; the loader's own
    keywords must agree with it, so a declared option always reaches a loader that takes it."""
    entry = FAMILY_OF_CLASS[class_name]
    module = importlib.import_module(entry.module)
    keywords = set(inspect.signature(getattr(module, entry.loader)).parameters)
    assert getattr(module, entry.family).loader_takes == keywords & {"offload_encoders", "controlnet", "refiner",
                                                                     "encoders_on"}


@pytest.mark.parametrize(("offload", "companions", "message", "argument"), [
    (True, {}, "offload_encoders applies to text-to-image models; {root} has no text encoders", "offload_encoders"),
    (False, {"controlnet": "x"}, "controlnet applies to Stable Diffusion 1.x/2.x and SDXL models; {root} is not one",
     "controlnet"),
    (False, {"refiner": "x"}, "refiner applies to SDXL base models; {root} is not one", "refiner"),
])
def test_what_a_loader_does_not_take_is_one_line(tmp_path: Path, offload: bool, companions: dict, message: str,
                                                 argument: str) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        loader_options(PIXEL_TAKES, tmp_path, offload, companions, None)
    assert str(err.value) == message.format(root=tmp_path) and err.value.argument == argument
    if argument != "offload_encoders":  # the torch backend refuses in the same words
        assert str(companion_refused(argument, tmp_path)) == str(err.value)


def test_encoders_on_the_host_reach_a_loader_that_takes_them(tmp_path: Path) -> None:
    flux = frozenset({"offload_encoders", "encoders_on"})
    assert loader_options(flux, tmp_path, False, {}, None, "host") == {"encoders_on": "host"}
    assert loader_options(flux, tmp_path, False, {}, None, "device") == {}
    with pytest.raises(InvalidArgumentError, match="applies to FLUX.1 models") as err:
        loader_options(SDXL_TAKES, tmp_path, False, {}, None, "host")
    assert err.value.argument == "encoders_on"


def test_a_source_id_is_a_folder_absolute_or_a_name_as_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert source_id("m") == str(tmp_path / "m")
    for given in ("hf://org/repo", "https://x/m.tar.gz", "random:sd1-tiny", "builtin:digits"):
        assert source_id(given) == given
