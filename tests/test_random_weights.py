"""``bench.random_weights``: pipeline folders written from preheat's own models, no torch. diffusers
(the independent reference) must load every tensor of them by name and shape, and so must preheat."""

from __future__ import annotations

import json

import numpy as np
import pytest

from preheat.bench import random_models as rm
from preheat.bench.random_weights import SMALL_FLUX, write_random_folder
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


# FLUX.1 at full depth is 12 B parameters: the tests write it depth- and width-reduced (SMALL_FLUX).


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    base = tmp_path_factory.mktemp("rw-flux")
    dev = write_random_folder("flux-dev", base / "flux-dev", configs=SMALL_FLUX)
    schnell = write_random_folder("flux-schnell", base / "flux-schnell", configs=SMALL_FLUX, link_from=dev)
    kontext = write_random_folder("flux-kontext", base / "flux-kontext", configs=SMALL_FLUX, link_from=dev)
    fill = write_random_folder("flux-fill", base / "flux-fill", configs=SMALL_FLUX, link_from=dev)
    return {"flux-dev": dev, "flux-schnell": schnell, "flux-kontext": kontext, "flux-fill": fill}


def _header(path):
    import struct

    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n))


def test_flux_folders_stream_fp8_matrices_and_share_what_the_variants_share(flux):
    dev, schnell = flux["flux-dev"], flux["flux-schnell"]
    first = "transformer/diffusion_pytorch_model-00001-of-00002.safetensors"
    header = _header(dev / first)
    dtypes = {k: v["dtype"] for k, v in header.items() if k != "__metadata__"}
    assert dtypes["transformer_blocks.0.attn.to_q.weight"] == "F8_E4M3"
    assert dtypes["transformer_blocks.0.norm1.linear.weight"] == "F8_E4M3"  # AdaLN: int8 with --weights-layers linear
    assert dtypes["transformer_blocks.0.attn.to_q.bias"] == "BF16" and dtypes["norm_out.linear.bias"] == "BF16"
    assert (dev / "transformer/diffusion_pytorch_model-00002-of-00002.safetensors").is_file()  # the guidance embedder
    assert not (schnell / "transformer/diffusion_pytorch_model-00002-of-00002.safetensors").exists()
    for rel in (first, "text_encoder_2/model.safetensors", "text_encoder/model.safetensors",
                "vae/diffusion_pytorch_model.safetensors"):
        assert (dev / rel).stat().st_ino == (schnell / rel).stat().st_ino, rel  # hard-linked, not written twice
    assert json.loads((schnell / "transformer/config.json").read_text())["guidance_embeds"] is False
    assert json.loads((dev / "scheduler/scheduler_config.json").read_text())["shift"] == 3.0
    assert json.loads((dev / "transformer/config.json").read_text())["num_layers"] == 1  # the given depth
    assert not list(dev.rglob(".*.partial"))


def test_kontext_shares_devs_files_and_fill_writes_its_own_transformer(flux):
    """Kontext dev's tensors are dev's; Fill's input layer takes 4 x (16 + 16 + s²) channels, so its
    transformer is written, while the encoders and the VAE are linked."""
    dev, kontext, fill = flux["flux-dev"], flux["flux-kontext"], flux["flux-fill"]
    first = "transformer/diffusion_pytorch_model-00001-of-00002.safetensors"
    assert (dev / first).stat().st_ino == (kontext / first).stat().st_ino
    assert (dev / first).stat().st_ino != (fill / first).stat().st_ino
    t5 = "text_encoder_2/model.safetensors"
    assert (dev / t5).stat().st_ino == (fill / t5).stat().st_ino
    scale = 2 ** (len(SMALL_FLUX["vae"]["block_out_channels"]) - 1)
    assert _header(fill / first)["x_embedder.weight"]["shape"][1] == 4 * (2 * 16 + scale * scale)
    assert json.loads((kontext / "model_index.json").read_text())["_class_name"] == "FluxKontextPipeline"
    assert json.loads((fill / "model_index.json").read_text())["_class_name"] == "FluxFillPipeline"


@pytest.mark.parametrize("name", ["flux-schnell", "flux-dev", "flux-kontext", "flux-fill"])
def test_preheat_loads_a_flux_folder_as_the_chip_rows_do(flux, name):
    """The rows' options: bfloat16, int8 matrices quantised from the fp8 file, every Linear, T5 on the host."""
    import preheat
    from preheat.models.quantised import Quantised

    pipe = preheat.load(flux[name], cache="off", devices=1, dtype="bfloat16", weights_dtype="int8",
                        weights_layers="linear", encoders_on="host")
    assert pipe.family.name == name.replace("-dev", "").replace("-schnell", "")
    assert pipe.components.guidance_embeds == (name != "flux-schnell")
    import jax
    leaves = jax.tree.leaves(pipe.params, is_leaf=lambda x: isinstance(x, Quantised))
    assert sum(isinstance(leaf, Quantised) for leaf in leaves) > 10
    images = {"flux-kontext": {"image": np.full((16, 16, 3), 128, np.uint8), "image_resize": "none"},
              "flux-fill": {"image": np.full((16, 16, 3), 128, np.uint8),
                            "mask_image": np.eye(16, dtype=np.uint8) * 255}}
    image = pipe.generate("a red fox", steps=1, width=16, height=16, seed=0, **images.get(name, {}))
    assert image.shape == (1, 16, 16, 3) and image.dtype == np.uint8
    tokens = pipe.components.tokenizers[1].encode(["a red fox at night, blurry"])
    assert tokens.shape == (1, 512) and (tokens[0] != 2).all()  # T5's tokenizer: no <unk>


def test_int8_from_an_fp8_file_on_a_device_without_fp8_arrays_goes_there_in_bf16(flux, monkeypatch):
    """The same int8 values and scales either way: fp8 is exact in bfloat16."""
    import jax

    from preheat.models import weights
    from preheat.models.flux import load_flux_transformer
    from preheat.models.quantised import Quantised
    from preheat.models.weights import LoadOptions

    options = LoadOptions(weights_dtype="int8", weights_layers="linear")
    folder = flux["flux-dev"] / "transformer"
    direct = load_flux_transformer(folder, "bfloat16", options=options)
    monkeypatch.setattr(weights, "holds", lambda dtype: False)
    via_bf16 = load_flux_transformer(folder, "bfloat16", options=options)
    pairs = list(zip(*(jax.tree.leaves(m.params, is_leaf=lambda x: isinstance(x, Quantised))
                       for m in (direct, via_bf16))))
    quantised = [(a, b) for a, b in pairs if isinstance(a, Quantised)]
    assert quantised and all(np.array_equal(a.values, b.values) and np.array_equal(a.scale, b.scale)
                             for a, b in quantised)
