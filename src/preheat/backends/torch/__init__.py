"""The PyTorch side: diffusers' own models, pipelines and schedulers, on the same checkpoints.

It is both a backend users can compare against and the independent reference in tests.
``load_torch_pipeline`` (``preheat.load(model, backend="torch")``) gives the JAX ``Pipeline``'s
call API: ``TorchPipeline`` for a UNet2DModel folder (``pipeline``), ``TorchTextPipeline`` for SD,
SDXL, SD3 and Flux folders (``text``); eager, torch.compile, regional or AOTInductor, with
preheat's compile cache (``compile_cache``). ``compiled`` is ``preheat.torch.compile``, for
diffusers pipelines people already have. Importing this package imports torch; ``import preheat``
does not.
"""

from preheat.backends.torch.pipeline import (COMPILE_MODES, DETERMINISTIC_SAMPLERS, TorchPipeline, initial_noise,
                                           load_torch_pipeline)
from preheat.backends.torch.sampling import DIFFUSERS_SCHEDULERS, make_scheduler, sample_loop

__all__ = ["load_torch_pipeline", "TorchPipeline", "initial_noise", "COMPILE_MODES", "DETERMINISTIC_SAMPLERS",
           "DIFFUSERS_SCHEDULERS", "make_scheduler", "sample_loop"]
