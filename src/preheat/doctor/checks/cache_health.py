"""Check 7: cache health -- what `preheat cache verify` checks: compiled entries and the weights store."""

from __future__ import annotations

from pathlib import Path

from preheat.doctor.context import Context
from preheat.doctor.results import OK, WARN, Check, CheckResult

def _check_cache_health(root: Path) -> CheckResult:
    """Entry count, size, and entries that fail verification (what `preheat cache verify` checks)."""
    from preheat.cache.manage import verify_entries
    from preheat.store import verify_store

    title = "Cache health"
    if not root.exists():
        return CheckResult("cache_health", title, OK, f"{root} does not exist yet: nothing cached", None, {"root": str(root)})
    infos = verify_entries(root)
    store_problems = verify_store(root)
    size = sum(i.size for i in infos)
    bad = [i for i in infos if not i.ok]
    details = {"root": str(root), "entries": len(infos), "bytes": size, "bad": [f"{i.kind}/{i.key}" for i in bad],
               "store_problems": [str(p) for p in store_problems]}
    finding = f"{len(infos)} compiled entries ({size / 1e6:.1f} MB)"
    if bad or store_problems:
        what = [f"{len(bad)} compile entries fail verification"] if bad else []
        what += [f"{len(store_problems)} weights-store problems"] if store_problems else []
        return CheckResult("cache_health", title, WARN, f"{finding}; {', '.join(what)} (they are recompiled or re-fetched)",
                           "preheat cache verify --quarantine && preheat cache prune", details)
    return CheckResult("cache_health", title, OK, f"{finding}, all verify; weights store verifies", None, details)


def _check_cache(ctx: Context) -> CheckResult:
    from preheat.cache.root import resolve_root

    return _check_cache_health(resolve_root(create=False).path)


CACHE_HEALTH = Check("cache_health", "Cache health", _check_cache)
