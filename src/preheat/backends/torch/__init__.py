"""The PyTorch side: diffusers' own UNet2DModel and schedulers, on the same checkpoints.

It is both a backend users can compare against and the independent reference in tests.
Importing this package imports torch; nothing else in preheat does.
"""

from preheat.backends.torch.sampling import DIFFUSERS_SCHEDULERS, make_scheduler, sample_loop

__all__ = ["DIFFUSERS_SCHEDULERS", "make_scheduler", "sample_loop"]
