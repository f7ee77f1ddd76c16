"""Remote prune: keep the shared store under a size cap and an age limit while other pods read it.

Readers trust a manifest and then download the objects it names, so the store must never hold a
manifest whose objects are gone, and objects must outlive their manifest long enough for a
reader that read it just before to finish. Pruning is therefore in steps, each guarded by
the protection window ``protect_s`` (the store's own modification times, never this host's idea
of when something happened elsewhere):

1. **Retire** an entry: write ``compile/<kind>/<key>/retired``, then delete its manifest. New
   readers see a miss; the objects stay. An entry whose manifest was published within the
   window is never retired, whatever the cap says.
2. **Collect** objects no manifest names: only those older than the window, in entries whose
   manifest (or retirement) is older than the window too (an overwritten manifest's old objects,
   an interrupted push's leftovers, a retired entry's payload). A writer uploads objects before
   its manifest, so an object younger than the window may be about to be named; it is kept.

An entry's age is its manifest's age (when it was last published): readers do not write, so the
store knows nothing about use. A retired entry that a pod re-pushes is simply live again.

3. **Weight blobs** (``blobs/<sha256>``) that no ``refs/<source id>.json`` names (see
   ``mirror``: a pod records the blobs of a source it mirrors) and that are older than the same
   window: a re-pulled source whose file changed leaves its old blob, a pod killed between the
   blob and its ref leaves one unnamed. Nothing is collected while a ref is unreadable (what it
   names is unknown), nor from a store with no refs at all (its pods predate refs).

   The race: a pod uploads a blob, then writes the ref that names it, while a prune reads the refs
   and then lists the blobs. The prune takes its clock (``now``) first, reads every ref, then
   lists. A blob whose ref it did not see was named after the refs were read, so its upload ended
   at most one request deadline before then: either it is not in the listing yet, or its store
   time is within the window and it stays. The window (an hour by default) must exceed a pod's
   upload time, since S3 dates a multipart object by when its upload began.

   Not covered by the window: a pod naming a blob that was already old and unnamed (it found it
   in the store and did not upload it). The prune may delete it, having listed it before the ref
   landed; so after writing its ref the pod checks the blob and uploads it again if it is gone.
   What is left is a delete that lands after that check: a reader of that blob then misses and
   downloads from the origin (a miss costs time, never correctness: every mirrored blob is
   verified by its sha256), and the next pod that downloads it uploads it again.
"""

from __future__ import annotations

import json
import time
from typing import Any, Optional

from preheat.cache.entries import MANIFEST
from preheat.cache.remote.manifest import KEY_RE, KINDS, MAX_MANIFEST_BYTES, REF_RE, SHA_RE, parse_blob_ref
from preheat.cache.remote.policy import StorePolicy

__all__ = ["RemotePrune", "RETIRED"]

RETIRED = "retired"


