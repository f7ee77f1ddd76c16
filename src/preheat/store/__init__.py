"""The weights store: models pulled once into the cache root, content-addressed and verified.

A restarted pod must not download its checkpoints again, so ``pull`` puts them under the cache
root (``preheat.cache.root.resolve_root()``: ``$PREHEAT_HOME``, the Runpod volume, ...) and
``resolve`` finds them there without touching the network. Laid out like huggingface_hub's cache::

    <root>/models/
    ├── blobs/
    │   └── <sha256>                        file contents, named by their sha256 (read-only)
    ├── snapshots/
    │   └── <snapshot-id>/                  a diffusers-format folder: preheat.load(path) reads it
    │       ├── model_index.json            hardlinks to blobs/ (copies where links fail)
    │       └── unet/config.json ...
    ├── refs/
    │   └── <source-id>                     JSON: source, kind, snapshot id, files (path, sha256,
    │                                       size), created, and per kind: download_sha256 (URLs),
    │                                       repo_id / revision / commit (hf://)
    ├── downloads/
    │   ├── <sha256(url)[:32]>.incomplete       a partial HTTP download, resumed with Range
    │   └── <sha256(url)[:32]>.incomplete.json  its URL, ETag / Last-Modified, announced size
    ├── locks/<source-id>.lock              flock: one pull per source at a time
    └── hf/                                 huggingface_hub's own cache (hf:// sources)

* ``snapshot-id`` = sha256 of the compact JSON of the sorted ``[[path, sha256], ...]`` list, so the
  same files pulled from two sources share one snapshot (and each file is stored once).
* ``source-id`` = ``<kind>-<slug>-<16 hex of sha256(canonical source)>``, e.g.
  ``hf-org-repo-1f2e...``: only ``[A-Za-z0-9._-]``, never hidden, never a path, whatever the source.

SOURCE kinds:

* a local folder: copied into blobs (hidden entries such as ``.git`` / ``.cache`` skipped); a local
  ``.tar``/``.tar.gz``/``.tgz`` file is extracted; any other file is a one-file snapshot.
* ``http(s)://.../x.tar.gz`` (``.tar``, ``.tgz``, ``.tar.bz2``, ``.tar.xz``): a tarball of a diffusers
  folder, extracted safely in one streamed pass (absolute names, ``..``, links leaving the archive
  and device files are refused before any blob is published; a single top-level folder is stripped).
  ``http(s)://.../name.safetensors`` (any other URL): a snapshot holding that one file.
  ``#sha256=<hex>`` on a URL: the downloaded file must have that sha256.
* ``hf://org/repo[@revision]``: only what the pipeline needs -- ``model_index.json``, then in each
  component folder it names the configs, tokenizer files and the safetensors of one variant
  (``variant="fp16"``; default: none), through ``huggingface_hub`` (see ``_hf``); a repository
  without ``model_index.json``: its json, safetensors, md and txt files. ``plan_pull`` lists them and
  their bytes first. ``hf://org/repo/path/file.safetensors`` (or ``.gguf``): that one file, at its path.

Integrity: every blob is a fsynced temp file renamed to ``blobs/<sha256>`` after hashing; a
snapshot is assembled in a temp folder and renamed; the ref is written LAST, atomically. A pull
killed at any moment leaves at most an ``.incomplete`` download, temp files, or unreferenced blobs
and snapshots — never a ref, so ``resolve`` never sees it as pulled. ``resolve`` checks every file's
size on each call (``verify=True``: sha256); ``verify_store`` re-hashes everything.

Offline: ``resolve(offline=True)``, ``$PREHEAT_OFFLINE=1`` or (hf:// only) ``$HF_HUB_OFFLINE=1`` make a
missing or damaged source a one-line ``FetchError`` instead of a download. HTTP timeouts:
``$PREHEAT_HTTP_TIMEOUT`` seconds per connect/read (default 30).
"""

from __future__ import annotations

from typing import Any

from preheat.store._api import Problem, list_refs, plan_pull, pull, resolve, verify_store
from preheat.store._gc import Derived, collect_orphans, derived_folders
from preheat.store._layout import FileEntry, Ref, Source, is_remote, parse_source, snapshot_id, source_id

# Names from the download modules, imported on first use: a start that resolves a local folder or a
# pulled snapshot never needs urllib or huggingface_hub's side (``python -X importtime``).
_LAZY = {"HfPlan": "_hf", "RepoFile": "_hf", "fetch_head": "_hf", "DownloadLimits": "_http", "address_check": "_http",
         "download_limits": "_http"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"preheat.store.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'preheat.store' has no attribute {name!r}")

__all__ = [
    "pull",
    "plan_pull",
    "fetch_head",
    "HfPlan",
    "RepoFile",
    "resolve",
    "address_check",
    "download_limits",
    "DownloadLimits",
    "is_remote",
    "verify_store",
    "collect_orphans",
    "derived_folders",
    "Derived",
    "list_refs",
    "parse_source",
    "source_id",
    "snapshot_id",
    "Problem",
    "Ref",
    "FileEntry",
    "Source",
]
