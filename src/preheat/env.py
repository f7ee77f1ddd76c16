"""Reading the process environment: one rule for on/off switches, and installed versions."""

from __future__ import annotations

import os

__all__ = ["TRUE_VALUES", "env_flag", "installed_version"]

TRUE_VALUES = ("1", "true", "yes", "on")  # case- and whitespace-insensitive; anything else is off


def env_flag(name: str) -> bool:
    """Whether the switch ``name`` is on (``PREHEAT_OFFLINE=1``, ``=true`` ...); unset is off."""
    return os.environ.get(name, "").strip().lower() in TRUE_VALUES


def installed_version(dist: str) -> str | None:
    """The installed distribution's version from package metadata (nothing is imported); None when
    it is not installed or its metadata cannot be read."""
    from importlib import metadata

    try:
        return metadata.version(dist)
    except Exception:  # PackageNotFoundError, or broken metadata: reported as not installed
        return None
