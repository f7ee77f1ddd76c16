"""The torch backend's one table of diffusers' per-family calls (``backends.torch.calls``): a row
for every family it loads, naming diffusers classes that exist, and a one-line error for any other."""

from __future__ import annotations

import importlib

import pytest

pytest.importorskip("diffusers")


def test_every_family_the_backend_loads_has_a_row_of_real_classes():
    import diffusers

    from preheat.backends.torch.calls import DIFFUSERS_CALLS
    from preheat.backends.torch.text import TEXT_FAMILIES

    from preheat.families import declared_families
    from preheat.families.stable_diffusion import SDXL_REFINER

    loaded = {getattr(importlib.import_module(f"preheat.families.{module}"), name).name
              for module, name in TEXT_FAMILIES.values()} | {SDXL_REFINER.name}  # a refiner: by its index's flag
    assert loaded == set(DIFFUSERS_CALLS) <= {f.name for f in declared_families()}
    for calls in DIFFUSERS_CALLS.values():
        for name in (calls.img2img, calls.inpaint):
            assert name is None or hasattr(diffusers, name), name


def test_a_family_without_a_row_is_one_line():
    from preheat.backends.torch.calls import diffusers_calls
    from preheat.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="^the torch backend does not run a pixel model$"):
        diffusers_calls("pixel")
