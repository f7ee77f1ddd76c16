"""``bench.random_weights``: pipeline folders written from preheat's own models, no torch. diffusers
(the independent reference) must load every tensor of them by name and shape, and so must preheat."""

from __future__ import annotations

import json

import numpy as np
import pytest

from preheat.bench import random_models as rm
from preheat.bench.random_weights import write_random_folder
from preheat.errors import InvalidArgumentError

TINY_SDXL = {"unet": rm.TINY_SDXL_UNET, "vae": rm.TINY_VAE, "text_encoder": rm.TINY_SDXL_CLIP,
             "text_encoder_2": {**rm.TINY_SDXL_CLIP, "hidden_act": "gelu"}}
TINY_SD15 = {"unet": rm.TINY_SD1_UNET, "vae": rm.TINY_VAE, "text_encoder": rm.TINY_CLIP}


@pytest.fixture(scope="module")
def sdxl(tmp_path_factory):
    return write_random_folder("sdxl", tmp_path_factory.mktemp("rw") / "sdxl", configs=TINY_SDXL)


def test_diffusers_loads_every_tensor_of_an_sdxl_folder(sdxl):
    torch = pytest.importorskip("torch")
    from diffusers import StableDiffusionXLPipeline

    pipe = StableDiffusionXLPipeline.from_pretrained(str(sdxl), torch_dtype=torch.float16)
    state = pipe.unet.state_dict()
    written = {k: v for k, v in _tensors(sdxl / "unet" / "diffusion_pytorch_model.safetensors").items()}
    assert set(state) == set(written)
    for key, value in written.items():
        assert tuple(state[key].shape) == value.shape, key
        np.testing.assert_array_equal(state[key].float().numpy(), value.astype(np.float32), err_msg=key)
    assert pipe.text_encoder_2.__class__.__name__ == "CLIPTextModelWithProjection"
    norms = [k for k in written if k.endswith("norm1.weight")]
    assert norms and all((written[k] == 1).all() for k in norms)  # scales ones, so activations stay finite


def test_preheat_samples_from_it_and_a_complete_folder_is_kept(sdxl):
    import preheat

    before = (sdxl / "unet" / "diffusion_pytorch_model.safetensors").stat().st_mtime_ns
    assert write_random_folder("sdxl", sdxl, configs=TINY_SDXL) == sdxl
    assert (sdxl / "unet" / "diffusion_pytorch_model.safetensors").stat().st_mtime_ns == before
    images = preheat.load(str(sdxl)).generate("a photo of a fox", steps=2, seed=1)
    assert images.shape[0] == 1 and images.dtype == np.uint8 and images.std() > 0


def test_sd15_folder_names_its_pipeline(tmp_path):
    out = write_random_folder("sd15", tmp_path / "sd15", configs=TINY_SD15)
    index = json.loads((out / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusionPipeline" and index["unet"] == ["diffusers", "UNet2DConditionModel"]
    import preheat

    assert preheat.load(str(out)).generate("a cat", steps=1).shape[0] == 1


def test_unknown_architecture_is_one_line(tmp_path):
    with pytest.raises(InvalidArgumentError, match="unknown architecture 'flux'; known: sd15, sdxl"):
        write_random_folder("flux", tmp_path)


def _tensors(path):
    from safetensors.numpy import load_file

    return load_file(str(path))
