"""End to end: a real (tiny, random) diffusers UNet pulled over HTTP loads with preheat.load_unet,
with exactly the weights of the original folder."""

from __future__ import annotations

import json

import jax
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

import preheat
from preheat.models.loading import build_abstract, torch_key
from preheat.models.unet2d import UNet2DConfig
from preheat.store import pull, resolve
from tests._support.store_fixtures import tar_bytes

TINY = dict(_class_name="UNet2DModel", sample_size=8, in_channels=1, out_channels=1, layers_per_block=1,
            block_out_channels=[8, 16], norm_num_groups=4, down_block_types=["DownBlock2D", "DownBlock2D"],
            up_block_types=["UpBlock2D", "UpBlock2D"])


def _torch_shape(shape, leaf):
    if leaf == "kernel" and len(shape) == 4:
        kh, kw, i, o = shape
        return (o, i, kh, kw)
    if leaf == "kernel" and len(shape) == 2:
        return (shape[1], shape[0])
    return tuple(shape)


def _tiny_unet_folder(folder):
    """config.json + random weights in torch layout for every parameter preheat expects."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(TINY))
    _, abstract = build_abstract(UNet2DConfig.from_dict(TINY))
    rng = np.random.default_rng(0)
    tensors = {torch_key(path): rng.standard_normal(_torch_shape(var.shape, str(path[-1])), dtype=np.float32)
               for path, var in nnx.to_flat_state(abstract)}
    save_file(tensors, str(folder / "diffusion_pytorch_model.safetensors"))
    return folder


def test_pulled_unet_loads_identically(server, root, tmp_path):
    src = _tiny_unet_folder(tmp_path / "pipe" / "unet")
    (src.parent / "model_index.json").write_text(json.dumps({"_class_name": "DDPMPipeline"}))
    server.files["/pipe.tar.gz"] = tar_bytes(src.parent, top="pipe")
    url = server.url("pipe.tar.gz")
    snap = pull(url, root=root, progress=False)
    assert resolve(url, root=root, offline=True) == snap

    original = preheat.load_unet(src)
    pulled = preheat.load_unet(snap)  # the pipeline folder: model_index.json + unet/
    a = jax.tree_util.tree_leaves(original.params)
    b = jax.tree_util.tree_leaves(pulled.params)
    assert len(a) == len(b) > 10
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
