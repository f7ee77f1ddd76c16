"""A clean virtual environment with no way to reach a package registry, for the install tests.

It is a new venv (no system site-packages, no pip of its own) whose only packages are *this*
environment's (the one ``make test`` built), minus the distributions named: each top-level
entry of this environment's site-packages is linked into one folder that the new venv puts on
its path with a ``.pth`` line. That folder is not a site directory, so the ``.pth`` files in it
(the editable install of preheat among them) are never run, and pip sees those packages as
installed outside the venv: it can read them but never uninstall them.

So ``clean_venv(dir, exclude={"preheat", "diffusers"})`` looks like the GPU machine (its Python
with jax, torch, ... but no preheat and no diffusers), and ``exclude={"preheat"}`` like a
newcomer's machine where the dependencies are already there. ``offline_env`` leaves pip no
index, no config file (which may name one) and a dead proxy, so any attempt to download fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

__all__ = ["clean_venv", "offline_env", "dist_name"]

_DEAD_PROXY = "http://127.0.0.1:9"  # the discard port: nothing listens, connections are refused


def dist_name(entry: str) -> str:
    """The normalised distribution name of a site-packages entry ("Foo_Bar-1.0.dist-info" -> "foo-bar")."""
    stem = entry.split("-", 1)[0] if entry.endswith((".dist-info", ".egg-info")) else entry.split(".", 1)[0]
    return stem.lower().replace("_", "-")


def clean_venv(root: Path, exclude: set[str]) -> Path:
    """Create ``root/venv`` as described above; returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "venv")], check=True,
                   capture_output=True, timeout=120)
    python = root / "venv" / "bin" / "python"
    overlay = root / "overlay"
    overlay.mkdir()
    sources = {Path(sysconfig.get_paths()[k]) for k in ("purelib", "platlib")}
    for site in sorted(sources):
        for entry in sorted(site.iterdir()):
            if entry.suffix == ".pth" or entry.name.startswith("__editable__") or dist_name(entry.name) in exclude:
                continue
            if not (overlay / entry.name).exists():
                (overlay / entry.name).symlink_to(entry)
    venv_site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True, timeout=60).stdout.strip()
    (Path(venv_site) / "_clean_env_overlay.pth").write_text(f"{overlay}\n")
    return python


def offline_env(**extra: str) -> dict[str, str]:
    """os.environ without pip settings, PYTHONPATH or XLA_FLAGS (the suite's fake devices), with
    installs from the network off. The suite's XLA optimisation level stays (compile time only)."""
    drop = ("PYTHONPATH", "VIRTUAL_ENV", "XLA_FLAGS")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k not in drop
           and k.lower() not in ("http_proxy", "https_proxy", "all_proxy", "no_proxy")}
    level = [f for f in os.environ.get("XLA_FLAGS", "").split() if f.startswith("--xla_backend_optimization_level")]
    if level:
        env["XLA_FLAGS"] = " ".join(level)
    env.update(PIP_NO_INDEX="1", PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1",
               HTTP_PROXY=_DEAD_PROXY, HTTPS_PROXY=_DEAD_PROXY, http_proxy=_DEAD_PROXY, https_proxy=_DEAD_PROXY,
               HF_HUB_OFFLINE="1")
    env.update(extra)
    return env
