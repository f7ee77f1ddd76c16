"""preheat.env: a GPU plugin that cannot start is one logged line, not a traceback."""

from __future__ import annotations

import io
import logging

import preheat  # noqa: F401 - installs the filter, as any use of preheat does
from preheat.env import quiet_gpu_plugin_failure


def _log_plugin_failure() -> str:
    logger = logging.getLogger("jax._src.xla_bridge")
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger.addHandler(handler)
    try:
        try:  # what jax does when a plugin's initialize() raises
            raise RuntimeError("operation cuInit(0) failed: Unknown CUDA error 303; cuGetErrorName failed")
        except RuntimeError:
            logger.exception("Jax plugin configuration error: Exception when calling %s.initialize()",
                             "jax_plugins.xla_cuda13")
        logger.warning("an unrelated warning")
    finally:
        logger.removeHandler(handler)
    return stream.getvalue()


def test_plugin_failure_is_one_line_naming_plugin_and_cause(tmp_path, monkeypatch):
    """Where an NVIDIA driver's device nodes exist (a GPU pod whose JAX falls back to the CPU)."""
    (tmp_path / "nvidiactl").touch()
    (tmp_path / "nvidia0").touch()
    monkeypatch.setenv("PREHEAT_DEV_ROOT", str(tmp_path))
    quiet_gpu_plugin_failure()  # idempotent: a second install adds no second filter
    lines = _log_plugin_failure().splitlines()
    assert lines[0] == ("JAX's xla_cuda13 plugin did not start (operation cuInit(0) failed: Unknown CUDA error 303); "
                        "JAX runs without it (`preheat doctor` says why)")
    assert lines[1:] == ["an unrelated warning"]  # no traceback; other records untouched
    assert sum(type(f).__name__ == "_PluginFailureFilter"
               for f in logging.getLogger("jax._src.xla_bridge").filters) == 1


def test_plugin_failure_is_silent_where_no_nvidia_driver_is_loaded(tmp_path, monkeypatch):
    """A CPU builder with the CUDA plugin installed (for ``warm --target``) has no ``/dev/nvidia*``: the
    plugin cannot start there by design, so no notice on every command; other records still pass."""
    (tmp_path / "null").touch()
    monkeypatch.setenv("PREHEAT_DEV_ROOT", str(tmp_path))
    assert _log_plugin_failure().splitlines() == ["an unrelated warning"]
    monkeypatch.setenv("PREHEAT_DEV_ROOT", str(tmp_path / "absent"))
    assert _log_plugin_failure().splitlines() == ["an unrelated warning"]
