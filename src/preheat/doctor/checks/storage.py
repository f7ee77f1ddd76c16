"""Check 6: storage -- are the preheat cache and the HF cache on a persistent volume, with room,
and writable."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from preheat.doctor.context import Context
from preheat.doctor.results import _STATUS_ORDER, FAIL, OK, WARN, Check, CheckResult

# Warn when a cache filesystem has less than this free.
MIN_FREE_GIB = 5.0


def _disk_usage(path: Path) -> Any:
    return shutil.disk_usage(path)


def _writable(path: Path) -> bool:
    return os.access(path, os.W_OK | os.X_OK)


def _nearest_existing(path: Path) -> Path:
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _is_under(path: Path, mount: Path) -> bool:
    candidates = {Path(os.path.abspath(path)), Path(os.path.realpath(path))}
    mounts = {Path(os.path.abspath(mount)), Path(os.path.realpath(mount))}
    return any(c == m or m in c.parents for c in candidates for m in mounts)


def _on_runpod() -> bool:
    return any(os.environ.get(k) for k in ("RUNPOD_POD_ID", "RUNPOD_ENDPOINT_ID"))


def _storage_check(
    check_id: str, title: str, path: Path, how: str, fix_var: str, fix_suffix: str, unwritable_status: str
) -> CheckResult:
    from preheat.cache.root import persistent_mounts

    mounts = list(persistent_mounts())
    existing = [m for m in mounts if m.is_dir()]
    near = _nearest_existing(path)
    details: dict[str, Any] = {
        "path": str(path),
        "chosen_by": how,
        "exists": path.exists(),
        "checked_at": str(near),
        "persistent_mounts": [str(m) for m in mounts],
    }
    statuses: list[str] = []
    parts: list[str] = [f"{path} (chosen by: {how}{'' if path.exists() else '; not created yet'})"]
    fixes: list[str] = []

    persistent = next((m for m in mounts if _is_under(path, m)), None)
    details["persistent"] = persistent is not None
    if persistent is not None:
        parts.append(f"on the persistent volume {persistent}")
    elif existing:
        target = existing[0]
        statuses.append(WARN)
        parts.append(f"on the container disk, which is lost when the pod restarts ({target} is a persistent volume)")
        fixes.append(f"export {fix_var}={target}{fix_suffix}")
    elif _on_runpod():
        statuses.append(WARN)
        parts.append(f"this pod has no volume ({' or '.join(map(str, mounts))} missing): everything is lost when it stops")
        fixes.append(f"attach a network volume or volume disk (mounted at {mounts[-1]}) and export {fix_var}={mounts[-1]}{fix_suffix}")
    else:
        parts.append(f"not on a Runpod volume (no {' or '.join(map(str, mounts))} on this machine)")

    try:
        usage = _disk_usage(near)
        free_gib = usage.free / 2**30
        details["free_gib"] = round(free_gib, 2)
        if free_gib < MIN_FREE_GIB:
            statuses.append(WARN)
            parts.append(f"only {free_gib:.1f} GiB free on {near} (< {MIN_FREE_GIB:g} GiB)")
            fixes.append(f"free space on {near} or point {fix_var} at a larger volume")
        else:
            parts.append(f"{free_gib:.0f} GiB free")
    except OSError as exc:
        statuses.append(WARN)
        parts.append(f"cannot read free space of {near}: {exc.strerror or exc}")
        fixes.append(f"point {fix_var} at a readable location")

    writable = _writable(near)
    details["writable"] = writable
    if not writable:
        statuses.append(unwritable_status)
        parts.append(f"{near} is not writable by this user")
        fixes.append(f"chmod u+w {near} (or run as its owner), or export {fix_var}=<a writable folder>")
    status = max(statuses, key=_STATUS_ORDER.__getitem__) if statuses else OK
    return CheckResult(check_id, title, status, "; ".join(parts), " ; ".join(fixes) if fixes else None, details)


def _check_cache_root(ctx: Context) -> CheckResult:
    from preheat.cache.root import resolve_root

    root = resolve_root(create=False)
    return _storage_check("storage_cache", "preheat cache", root.path, root.reason, "PREHEAT_HOME", _preheat_suffix(), FAIL)


def _preheat_suffix() -> str:
    # The same layout resolve_root uses on each volume.
    from preheat.cache.root import persistent_mounts

    mounts = [m for m in persistent_mounts() if m.is_dir()]
    if mounts and mounts[0] == persistent_mounts()[0]:
        return "/preheat"  # Runpod network volume
    return "/.cache/preheat"


def _hf_hub_cache() -> tuple[Path, str, str, str]:
    """(path, how it was chosen, env var to fix it with, suffix under a volume for that var)."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser().absolute(), f"${var} is set", var, "/.cache/huggingface/hub"
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser().absolute() / "hub", "$HF_HOME/hub", "HF_HOME", "/.cache/huggingface"
    if os.environ.get("XDG_CACHE_HOME"):
        return (
            Path(os.environ["XDG_CACHE_HOME"]).expanduser().absolute() / "huggingface" / "hub",
            "$XDG_CACHE_HOME/huggingface/hub",
            "HF_HOME",
            "/.cache/huggingface",
        )
    return Path.home() / ".cache" / "huggingface" / "hub", "default (~/.cache/huggingface/hub)", "HF_HOME", "/.cache/huggingface"


def _check_hf_cache(ctx: Context) -> CheckResult:
    path, how, var, suffix = _hf_hub_cache()
    return _storage_check("storage_hf", "HF cache", path, how, var, suffix, WARN)


STORAGE_CACHE = Check("storage_cache", "preheat cache", _check_cache_root)
STORAGE_HF = Check("storage_hf", "HF cache", _check_hf_cache)
