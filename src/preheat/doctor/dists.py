"""Facts: installed distributions (versions, JAX GPU plugins), read from package metadata only."""

from __future__ import annotations

import re
import sys
from importlib import metadata

from preheat.env import installed_version

_JAX_GPU_PLUGIN_RE = re.compile(r"^(jax-cuda\d+-(plugin|pjrt)|jax-rocm\d+-(plugin|pjrt)|libtpu)$")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _dist_search_path() -> list[str]:
    """Where installed distributions are looked up (tests add a fake site-packages here)."""
    return list(sys.path)


def _distributions() -> dict[str, metadata.Distribution]:
    seen: dict[str, metadata.Distribution] = {}
    for dist in metadata.distributions(path=_dist_search_path()):
        try:
            name = dist.metadata["Name"]
        except Exception:
            continue
        if name and _norm(name) not in seen:
            seen[_norm(name)] = dist
    return seen


def _dist_version(name: str) -> str | None:
    """The seam doctor's checks read versions through (tests replace it)."""
    return installed_version(name)


def _jax_gpu_plugins() -> dict[str, str]:
    out: dict[str, str] = {}
    for name, dist in _distributions().items():
        if _JAX_GPU_PLUGIN_RE.match(name):
            out[name] = dist.version
    return dict(sorted(out.items()))
