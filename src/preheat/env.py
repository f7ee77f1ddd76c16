"""Reading the process environment: one rule for on/off switches, and installed versions."""

from __future__ import annotations

import logging
import os

__all__ = ["CACHE_URL_ENV", "TRUE_VALUES", "FALSE_VALUES", "env_flag", "on_off", "installed_version",
           "quiet_gpu_plugin_failure", "nvidia_device_nodes"]

TRUE_VALUES = ("1", "true", "yes", "on")  # case- and whitespace-insensitive; anything else is off
FALSE_VALUES = ("0", "false", "no", "off")  # what on_off accepts as off
CACHE_URL_ENV = "PREHEAT_CACHE_URL"  # the fleet's shared compile cache (here so that a process
# without one can tell so without importing preheat.cache.remote)


def env_flag(name: str) -> bool:
    """Whether the switch ``name`` is on (``PREHEAT_OFFLINE=1``, ``=true`` ...); unset is off."""
    return os.environ.get(name, "").strip().lower() in TRUE_VALUES


def on_off(value: object, name: str) -> bool:
    """A switch's value given as text (an environment variable, a ``key=value`` option) or a bool:
    :data:`TRUE_VALUES` are on, :data:`FALSE_VALUES` off; anything else is a ValueError naming
    ``name`` (a typo must not silently pick one; callers raise it as their one-line error)."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in TRUE_VALUES or text in FALSE_VALUES:
        return text in TRUE_VALUES
    raise ValueError(f"{name} {value!r} must be on or off (1/0, true/false, yes/no)")


def installed_version(dist: str) -> str | None:
    """The installed distribution's version from package metadata (nothing is imported); None when
    it is not installed or its metadata cannot be read."""
    from importlib import metadata

    try:
        return metadata.version(dist)
    except Exception:  # PackageNotFoundError, or broken metadata: reported as not installed
        return None


def nvidia_device_nodes() -> list[str]:
    """The ``/dev/nvidia*`` nodes a loaded NVIDIA kernel driver makes (``PREHEAT_DEV_ROOT`` instead of
    ``/dev``, for tests), sorted; none on a machine without an NVIDIA GPU."""
    root = os.environ.get("PREHEAT_DEV_ROOT", "/dev")
    try:
        return sorted(name for name in os.listdir(root) if name.startswith("nvidia"))
    except OSError:
        return []


class _PluginFailureFilter(logging.Filter):
    """JAX logs a GPU plugin that cannot start (the CUDA plugin on a machine with no usable driver)
    as a full traceback, then runs on the CPU. Where an NVIDIA driver is loaded (its ``/dev/nvidia*``
    nodes exist), that is a GPU pod about to run on the CPU: keep it visible, as one line. Where
    none is, as on a CPU builder that has the plugin for ``preheat warm --target``, the plugin
    cannot start by design, and a notice on every command would be noise (``doctor`` names the
    plugin and the backend either way)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not message.startswith("Jax plugin configuration error: Exception when calling jax_plugins."):
            return True
        if not nvidia_device_nodes():
            return False
        cause = record.exc_info[1] if record.exc_info else None
        why = (str(cause).splitlines() or [type(cause).__name__])[0].split("; ")[0] if cause is not None else "unknown"
        plugin = message.split("jax_plugins.", 1)[1].split(".", 1)[0]
        record.msg = (f"JAX's {plugin} plugin did not start ({why[:160]}); JAX runs without it "
                      "(`preheat doctor` says why)")
        record.args, record.exc_info, record.exc_text = (), None, None
        return True


def quiet_gpu_plugin_failure() -> None:
    """Install the one-line form of JAX's plugin start-up failure (idempotent; before JAX starts)."""
    logger = logging.getLogger("jax._src.xla_bridge")
    if not any(isinstance(f, _PluginFailureFilter) for f in logger.filters):
        logger.addFilter(_PluginFailureFilter())
