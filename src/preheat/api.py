"""``preheat.load``: one entry point for both backends, above both (neither imports the other).

    preheat.load(model)                                  -> preheat.engine.Pipeline (JAX)
    preheat.load(model, backend="torch", compile=...)    -> preheat.backends.torch pipelines
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from preheat.errors import InvalidArgumentError

__all__ = ["load"]


def load(model: str | Path | None = None, *, backend: str = "jax", compile: str = "none", **options: Any) -> Any:
    """A sampling pipeline for ``model`` (``None`` = the built-in model); see :func:`preheat.engine.load_jax_pipeline`
    for ``scheduler``, ``dtype``, ``cache`` and ``variant``.

    ``backend="torch"`` returns the same call API on diffusers' own models and pipelines, with
    ``compile`` = "none" (eager), "inductor" (torch.compile), "aot" (AOTInductor) or "regional";
    ``controlnet`` and ``refiner`` run there as diffusers' ControlNet pipelines and ensemble of experts.
    """
    if backend == "torch":
        from preheat.backends.torch import load_torch_pipeline

        if options.pop("weights_dtype", None) is not None or options.pop("weights_layers", "layerwise") != "layerwise":
            raise InvalidArgumentError("weights_dtype applies to backend='jax' (fp8 storage, upcast inside the compiled "
                                       "program); the torch backend loads weights in dtype", argument="weights_dtype")
        if options.pop("encoders_on", "device") != "device":
            raise InvalidArgumentError("encoders_on applies to backend='jax' (the encode stage compiled for the "
                                       "host's CPU, or to stream its weights from host memory)", argument="encoders_on")

        return load_torch_pipeline(model, compile=compile, **options)
    if backend != "jax":
        raise InvalidArgumentError(f"backend={backend!r} is not supported; use 'jax' or 'torch'", argument="backend")
    if compile != "none":
        raise InvalidArgumentError(f"compile={compile!r} applies to backend='torch'; the JAX loop is always compiled",
                                   argument="compile")
    from preheat.engine import load_jax_pipeline

    return load_jax_pipeline(model, **options)
