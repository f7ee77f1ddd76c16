"""A pixel UNet2DModel's schedule inputs against diffusers: ``timestep_spacing`` as
``DDPMPipeline`` runs a ``DDIMScheduler.from_config(config, timestep_spacing="trailing")``, and
custom ``timesteps`` as ``TCDScheduler.set_timesteps(timesteps=...)`` runs them (on a tiny random
unconditional UNet2DModel folder, and on the built-in digits model). Both backends: the JAX
engine and ``backend="torch"``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import preheat
from tests._support.numerics import mean_abs_px as _diff
from tests._support.reference import TINY_CLASS_CONDITIONAL, save_random_unet

MEAN_TOL = 1.0  # mean |Δ| in levels (1/255) across frameworks
UNCONDITIONAL = {k: v for k, v in TINY_CLASS_CONDITIONAL.items() if k != "num_class_embeds"}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from preheat.train.digits import DIGITS_SCHEDULER

    path = tmp_path_factory.mktemp("pixel-schedule") / "ddpm"
    save_random_unet(UNCONDITIONAL, path / "unet", seed=3, perturb=0.05)
    (path / "scheduler").mkdir(parents=True)
    (path / "scheduler" / "scheduler_config.json").write_text(json.dumps(DIGITS_SCHEDULER))
    (path / "model_index.json").write_text(json.dumps({"_class_name": "DDPMPipeline"}))
    return path


@pytest.fixture(scope="module")
def pipe(folder: Path) -> Any:
    return preheat.load(folder, cache="off")


def _noise(seed: int) -> np.ndarray:
    """What DDPMPipeline draws from ``torch.Generator().manual_seed(seed)``: (1, C, H, W)."""
    import torch
    from diffusers.utils.torch_utils import randn_tensor

    shape = (1, UNCONDITIONAL["in_channels"], UNCONDITIONAL["sample_size"], UNCONDITIONAL["sample_size"])
    return randn_tensor(shape, generator=torch.Generator().manual_seed(seed)).numpy()


def _levels(images: np.ndarray) -> np.ndarray:
    """diffusers' [0, 1] images (clamped) as uint8 levels, rounded as its numpy_to_pil does."""
    return (np.asarray(images, np.float64) * 255).round().astype(np.uint8)


def test_timestep_spacing_is_diffusers_ddpm_pipeline_with_that_scheduler(folder: Path, pipe: Any) -> None:
    import torch
    from diffusers import DDIMScheduler, DDPMPipeline, UNet2DModel

    config = json.loads((folder / "scheduler" / "scheduler_config.json").read_text())
    reference = DDPMPipeline(unet=UNet2DModel.from_pretrained(folder / "unet").eval(),
                             scheduler=DDIMScheduler.from_config(config, timestep_spacing="trailing"))
    theirs = _levels(reference(batch_size=1, generator=torch.Generator().manual_seed(7), num_inference_steps=4,
                               output_type="np").images)  # (1, H, W, C)
    call = dict(noise=_noise(7), sampler="ddim", steps=4)
    ours = pipe.generate(timestep_spacing="trailing", **call)
    assert _diff(ours, theirs) <= MEAN_TOL, _diff(ours, theirs)
    assert _diff(pipe.generate(**call), theirs) > 3 * MEAN_TOL  # the folder's "leading" is another image
    torch_ours = preheat.load(folder, backend="torch").generate(timestep_spacing="trailing", **call)
    assert _diff(torch_ours, theirs) <= MEAN_TOL, _diff(torch_ours, theirs)


def test_custom_timesteps_are_diffusers_set_timesteps_and_their_count_is_the_steps() -> None:
    """On the built-in (trained) digits model, whose images are not saturated at two steps as a
    random UNet's are: TCD at gamma 0 (deterministic), class 3, no guidance."""
    import torch
    from diffusers import TCDScheduler, UNet2DModel

    from preheat.engine import BUILTIN_MODEL
    from preheat.errors import InvalidArgumentError

    config = json.loads((BUILTIN_MODEL / "scheduler" / "scheduler_config.json").read_text())
    unet = UNet2DModel.from_pretrained(BUILTIN_MODEL / "unet").eval()
    scheduler = TCDScheduler.from_config(config)
    scheduler.set_timesteps(timesteps=[899, 299])  # diffusers: num_inference_steps = len(timesteps)
    assert scheduler.num_inference_steps == 2
    noise = np.random.default_rng(2).standard_normal((1, 1, 16, 16)).astype(np.float32)
    label = torch.tensor([3])
    x = torch.from_numpy(noise) * scheduler.init_noise_sigma
    with torch.no_grad():
        for t in scheduler.timesteps:
            eps = unet(scheduler.scale_model_input(x, t), t, class_labels=label).sample
            x = scheduler.step(eps, t, x, eta=0.0).prev_sample
    theirs = _levels((x / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).numpy())
    assert 0.1 < float(((theirs > 0) & (theirs < 255)).mean())  # a real image: not all 0 / 255

    pipe = preheat.load(BUILTIN_MODEL, cache="off")
    call = dict(noise=noise, sampler="tcd", eta=0.0, class_labels=3, guidance=1.0)
    ours = pipe.generate(timesteps=[899, 299], **call)  # no steps: the list's count
    assert _diff(ours, theirs) <= MEAN_TOL, _diff(ours, theirs)
    assert _diff(pipe.generate(steps=2, **call), theirs) > 3 * MEAN_TOL  # TCD's own 2-step schedule is another
    torch_ours = preheat.load(BUILTIN_MODEL, backend="torch").generate(timesteps=[899, 299], **call)
    assert _diff(torch_ours, theirs) <= MEAN_TOL, _diff(torch_ours, theirs)
    with pytest.raises(InvalidArgumentError, match=r"^timesteps has 2 entries but steps=3; leave steps out or give "
                                                   r"steps=2$"):
        pipe.generate(timesteps=[899, 299], steps=3, **call)
