"""The compile-cache key hashes the code that can be traced, found by walking the package: a new
model or family file is in the key without anyone adding it to a list."""

from __future__ import annotations

from pathlib import Path

import preheat
from preheat.cache.keys import traced_sources

PACKAGE = Path(preheat.__file__).resolve().parent


def test_every_model_sampler_and_family_module_is_in_the_key():
    traced = set(traced_sources())
    for sub in ("models", "samplers", "families"):
        for path in (PACKAGE / sub).rglob("*.py"):
            assert path.relative_to(PACKAGE).as_posix() in traced
    assert {"engine.py", "noise.py"} <= traced


def test_surfaces_are_not_in_the_key():
    traced = set(traced_sources())
    for rel in traced:
        assert rel.split("/")[0] not in ("server", "cache", "store", "bench", "backends", "integrations", "cli",
                                         "warm.py"), rel
    assert not any(rel.startswith("doctor/") for rel in traced)
