"""Bad checkpoints fail with one clear line that names the problem, and load nothing."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import preheat
from preheat.errors import ModelFormatError, ModelNotFoundError, UnsupportedConfigError, WeightsError
from tests._support.reference import save_random_unet

TINY = dict(sample_size=8, in_channels=1, out_channels=1, layers_per_block=1, block_out_channels=(8, 16),
            norm_num_groups=4, down_block_types=("DownBlock2D", "AttnDownBlock2D"),
            up_block_types=("AttnUpBlock2D", "UpBlock2D"), attention_head_dim=8)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_random_unet(TINY, tmp_path_factory.mktemp("tiny") / "unet")


def _copy(src, dst):
    dst.mkdir(parents=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _one_line(err):
    msg = str(err.value)
    assert "\n" not in msg
    return msg


def test_missing_path(tmp_path):
    with pytest.raises(ModelNotFoundError) as err:
        preheat.load_unet(tmp_path / "nope")
    assert "does not exist" in _one_line(err) and "nope" in str(err.value)


def test_missing_config(tmp_path, tiny):
    d = _copy(tiny, tmp_path / "m")
    (d / "config.json").unlink()
    with pytest.raises(ModelNotFoundError) as err:
        preheat.load_unet(d)
    assert "config.json" in _one_line(err)


def test_missing_weights_file(tmp_path, tiny):
    d = _copy(tiny, tmp_path / "m")
    (d / "diffusion_pytorch_model.safetensors").unlink()
    with pytest.raises(ModelNotFoundError) as err:
        preheat.load_unet(d)
    assert "diffusion_pytorch_model.safetensors" in _one_line(err)


def test_missing_extra_and_misshaped_tensors_are_each_named(tmp_path, tiny):
    d = _copy(tiny, tmp_path / "m")
    f = d / "diffusion_pytorch_model.safetensors"
    sd = load_file(f)
    del sd["conv_in.bias"]
    sd["conv_out.weight"] = np.zeros((1, 8, 5, 5), np.float32)
    sd["surprise.weight"] = np.zeros((3,), np.float32)
    save_file(sd, f)
    with pytest.raises(WeightsError) as err:
        preheat.load_unet(d)
    msg = _one_line(err)
    assert "missing conv_in.bias (expected shape (8,))" in msg
    assert "conv_out.weight has shape (1, 8, 5, 5), expected (1, 8, 3, 3)" in msg
    assert "unexpected surprise.weight (3,)" in msg


def test_wrong_dtype(tmp_path, tiny):
    d = _copy(tiny, tmp_path / "m")
    f = d / "diffusion_pytorch_model.safetensors"
    sd = load_file(f)
    sd["conv_in.bias"] = np.zeros((8,), np.int32)
    save_file(sd, f)
    with pytest.raises(WeightsError) as err:
        preheat.load_unet(d)
    assert "conv_in.bias has dtype int32, expected a floating-point dtype" in _one_line(err)


def test_truncated_weights_file(tmp_path, tiny):
    d = _copy(tiny, tmp_path / "m")
    f = d / "diffusion_pytorch_model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(ModelFormatError) as err:
        preheat.load_unet(d)
    assert "cannot read" in _one_line(err)


@pytest.mark.parametrize("key,value,needle", [
    ("down_block_types", ["CrossAttnDownBlock2D", "DownBlock2D"], "unsupported down_block_types 'CrossAttnDownBlock2D'; supported: 'DownBlock2D', 'AttnDownBlock2D'"),
    ("up_block_types", ["UpBlock2D", "SkipUpBlock2D"], "unsupported up_block_types 'SkipUpBlock2D'"),
    ("time_embedding_type", "learned", "unsupported time_embedding_type 'learned'; supported: 'positional', 'fourier'"),
    ("resnet_time_scale_shift", "spatial", "unsupported resnet_time_scale_shift 'spatial'"),
    ("mid_block_type", "UNetMidBlock2DCrossAttn", "unsupported mid_block_type"),
    ("act_fn", "tanh", "unsupported act_fn 'tanh'"),
    ("downsample_type", "resnet", "unsupported downsample_type 'resnet'"),
    ("cross_attention_dim", 768, "unsupported UNet2DModel config key(s) cross_attention_dim"),
])
def test_unsupported_config_is_named(tmp_path, tiny, key, value, needle):
    d = _copy(tiny, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg[key] = value
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedConfigError) as err:
        preheat.load_unet(d)
    assert needle in _one_line(err)


def test_other_model_class_is_refused(tmp_path, tiny):
    d = _copy(tiny, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["_class_name"] = "UNet2DConditionModel"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedConfigError) as err:
        preheat.load_unet(d)
    assert "unsupported model class 'UNet2DConditionModel'" in _one_line(err)


@pytest.mark.parametrize("index,needle", [
    ('{"_class_name": "DDPMPipeline", "preheat": {', "model_index.json is not valid JSON"),
    ('["DDPMPipeline"]', "model_index.json must hold a JSON object"),
    ('{"_class_name": "DDPMPipeline", "preheat": [10]}', '"preheat" must be a JSON object'),
], ids=["torn", "not-an-object", "preheat-not-an-object"])
def test_malformed_model_index_is_one_line(tmp_path, tiny, index, needle):
    folder = tmp_path / "pipeline"
    _copy(tiny, folder / "unet")
    (folder / "scheduler").mkdir()
    (folder / "scheduler" / "scheduler_config.json").write_text(json.dumps({"_class_name": "DDPMScheduler"}))
    (folder / "model_index.json").write_text(index)
    with pytest.raises(ModelFormatError) as err:
        preheat.load(folder, cache="off")
    assert needle in _one_line(err)


def test_class_conditional_unet_without_labels_is_one_line(tmp_path):
    """Raised while tracing the model: still a PreheatError naming the argument, not a raw ValueError."""
    from preheat.errors import InvalidArgumentError

    unet = preheat.load_unet(save_random_unet(dict(TINY, num_class_embeds=3), tmp_path / "unet"))
    x = np.zeros((1, 1, 8, 8), np.float32)
    with pytest.raises(InvalidArgumentError) as err:
        unet(x, np.int32(5))
    assert err.value.argument == "class_labels" and "pass class_labels" in _one_line(err)