class RemotePrune(StorePolicy):
    """``prune_remote`` over the primitives plus ``_files(rel) -> {name: (size, mtime)}`` and ``_delete(rel)``."""

    def _files(self, rel: str) -> dict[str, tuple[int, float]]:
        raise NotImplementedError

    def _delete(self, rel: str) -> None:
        raise NotImplementedError

    def _scan(self, kind: str, key: str) -> dict[str, Any]:
        rel = f"compile/{kind}/{key}"
        top = self._bounded(self._files, rel)
        objects = self._bounded(self._files, f"{rel}/objects")
        named: set[str] = set()
        manifest_t = top.get(MANIFEST, (0, None))[1]
        if manifest_t is not None:
            raw = self._bounded(self._read, f"{rel}/{MANIFEST}", None)
            try:
                files = json.loads(raw or b"{}").get("files", {})
                named = {meta["sha256"] for meta in files.values() if isinstance(meta, dict) and "sha256" in meta}
            except (ValueError, AttributeError, TypeError):
                named = set()  # a garbage manifest names nothing; its entry is retired like any old one
            if raw is None:  # deleted between the listing and the read
                manifest_t = None
        return {"kind": kind, "key": key, "rel": rel, "manifest_t": manifest_t, "named": named,
                "retired_t": top.get(RETIRED, (0, None))[1], "objects": objects,
                "bytes": sum(size for size, _ in objects.values()) + top.get(MANIFEST, (0, 0))[0]}

    def _collect_blobs(self, now: float, protect_s: float, dry_run: bool) -> dict[str, Any]:
        """Step 3 (module docstring): refs first, then the blob listing."""
        named: set[str] = set()
        refs = sorted(n for n in self._bounded(self._files, "refs") if n.endswith(".json") and REF_RE.fullmatch(n[:-5]))
        for name in refs:
            raw = self._bounded(self._read, f"refs/{name}", MAX_MANIFEST_BYTES)
            try:
                named |= parse_blob_ref(raw or b"")
            except ValueError:
                return {"deleted_blobs": 0, "freed_bytes": 0, "blobs_skipped": f"refs/{name} is unreadable"}
        if not refs:
            return {"deleted_blobs": 0, "freed_bytes": 0, "blobs_skipped": "no refs/ records (pods predate them)"}
        deleted = freed = 0
        for sha, (size, t) in sorted(self._bounded(self._files, "blobs").items()):
            if sha in named or not SHA_RE.fullmatch(sha) or _young(now, t, protect_s):
                continue
            if not dry_run:
                self._bounded(self._delete, f"blobs/{sha}")
            deleted += 1
            freed += size
        return {"deleted_blobs": deleted, "freed_bytes": freed, "blobs_skipped": None}

    def prune_remote(self, *, max_bytes: Optional[int] = None, older_than_s: Optional[float] = None,
                     protect_s: float = 3600.0, now: Optional[float] = None, dry_run: bool = False) -> dict[str, Any]:
        """Retire entries published more than ``older_than_s`` ago, then the oldest until the live
        entries fit ``max_bytes``, never one published within ``protect_s``; then collect objects
        no manifest names, and weight blobs no ref names (see the module docstring). ``now``: the
        store's clock (default: this host's). Returns ``{"retired": [keys], "deleted_objects": n,
        "deleted_blobs": n, "freed_bytes": n, "kept_protected": [keys], "live_bytes": n,
        "blobs_skipped": None or why no blob was collected}``. Raises RemoteError when the store
        cannot be listed or written."""
        now = time.time() if now is None else now
        blobs = self._collect_blobs(now, protect_s, dry_run)
        entries = []
        for kind in KINDS:
            for key in sorted(self._bounded(self._list, f"compile/{kind}")):
                if KEY_RE.fullmatch(key):
                    entries.append(self._scan(kind, key))
        live = sorted((e for e in entries if e["manifest_t"] is not None), key=lambda e: e["manifest_t"])
        live_bytes = sum(e["bytes"] for e in live)
        retire, protected = [], []
        for e in live:  # oldest first
            old = older_than_s is not None and now - e["manifest_t"] > older_than_s
            over = max_bytes is not None and live_bytes > max_bytes
            if not (old or over):
                continue
            if _young(now, e["manifest_t"], protect_s):
                protected.append(e["key"])
                continue
            retire.append(e)
            live_bytes -= e["bytes"]
        for e in retire:
            if not dry_run:
                self._bounded(self._put_bytes, json.dumps({"retired_at": now}).encode(), f"{e['rel']}/{RETIRED}")
                self._bounded(self._delete, f"{e['rel']}/{MANIFEST}")  # readers now miss
            e["manifest_t"], e["named"], e["retired_t"] = None, set(), now
        deleted = freed = 0
        for e in entries:
            settled_t = e["manifest_t"] if e["manifest_t"] is not None else e["retired_t"]
            if settled_t is not None and _young(now, settled_t, protect_s):
                continue  # a reader may still hold the previous manifest: its objects stay
            left = 0
            for sha, (size, t) in e["objects"].items():
                if sha in e["named"] or not SHA_RE.fullmatch(sha) or _young(now, t, protect_s):
                    left += 1
                    continue
                if not dry_run:
                    self._bounded(self._delete, f"{e['rel']}/objects/{sha}")
                deleted += 1
                freed += size
            if e["manifest_t"] is None and e["retired_t"] is not None and left == 0 and not dry_run:
                self._bounded(self._delete, f"{e['rel']}/{RETIRED}")
        return {"retired": [e["key"] for e in retire], "deleted_objects": deleted,
                "deleted_blobs": blobs["deleted_blobs"], "freed_bytes": freed + blobs["freed_bytes"],
                "kept_protected": protected, "live_bytes": live_bytes, "blobs_skipped": blobs["blobs_skipped"]}


def _young(now: float, t: float, protect_s: float) -> bool:
    """Written (by the store's clock) within the protection window: never deleted, never retired."""
    return now - t <= protect_s
