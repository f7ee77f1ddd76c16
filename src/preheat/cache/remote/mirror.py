"""The weights mirror: blobs named by their sha256 under ``blobs/<sha256>``. They need no trust
setting: the caller knows the sha256 from a trusted source, and every download is verified.

A pod that mirrors a pulled source also records which blobs it uses: ``refs/<source id>.json``
(``{"format": 1, "source": ..., "blobs": [sha256, ...]}``), written after the blob, in one atomic
PUT (a temp file + rename on a shared folder), like a manifest. Remote prune collects only blobs
that no such record names and that are older than its grace (``preheat.cache.remote.prune``).
Because the record comes after the blob, the writer then checks the blob is still there and
uploads it again if a prune took it meanwhile (it was old and unnamed until the record landed)."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

from preheat.files import fsync_dir
from preheat.files import sha256_file
from preheat.cache.remote.manifest import REF_FORMAT, check_blob_name, check_ref_name
from preheat.cache.remote.policy import MIN_THROUGHPUT_BPS, RemoteError, StorePolicy, _short, log
from preheat.errors import InvalidArgumentError

__all__ = ["WeightsMirror"]


class WeightsMirror(StorePolicy):
    """mirror_get / mirror_put of weight blobs over the store's primitives."""

    def mirror_get(self, name: str, local_path: str | os.PathLike[str]) -> bool:
        """Download blob ``name`` (its sha256) to ``local_path`` (atomically, verified). True on a hit;
        False when absent, unreachable or corrupt (the caller then downloads from the origin)."""
        return self._guarded("mirror get", self._mirror_get, name, local_path, default=False)

    def _mirror_get(self, name: str, local_path: str | os.PathLike[str]) -> bool:
        check_blob_name(name)
        down = self._down()
        if down:
            self._set(f"unreachable: {down}")
            return False
        local_path = Path(local_path)
        local_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = local_path.parent / f".{local_path.name}.mirror-{uuid.uuid4().hex[:8]}"
        try:
            # No size is known up front: the deadline allows a large checkpoint at the slowest rate.
            self._bounded(self._get_file, f"blobs/{name}", tmp, deadline_s=max(self.timeout * 2, 3600.0))
            sha = sha256_file(tmp)
            if sha != name:
                log.warning("preheat cache: mirrored blob %s from %s has sha256 %s; ignoring it", name[:12], self.url,
                            sha[:12])
                self._set("refused: sha256 mismatch")
                return False
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, local_path)
            fsync_dir(local_path.parent)
        except FileNotFoundError:
            self._set("miss")
            return False
        except RemoteError as err:
            self._mark_down(str(err))
            self._set(f"unreachable: {err}")
            return False
        except OSError as exc:
            log.warning("preheat cache: could not write mirrored blob to %s: %s", local_path, exc)
            self._set(f"failed: {_short(exc)}")
            return False
        finally:
            try:
                tmp.unlink()
            except FileNotFoundError:
                pass
        self._set("hit")
        return True

    def mirror_put(self, name: str, local_path: str | os.PathLike[str], *, ref: str | None = None,
                   source: str = "") -> None:
        """Upload ``local_path`` as blob ``name`` unless the store has it; with ``ref`` (the pulled
        source's id), then record ``refs/<ref>.json`` naming the blob, so remote prune keeps it.
        The file's sha256 must be ``name`` (checked first; InvalidArgumentError otherwise). Never
        raises for store problems; ``last`` says what happened."""
        self._guarded("mirror put", self._mirror_put, name, local_path, ref, source, default=None)

    def _mirror_put(self, name: str, local_path: str | os.PathLike[str], ref: str | None = None,
                    source: str = "") -> None:
        check_blob_name(name)
        if ref is not None:
            check_ref_name(ref)
        local_path = Path(local_path)
        down = self._down()
        if down:
            self._set(f"unreachable: {down}")
            return
        try:
            if sha256_file(local_path) != name:
                raise InvalidArgumentError(f"{local_path} does not have sha256 {name}")
            status = "exists" if self._bounded(self._exists, f"blobs/{name}") else self._upload_blob(name, local_path)
            if ref is not None:
                record = {"format": REF_FORMAT, "source": source, "blobs": [name]}
                self._bounded(self._put_bytes, (json.dumps(record, indent=1) + "\n").encode(), f"refs/{ref}.json")
                # a prune that listed the refs before this record landed may have taken the blob
                # (it was old and unnamed): put it back, so the record never names a missing blob
                if not self._bounded(self._exists, f"blobs/{name}"):
                    status = self._upload_blob(name, local_path)
        except RemoteError as err:
            self._mark_down(str(err))
            self._set(f"failed: {err}")
            return
        except FileNotFoundError as err:
            log.warning("preheat cache: not mirroring %s: %s", local_path, err)
            self._set(f"failed: {_short(err)}")
            return
        self._set(status)

    def _upload_blob(self, name: str, local_path: Path) -> str:
        size = local_path.stat().st_size
        self._bounded(self._put_file, local_path, f"blobs/{name}", deadline_s=self.timeout * 2 + size / MIN_THROUGHPUT_BPS)
        return "pushed"
