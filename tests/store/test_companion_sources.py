"""A second model folder from the store: ``preheat.load(base, refiner="hf://ORG/REPO")`` and
``controlnet="hf://ORG/REPO"`` pull the repository (a pipeline folder; a bare ControlNetModel)
from a stand-in Hub on 127.0.0.1 once, then load it as the local folder would: the same pixels."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import preheat
from tests._support import image_fixtures
from tests._support.controlnet_fixtures import control_image, save_tiny_controlnet
from tests._support.hub_server import FakeHub, pointed_at

pytestmark = pytest.mark.slow  # two tiny pipelines loaded twice each and compiled: test-slow


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _served(monkeypatch: pytest.MonkeyPatch, repo: str, folder: Path) -> FakeHub:
    hub = FakeHub(repo, _files(folder)).start()
    pointed_at(monkeypatch, hub.base)
    return hub


@pytest.mark.parametrize("kind", ["refiner", "controlnet"])
def test_a_second_model_from_hf_equals_its_local_folder(kind, tmp_path, monkeypatch):
    monkeypatch.setenv("PREHEAT_HOME", str(tmp_path / "home"))
    base = image_fixtures.save_image_sd(tmp_path / "base", "sdxl")
    if kind == "refiner":
        folder = image_fixtures.save_image_sd(tmp_path / "refiner", "sdxl-refiner", seed=3)
        repo, call = "stabilityai/stable-diffusion-xl-refiner-1.0", dict(denoising_end=0.5)
    else:
        folder = save_tiny_controlnet(tmp_path / "cn", base)
        repo, call = "diffusers/controlnet-canny-sdxl-1.0", dict(control_image=control_image(seed=2))
    hub = _served(monkeypatch, repo, folder)
    try:
        pulled = preheat.load(base, cache="off", **{kind: f"hf://{repo}"})
        assert hub.downloaded()  # its files came over HTTP, into the store
    finally:
        hub.stop()
    local = preheat.load(base, cache="off", **{kind: str(folder)})
    common = dict(steps=3, guidance=5.0, seed=1, **call)
    np.testing.assert_array_equal(pulled.generate("a red boat", **common), local.generate("a red boat", **common))
