"""The one exception tree of preheat.

Every error a user can cause is a ``PreheatError`` whose message is one line that names the
problem (and, where there is one, the fix). Surfaces (CLI, server, Runpod handler) print
``str(err)`` and never a traceback for these.

    PreheatError
    ├── ModelError            a model folder or checkpoint cannot be used
    │   ├── ModelNotFoundError    a path or file is missing
    │   ├── ModelFormatError      a config / index / safetensors file is malformed (bad JSON, torn)
    │   ├── UnsupportedConfigError a config value/block preheat does not implement
    │   └── WeightsError          missing / extra / mis-shaped / wrong-dtype tensors
    ├── NamesInputs           about a call's inputs: ``.argument`` names the one, ``.renamed``
    │   │                     words the message in a surface's own names for them
    │   ├── SchedulerConfigError  a scheduler config or sampler choice is not supported
    │   └── InvalidArgumentError  a bad call argument (n <= 0, unknown class, bad noise shape, ...)
    │       └── TargetError           a GPU or TPU compile target cannot be used (``warm --target``): unknown
    │                                 name, malformed description or shape, no CUDA plugin or libtpu, a
    │                                 program larger than its memory; ``.reason`` says which
    ├── CacheError            the cache root or an entry cannot be used (entries are
    │   │                     quarantined and recompiled; this surfaces only for the root)
    │   └── CacheEntryError       one entry failed verification (caught internally)
    ├── FetchError            a model source cannot be fetched (pull)
    ├── MissingExtraError     an optional extra is not installed; ``.extra`` names it
    ├── InputError            a server request's input is invalid; ``.errors`` names each field
    │                         (HTTP 422, a Runpod ``{"error": ...}``)
    └── ServingError          the server cannot take a prediction now
        ├── QueueFull             its bounded queue is full; ``.retry_after`` seconds (409 / 429)
        └── NotAccepting          starting, set-up failed or draining; ``.reason`` (503)
"""

from __future__ import annotations

from typing import Any, Mapping, TypeVar

__all__ = [
    "PreheatError",
    "ModelError",
    "ModelNotFoundError",
    "ModelFormatError",
    "UnsupportedConfigError",
    "WeightsError",
    "CheckpointMismatchError",
    "NamesInputs",
    "SchedulerConfigError",
    "InvalidArgumentError",
    "TargetError",
    "SamplingStopped",
    "CacheError",
    "CacheEntryError",
    "FetchError",
    "MissingExtraError",
    "InputError",
    "ServingError",
    "QueueFull",
    "NotAccepting",
]


class PreheatError(Exception):
    """Base of every error preheat raises on purpose. The message is one line."""


class ModelError(PreheatError):
    """A model folder or checkpoint cannot be used."""


class ModelNotFoundError(ModelError, FileNotFoundError):
    """A model path or one of its files is missing."""


class ModelFormatError(ModelError, ValueError):
    """A config, index or safetensors file of a model folder is malformed (bad JSON, truncated, ...)."""


class UnsupportedConfigError(ModelError, ValueError):
    """A config value or block type that preheat does not implement."""


class WeightsError(ModelError, ValueError):
    """Checkpoint tensors do not match the architecture (missing, extra, shape, dtype)."""


class CheckpointMismatchError(ModelFormatError, WeightsError):
    """A single-file checkpoint whose tensors do not fit the config it is read with: a
    ``ModelFormatError`` to whoever passed the file, a ``WeightsError`` to the loader's callers."""


_Named = TypeVar("_Named", bound="NamesInputs")  # about() builds the class it is called on


class NamesInputs(PreheatError):
    """An error about a call's inputs. ``argument`` names the one it is about (the engine's keyword,
    e.g. ``"steps"``), so that a surface can point at its own field without reading the message.

    An error built by :meth:`about` also knows which inputs its text names: ``renamed`` writes it
    again with each under a surface's own name (``num_inference_steps`` on a server, ``--steps`` on
    the command line), so that no surface rewrites a message's text."""

    def __init__(self, message: str, *, argument: str | None = None):
        super().__init__(message)
        self.argument = argument
        self.template: str | None = None  # ``about``'s template: {0}, {1}, ... are ``names``
        self.names: tuple[str, ...] = ()
        self.values: dict[str, Any] = {}

    @classmethod
    def about(cls: type[_Named], template: str, *names: str, argument: str | None = None,
              **values: Any) -> _Named:
        """An error whose ``template`` names the inputs ``names`` (engine keywords) as ``{0}``, ``{1}``,
        ...; ``values`` fill its other fields (``{value!r}``). ``argument``: ``names[0]`` unless given.
        ``InvalidArgumentError.about("{0}={value!r} must be >= 1", "steps", value=0)``."""
        err = cls(template.format(*names, **values), argument=argument if argument is not None else names[0])
        err.template, err.names, err.values = template, names, values
        return err

    def renamed(self, name_of: Mapping[str, str]) -> str:
        """The message with each input it names as ``name_of`` (keyword -> a surface's name) names it;
        a keyword ``name_of`` lacks, and a message built without :meth:`about`, as they are."""
        if self.template is None:
            return str(self)
        return self.template.format(*(name_of.get(name, name) for name in self.names), **self.values)


