"""The PyTorch side: diffusers' own UNet2DModel and schedulers, on the same checkpoints.

It is both a backend users can compare against (``load`` -> ``TorchPipeline``, the JAX
``Pipeline``'s call API; eager, torch.compile or AOTInductor, with preheat's compile cache) and
the independent reference in tests. Importing this package imports torch; nothing else in
preheat does.
"""

from preheat.backends.torch.pipeline import COMPILE_MODES, DETERMINISTIC_SAMPLERS, TorchPipeline, initial_noise, load
from preheat.backends.torch.sampling import DIFFUSERS_SCHEDULERS, make_scheduler, sample_loop

__all__ = ["load", "TorchPipeline", "initial_noise", "COMPILE_MODES", "DETERMINISTIC_SAMPLERS",
           "DIFFUSERS_SCHEDULERS", "make_scheduler", "sample_loop"]
