"""Parity with diffusers when the model is a real (random-weight) diffusers UNet2DModel.

No JAX UNet is needed here: our eager step path calls the torch UNet through
``jax.pure_callback``, so both sides see the very same network; every step is compared with
the same criterion as test_sampler_parity.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import diffusers
from tests._support.sampler_ref import SHAPE, check_parity


@pytest.fixture(scope="module")
def unet():
    # one thread: on a busy 2-core machine torch's OpenMP pool makes this tiny net ~100x slower
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = diffusers.UNet2DModel(
        sample_size=SHAPE[-1], in_channels=SHAPE[1], out_channels=SHAPE[1], layers_per_block=1,
        block_out_channels=(32, 64), norm_num_groups=8,
        down_block_types=("DownBlock2D", "AttnDownBlock2D"), up_block_types=("AttnUpBlock2D", "UpBlock2D"),
    )
    yield net.eval()
    torch.set_num_threads(threads)


def _torch_model(net: diffusers.UNet2DModel):
    def model(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return net(x, t).sample

    return model


def _jax_model(net: diffusers.UNet2DModel):
    def host(x: np.ndarray, t: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            out = net(torch.from_numpy(np.array(x)), torch.tensor(float(t), dtype=torch.float32)).sample
        return out.numpy()

    def model(x: jax.Array, t: jax.Array) -> jax.Array:
        return jax.pure_callback(host, jax.ShapeDtypeStruct(x.shape, jnp.float32), x, t)

    return model


CASES = [
    ("ddpm", {"beta_schedule": "linear", "prediction_type": "epsilon", "clip_sample": True}, 6, 0.0),
    ("ddim", {"beta_schedule": "scaled_linear", "beta_start": 0.00085, "beta_end": 0.012,
              "prediction_type": "v_prediction", "timestep_spacing": "trailing"}, 6, 0.5),
    ("heun", {"beta_schedule": "scaled_linear", "beta_start": 0.00085, "beta_end": 0.012,
              "prediction_type": "epsilon"}, 4, 0.0),
    ("dpmpp_2m_karras", {"beta_schedule": "linear", "prediction_type": "epsilon"}, 6, 0.0),
    ("tcd", {"beta_schedule": "scaled_linear", "beta_start": 0.00085, "beta_end": 0.012,
             "prediction_type": "epsilon"}, 4, 0.3),
]


@pytest.mark.parametrize("sampler,cfg,steps,eta", CASES, ids=[c[0] for c in CASES])
def test_unet_parity(sampler: str, cfg: dict, steps: int, eta: float, unet, monkeypatch) -> None:
    check_parity(sampler, cfg, steps, eta, monkeypatch, jax_model=_jax_model(unet), torch_model=_torch_model(unet))