class SchedulerConfigError(NamesInputs, ValueError):
    """A scheduler config value or sampler choice that is not supported (``argument``: the call's
    keyword it is about, when one is: ``"sampler"``, ``"steps"``; :meth:`about` as for
    :class:`InvalidArgumentError`)."""


class InvalidArgumentError(NamesInputs, ValueError):
    """A bad argument to a public call (``argument``, :meth:`about`, :meth:`renamed`: see
    :class:`NamesInputs`)."""


class TargetError(InvalidArgumentError):
    """A GPU or TPU compile target (``preheat warm --target``) cannot be used. ``reason`` is
    "unknown" (a name preheat has no description for, a TPU topology larger than a host),
    "malformed" (a description file that does not parse, a TPU shape that is not one), "plugin"
    (no CUDA plugin or libtpu for deviceless compiles) or "memory" (a program needs more memory
    than the target has)."""

    def __init__(self, message: str, *, reason: str, argument: str = "target"):
        super().__init__(message, argument=argument)
        self.reason = reason


class SamplingStopped(PreheatError):
    """A call's progress reporter was stopped (``preheat.progress``): the loop ended early."""


class CacheError(PreheatError):
    """The cache root cannot be used."""


class CacheEntryError(CacheError):
    """One cache entry failed verification; callers quarantine it and recompile."""


class FetchError(PreheatError):
    """A model source cannot be fetched into the store. ``reason``, for a download a client asked
    for, says which guard refused it (``address``, ``size``, ``deadline``, ``busy``, ``invalid``,
    ``http``, ``network``): the server counts refusals by it."""

    def __init__(self, message: str, *, reason: str | None = None):
        super().__init__(message)
        self.reason = reason


# The top-level module -> the extra of pyproject.toml that installs it.
EXTRA_OF_MODULE = {"fastapi": "serve", "uvicorn": "serve", "prometheus_client": "serve", "httpx": "serve",
                   "runpod": "runpod", "ray": "ray", "torch": "torch", "diffusers": "torch",
                   "transformers": "torch", "torchsde": "torch", "huggingface_hub": "hub", "fsspec": "remote",
                   "s3fs": "remote", "sklearn": "train", "matplotlib": "bench", "psutil": "bench", "gguf": "gguf"}


class MissingExtraError(PreheatError, ImportError):
    """An optional extra is not installed: one line naming the ``pip install`` that provides it."""

    def __init__(self, extra: str, what: str, module: str):
        self.extra = extra
        super().__init__(f'{what} needs the {extra} extra: pip install ".[{extra}]" (No module named {module!r})')

    @classmethod
    def of(cls, err: ModuleNotFoundError, what: str) -> "MissingExtraError | None":
        """The error for ``err`` if an extra provides its module; None for any other missing module."""
        module = (err.name or "").split(".")[0]
        extra = EXTRA_OF_MODULE.get(module)
        return None if extra is None else cls(extra, what, module)


class InputError(PreheatError, ValueError):
    """Bad request input. ``errors`` is a list of ``(field, message)``; ``str()`` is one line.
    ``source``: the engine's error it came from, with ``fields`` (keyword -> the field its message
    names it by), so that a surface with other field names (OpenAI's ``n``) can word it again."""

    def __init__(self, errors: list[tuple[str, str]], *, source: NamesInputs | None = None,
                 fields: Mapping[str, str] | None = None):
        self.errors = errors
        self.source, self.fields = source, dict(fields or {})
        super().__init__("; ".join(f"{f}: {m}" for f, m in errors))

    def message(self, rename: Mapping[str, str]) -> str:
        """The first error's message with its fields renamed (``rename``: this surface's field ->
        another surface's name for it), when the engine's error says which inputs it names."""
        if self.source is None:
            return self.errors[0][1]
        return self.source.renamed({k: rename.get(v, v) for k, v in self.fields.items()})


class ServingError(PreheatError):
    """The server cannot take a prediction now (the request itself may be fine: retry later)."""


class QueueFull(ServingError):
    """The bounded queue is full; retry after ``retry_after`` seconds."""

    def __init__(self, depth: int, retry_after: int):
        self.depth, self.retry_after = depth, retry_after
        super().__init__(f"queue full ({depth} predictions waiting); retry in {retry_after}s")


class NotAccepting(ServingError):
    """Predictions are not accepted now: ``reason`` is "starting", "setup_failed" or "draining"."""

    def __init__(self, reason: str, message: str):
        self.reason = reason
        super().__init__(message)
