"""``preheat.torch``: hot restarts for the diffusers code you already have.

    import preheat.torch
    pipe = FluxPipeline.from_pretrained(...).to("cuda")
    preheat.torch.compile(pipe)       # regional torch.compile; artifacts from / to preheat's cache

The code lives in :mod:`preheat.backends.torch.compiled`; this module is its public name.
"""

from preheat.backends.torch.compiled import DENOISERS, MODES, compile, events, region_classes

__all__ = ["compile", "events", "region_classes", "MODES", "DENOISERS"]
