"""Which local folder a MODEL argument names, for every surface (``preheat.load``, both backends,
the CLI, the server, ``warm``, Runpod and Ray): one resolution, so that each accepts the same forms.

    None, builtin:NAME     the models shipped in the package (``BUILTIN_MODELS``)
    random:NAME            a random-weight folder, written once under the cache root
                           (``<root>/random/NAME``; ``preheat.bench.random_models``)
    a folder, a file       as it is
    hf://, http(s)://      the weights store's snapshot, pulled once (``preheat.store``)

:func:`check_model` is the cheap part: it fails in one line for a local path that is not there,
before a surface binds a port or imports JAX. :func:`random_defaults` is what a tiny random
model is served and sampled at where no size is given (its tiny size, not its family's).

Imports nothing heavy: no JAX (a ``random:`` name is checked against the builders' table, which
does), no torch until a random folder has to be written.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

from preheat.bench import RANDOM_PREFIX  # beside the builders it names (see tests/test_import_graph.py)
from preheat.errors import InvalidArgumentError, ModelNotFoundError

__all__ = ["BUILTIN_MODEL", "BUILTIN_MODELS", "BUILTIN_PREFIX", "RANDOM_PREFIX", "model_root", "random_defaults",
           "check_model"]

BUILTIN_MODEL = Path(__file__).parent / "assets" / "digits"
# ``builtin:NAME``: the models shipped in the package (trained by ``preheat train-digits`` and
# ``preheat train-text-digits``); no name at all is the digits one.
BUILTIN_MODELS = {"digits": BUILTIN_MODEL, "text-digits": Path(__file__).parent / "assets" / "text_digits"}
BUILTIN_PREFIX = "builtin:"


def _builtin(text: str) -> Path:
    name = text[len(BUILTIN_PREFIX):]
    if name not in BUILTIN_MODELS:
        raise InvalidArgumentError(f"unknown built-in model {text!r}; choose from "
                                   f"{', '.join(BUILTIN_PREFIX + n for n in BUILTIN_MODELS)}", argument="model")
    if not (BUILTIN_MODELS[name] / "model_index.json").is_file():
        raise ModelNotFoundError(f"{text} is not installed ({BUILTIN_MODELS[name]}); "
                                 f"`preheat train-{name} --out DIR` trains it, then pass DIR")
    return BUILTIN_MODELS[name]


def _random_folder(text: str) -> Path:
    """``random:NAME``'s folder under the cache root, written on first use (one line on stderr
    says so: a full-size one takes minutes)."""
    from preheat.bench.random_models import build_random, random_name
    from preheat.cache.root import resolve_root

    name = random_name(text)  # an unknown name fails naming the ones there are
    assert name is not None
    out = resolve_root().path / "random" / name
    if not (out / "model_index.json").is_file():
        print(f"{text}: writing a random-weight folder at {out} (once)", file=sys.stderr)
    return build_random(name, out)


def model_root(model: Any, variant: str | None = None) -> Path:
    """The local folder of a model argument (the forms in the module docstring)."""
    if model is None:
        return BUILTIN_MODEL
    text = str(model)
    if text.startswith(BUILTIN_PREFIX):
        return _builtin(text)
    if text.startswith(RANDOM_PREFIX):
        return _random_folder(text)
    from preheat.store import resolve

    return resolve(text, variant=variant)


def random_defaults(model: Any) -> tuple[Optional[tuple[int, int]], tuple[tuple[str, Any], ...]]:
    """A ``random:NAME`` model's (width, height) where none is given (None: its family's own) and its
    other tiny-scale input defaults (keyword, value); (None, ()) for any other model."""
    if model is None or not str(model).startswith(RANDOM_PREFIX):
        return None, ()
    from preheat.bench.random_models import RANDOM_MODELS, random_name

    spec = RANDOM_MODELS[random_name(str(model)) or ""]
    return spec.size, tuple(spec.inputs)


def check_model(model: Any) -> None:
    """Fail in one line, now, for a model that cannot be there: a local path that does not exist
    (and was never pulled into the store), an unknown ``builtin:`` or ``random:`` name. Reads no
    weights and imports no JAX: what a server runs before it binds its port."""
    if model is None:
        return
    text = str(model)
    if text.startswith(BUILTIN_PREFIX):
        _builtin(text)
        return
    if text.startswith(RANDOM_PREFIX):
        from preheat.bench.random_models import random_name

        random_name(text)
        return
    from preheat.store import parse_source, resolve

    source = parse_source(text)
    if source.kind == "local" and source.path is not None and not source.path.exists():
        resolve(text)  # its stored snapshot if it was pulled once; else one line: the path does not exist
