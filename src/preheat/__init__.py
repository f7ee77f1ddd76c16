"""preheat: diffusion sampling that starts hot.

Public API (re-exported here; the code lives in the private modules named):

    load_unet(path, dtype)      preheat.models.loading   a diffusers UNet2DModel in JAX
    load(model, ...)            preheat.api              a sampling pipeline, JAX or torch (built-in model by default)
    Pipeline                    preheat.engine
    errors                      preheat.errors           the one exception tree

Names are resolved lazily so that ``import preheat`` (and the CLI's ``--help`` or ``doctor``)
does not pay for importing JAX.
"""

from __future__ import annotations

from typing import Any

from preheat import errors
from preheat._version import __version__
from preheat.env import quiet_gpu_plugin_failure

quiet_gpu_plugin_failure()  # a GPU plugin with no usable GPU is one logged line, not a traceback

__all__ = ["load_unet", "load", "Pipeline", "errors", "__version__"]

_LAZY = {
    "load_unet": ("preheat.models.loading", "load_unet"),
    "load": ("preheat.api", "load"),
    "Pipeline": ("preheat.engine", "Pipeline"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'preheat' has no attribute {name!r}")
