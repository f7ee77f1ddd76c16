"""The compile key: a fingerprint of everything that changes a compiled program and nothing else.

A program's key (``key_of(key_fields(...))``) names its entry in the cache root and in the fleet's
store, so two processes -- this one tomorrow, a pod, a builder compiling for that pod's GPU
(``target``) -- must compute the same key for the same program, and a different one whenever the
program could differ: the model's architecture, the call's signature, the arguments' shapes, the
machine (``device_fields``, as its platform describes it: ``preheat.platforms``), JAX's versions and
flags, and the source of every preheat module that may be traced into it (``tracing_source_hash``).
Weights are arguments, never part of it, so every fine-tune of one architecture shares one entry.

The key is built from plain JSON (configs, versions, shapes), never from ``repr()`` of NNX
objects, which differs between processes. The torch backend's keys use the same function
(``key_of``). The compilers that use it are in ``preheat.cache.compile``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import jax

from preheat._version import __version__
from preheat import platforms
from preheat.cache.entries import SCHEMA

__all__ = ["key_fields", "key_of", "device_fields", "mesh_of", "traced_sources", "tracing_source_hash"]

# Packages and modules that never run inside a traced program (surfaces, caches, I/O). Every
# other module of preheat -- the engine, samplers, models, families, and any file added to them
# later -- is part of the key, so a new model file cannot be left out of it by accident.
_NOT_TRACED = ("cache", "store", "server", "bench", "backends", "integrations", "train", "doctor", "cli",
               "warm.py", "__main__.py", "_version.py", "errors.py", "timings.py", "files.py", "env.py", "assets")


def traced_sources() -> list[str]:
    """The preheat source files whose code may be traced into a compiled program (relative paths)."""
    base = Path(__file__).resolve().parent.parent
    out = []
    # os.walk, pruning the untraced packages before descending: this runs on every start (the
    # key needs it), and pathlib's rglob + relative_to over every file cost ~20 ms of it
    for folder, dirs, files in os.walk(base):
        rel_dir = os.path.relpath(folder, base).replace(os.sep, "/")
        if rel_dir == ".":
            dirs[:] = [d for d in dirs if d not in _NOT_TRACED]
            rel_dir = ""
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            if not name.endswith(".py"):
                continue
            if rel_dir:
                out.append(f"{rel_dir}/{name}")
            elif name not in _NOT_TRACED and name.removesuffix(".py") not in _NOT_TRACED:
                out.append(name)
    return sorted(out)


@functools.lru_cache(maxsize=1)
def tracing_source_hash() -> str:
    """A hash of ``traced_sources``, names and bytes (once per process)."""
    base = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for rel in traced_sources():
        h.update(rel.encode())
        h.update((base / rel).read_bytes())
    return h.hexdigest()[:16]


def _abstract(tree: Any) -> list[list[Any]]:
    """Shapes and dtypes of every leaf, in order, plus the tree structure's paths."""
    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        shape = list(getattr(leaf, "shape", ()))
        dtype = str(getattr(leaf, "dtype", type(leaf).__name__))
        out.append([jax.tree_util.keystr(path), shape, dtype])
    return out


def mesh_of(args: Any) -> Any:
    """The device mesh a program's arguments are placed on (``preheat.sharding``), or None for
    the single-device program (arguments on the default device or on the host)."""
    for leaf in jax.tree.leaves(args):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, jax.sharding.NamedSharding):
            return sharding.mesh
    return None


def key_fields(fingerprint: dict[str, Any], signature: Any, args: Any, target: Any = None) -> dict[str, Any]:
    """Every input that changes the compiled program, as JSON-able fields (the key's content).

    A program split over devices adds ``mesh``: its axes and the ids of its devices, in order. A
    serialized executable names the devices it runs on, so an entry loads back only onto that
    same assignment (loading a 4-device program onto 2 devices aborts XLA, so it must never be
    tried); the single-device program's key has no such field.

    ``target`` (a deviceless target, ``preheat.cache.targets.Target`` for a GPU): the key of the
    program compiled for that device on this machine (``preheat warm --target``), equal to the key
    a machine with that device computes for itself (``device_fields``)."""
    fields = {
        "schema": SCHEMA,
        "model": fingerprint,
        "signature": json.loads(json.dumps(asdict(signature), default=str)),
        "arguments": hashlib.sha256(json.dumps(_abstract(args)).encode()).hexdigest()[:16],
        **device_fields(args, target),
        "jax": jax.__version__,
        "jaxlib": jax.lib.__version__ if hasattr(jax.lib, "__version__") else _jaxlib_version(),
        "conv_impl": os.environ.get("PREHEAT_CONV", "auto"),  # preheat.models.conv.conv_impl: the traced convs
        "groupnorm_impl": os.environ.get("PREHEAT_GROUPNORM", "auto"),  # ... and groupnorm_impl
        "fp8_1x1_impl": os.environ.get("PREHEAT_FP8_1X1", "auto"),  # ... and fp8_1x1_impl (storage)
        "attention_impl": os.environ.get("PREHEAT_ATTENTION", "auto"),  # preheat.models.attention.attention_for
        "fences": os.environ.get("PREHEAT_FENCES", "auto"),  # preheat.models.conv.fence
        "x64": bool(jax.config.jax_enable_x64),
        "matmul_precision": str(jax.config.jax_default_matmul_precision),
        "preheat": __version__,
        "tracing_source": tracing_source_hash(),
    }
    mesh = mesh_of(args)
    if mesh is not None:
        fields["mesh"] = platforms.mesh_fields(mesh)
    return fields


def device_fields(args: Any, target: Any = None) -> dict[str, Any]:
    """The key fields of the machine a program runs on, as its platform describes them
    (``preheat.platforms``: a CPU's instruction set, a GPU's code fields and CUDA versions, a
    TPU's kind and runtime): the local devices', or ``target``'s in a deviceless compile."""
    mesh = mesh_of(args)
    return platforms.device_fields(None if mesh is None else int(mesh.devices.size), target)


def _jaxlib_version() -> str:
    import jaxlib

    return jaxlib.__version__


def key_of(fields: dict[str, Any]) -> str:
    """The key of ``fields``: a hash of their JSON, keys sorted (32 hex digits, an entry's folder name)."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:32]
