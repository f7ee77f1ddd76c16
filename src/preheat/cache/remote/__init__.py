"""A cache shared by a fleet of pods: compile entries (and weight blobs) in a remote store.

``PREHEAT_CACHE_URL`` names the store (``preheat --cache-url`` sets it):

    s3://bucket/prefix          S3, Cloudflare R2, MinIO, Runpod's S3-compatible volume API (s3fs)
    gs://..., az://..., ...     any other fsspec URL (its fsspec package must be installed)
    /mnt/shared/preheat         a shared folder (a network volume); also file:///mnt/shared/preheat

S3 endpoint and credentials are taken the standard way: ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_PROFILE``, ``AWS_DEFAULT_REGION``,
``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` or fsspec's config (``FSSPEC_S3_ENDPOINT_URL``,
``FSSPEC_S3`` JSON, ``~/.config/fsspec/*.json``; fsspec's config wins over the AWS variables).

Layout under the URL::

    compile/<kind>/<key>/manifest.json          the local manifest (+ signature), published LAST
    compile/<kind>/<key>/objects/<sha256>       payload files, content-addressed
    blobs/<sha256>                              weight blobs (``mirror_get`` / ``mirror_put``)
    refs/<source id>.json                       the blobs a mirrored source uses, written after them

Reading (``fetch``, on a local miss): the manifest is read, checked (schema, kind, key, simple
file names, 64-hex sha256s, size cap) and, with a signing key, its HMAC verified; each payload
object is downloaded into a local temp folder and its sha256 and size checked against the
manifest; then the folder is published into the local root with the same atomic rename as a local
write. A reader trusts nothing else: no manifest, no entry.

Writing (``push``, after a local compile): payload objects first, each under its own sha256,
then the manifest. On object stores one PUT is atomic; on a shared folder every file is written
under a temp name and renamed. Because payloads are content-addressed, two pods that compile the
same key at once (serialized executables need not be byte-identical) each upload their own bytes,
and whichever manifest lands last points at bytes that are complete: no manifest ever names
another writer's payload. Objects are never deleted by readers or writers (an overwritten
manifest leaves an orphan object; ``RemoteStore.verify`` reports entries, not orphans).

Trust: with ``PREHEAT_CACHE_SIGNING_KEY`` set, pushed manifests are signed and fetched ones must
verify (unsigned or badly signed entries are refused, logged, recompiled locally and the push
replaces them). Without a key, remote compile entries are used only with
``PREHEAT_TRUST_REMOTE_CACHE=1``; otherwise the store is not used for compile entries (fetch or
push) and a warning says why. Weight blobs need no trust setting: they are named by their sha256,
which the caller knows from a trusted source, and verified on download.

Failure: every remote operation runs under a hard deadline (``PREHEAT_CACHE_REMOTE_TIMEOUT``
seconds, default 5, per request; a download gets that plus one second per MB). A store that is
down, slow or refuses access costs at most one deadline: the process logs a warning, compiles
locally, and skips the store for ``DOWN_COOLDOWN_S`` seconds. Nothing here raises to the caller
except ``InvalidArgumentError`` for a malformed kind, key or blob name passed in by code.

Where things are: ``manifest`` (the manifest and signature checks), ``policy`` (trust, deadlines,
cooldown, ``last``), ``compile_entries`` (fetch / push / verify), ``mirror`` (weight blobs),
``transport`` (``RemoteStore`` and the folder and fsspec stores), ``env`` (construction from
``PREHEAT_CACHE_URL`` and the module-level helpers).
"""

from __future__ import annotations

from preheat.cache.remote.env import child_env, default_store, describe, mirror_get, mirror_put, open_store, remote_from_env
from preheat.cache.remote.manifest import (
    KEY_RE,
    KINDS,
    MAX_MANIFEST_BYTES,
    NAME_RE,
    SHA_RE,
    check_blob_name,
    check_file_name,
    check_kind_key,
    check_manifest,
)
from preheat.cache.remote.policy import (
    DEFAULT_TIMEOUT_S,
    DOWN_COOLDOWN_S,
    ENV_TIMEOUT,
    ENV_TRUST,
    ENV_URL,
    MIN_THROUGHPUT_BPS,
    RemoteError,
)
from preheat.cache.remote.transport import FsspecStore, LocalDirStore, RemoteStore

__all__ = [
    # stores and their construction (transport, env)
    "RemoteStore", "FsspecStore", "LocalDirStore", "remote_from_env", "open_store", "default_store",
    "mirror_get", "mirror_put", "child_env", "describe",
    # trust, deadlines and cooldown (policy)
    "RemoteError", "ENV_URL", "ENV_TRUST", "ENV_TIMEOUT", "DEFAULT_TIMEOUT_S", "DOWN_COOLDOWN_S", "MIN_THROUGHPUT_BPS",
    # the manifest's checks and limits (manifest)
    "KINDS", "KEY_RE", "NAME_RE", "SHA_RE", "MAX_MANIFEST_BYTES", "check_kind_key", "check_blob_name",
    "check_file_name", "check_manifest",
]
