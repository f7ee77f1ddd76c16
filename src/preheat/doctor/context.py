"""The context shared by checks: facts gathered once, errors kept per fact; which JAX build fits
this driver and GPU; small helpers the checks share."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from preheat.doctor.runner import _timeouts
from preheat.doctor.smi import SmiInfo
from preheat.doctor.tpu_host import TpuHost

# The driver decides which JAX CUDA build can run (JAX installation docs).
DRIVER_MIN_CUDA13 = 580
DRIVER_MIN_CUDA12 = 525
# Oldest GPU architecture each build supports (SM = compute capability).
SM_MIN = {"cuda13": (7, 5), "cuda12": (5, 2)}
TORCH_INDEX_VAR = "PYTORCH_INDEX_URL"


def torch_index() -> str:
    """The base of PyTorch's wheel indexes as the fixes print it (``<base>/cu128``): the value of
    $PYTORCH_INDEX_URL when set (the index PyTorch's install selector names, or a mirror of it),
    else the variable itself, for the shell to expand. preheat names no package host itself."""
    return os.environ.get(TORCH_INDEX_VAR, "").strip().rstrip("/") or "$" + TORCH_INDEX_VAR


class _FactError(Exception):
    pass


@dataclass(frozen=True)
class ModelRequest:
    """``preheat doctor --model``: the model and the load options whose fit is checked."""

    model: str
    dtype: str = "float32"
    weights_dtype: str | None = None
    variant: str | None = None
    offload_encoders: bool = False
    weights_layers: str = "layerwise"
    encoders_on: str = "device"


class Context:
    """Facts for the checks. A fact whose gathering raised re-raises when a check reads it."""

    def __init__(self, require_gpu: bool = False, model: ModelRequest | None = None) -> None:
        self.require_gpu = require_gpu
        self.model = model
        self.smi_timeout, self.probe_timeout = _timeouts()
        self._facts: dict[str, Any] = {}
        self._errors: dict[str, BaseException] = {}
        self.gpu_backend: bool | None = None

    def gather(self, name: str, fn: Callable[[], Any]) -> None:
        try:
            self._facts[name] = fn()
        except Exception as exc:  # a fact that cannot be gathered fails the checks that read it
            self._errors[name] = exc

    def fact(self, name: str) -> Any:
        if name in self._errors:
            exc = self._errors[name]
            raise _FactError(f"gathering {name} failed: {type(exc).__name__}: {exc}") from exc
        return self._facts[name]

    # -- derived facts --------------------------------------------------------------------------

    @property
    def smi(self) -> SmiInfo:
        return self.fact("smi")

    @property
    def dev(self) -> dict[str, list[str]]:
        return self.fact("dev")

    @property
    def tpu(self) -> TpuHost:
        return self.fact("tpu")

    def platform(self) -> str:
        """Which checks apply: "tpu" on a TPU VM (from the host, whatever JAX sees), "gpu" where an
        NVIDIA GPU is, else "cpu"."""
        try:
            if self.tpu.is_tpu:
                return "tpu"
        except _FactError:
            pass
        try:
            return "gpu" if self.gpu_present() else "cpu"
        except _FactError:
            return "cpu"

    def gpu_present(self) -> bool:
        smi_gpus = False
        try:
            smi_gpus = self.smi.status == "ok" and bool(self.smi.gpus)
        except _FactError:
            pass
        return smi_gpus or bool(self.dev["gpus"])

    def plan(self) -> dict[str, Any]:
        """Which JAX build fits this driver and GPU: {"build": "cuda13"|"cuda12"|None, "why": ...}."""
        smi = self.smi
        if smi.status != "ok":
            return {"build": None, "why": "driver unknown", "driver_major": None, "min_sm": None}
        major, sm = smi.driver_major, smi.min_sm
        plan: dict[str, Any] = {"driver_major": major, "min_sm": sm}
        if major is None:
            plan.update(build=None, why="driver unknown")
        elif major < DRIVER_MIN_CUDA12:
            plan.update(build=None, why="driver too old")
        elif sm is not None and sm < SM_MIN["cuda12"]:
            plan.update(build=None, why="gpu too old")
        elif major >= DRIVER_MIN_CUDA13 and (sm is None or sm >= SM_MIN["cuda13"]):
            plan.update(build="cuda13", why="driver >= 580")
        elif major >= DRIVER_MIN_CUDA13:
            plan.update(build="cuda12", why="gpu too old for cuda13")
        else:
            plan.update(build="cuda12", why="driver >= 525")
        return plan


def _sm(cc: tuple[int, int] | None) -> str:
    return f"{cc[0]}.{cc[1]}" if cc else "unknown"


def _pip_jax(build: str) -> str:
    return f'pip install -U "jax[{build}]"'


_DRIVER_FIX = (
    f"upgrade the NVIDIA driver to >= {DRIVER_MIN_CUDA13} (>= {DRIVER_MIN_CUDA12} for jax[cuda12]); a rented pod cannot "
    "change its driver: redeploy on a host whose CUDA version is >= 12.0 (>= 13.0 for jax[cuda13]) with the provider's "
    "CUDA-version filter"
)


def _count(items: Iterable[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for it in items:
        out[str(it)] = out.get(str(it), 0) + 1
    return out
