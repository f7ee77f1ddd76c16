"""pull / resolve / verify_store: the public functions of ``preheat.store``."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from preheat.cache.root import resolve_root
from preheat.env import env_flag
from preheat.errors import FetchError, InvalidArgumentError, ModelNotFoundError
from preheat.files import sha256_and_size
from preheat.timings import now_iso
from preheat.store._ingest import (adopt_file, build_snapshot, extract_tar, link_into_blobs,
                                   scan_folder, snapshot_problems, write_blob)
from preheat.store._layout import (HEX64, FileEntry, Ref, Source, Store, is_tar_name, parse_ref,
                                   parse_source, snapshot_id, url_filename)

if TYPE_CHECKING:
    from preheat.store._hf import HfPlan

# ``_http`` (urllib) and ``_hf`` (huggingface_hub's side) are imported by the functions that
# download: resolving a local folder or a pulled snapshot, what every start does, needs neither.


def _store(root: str | os.PathLike[str] | None) -> Store:
    return Store(Path(root).expanduser().absolute() if root is not None else resolve_root().path)


def _ref_ok(store: Store, ref: Ref, src: Source, *, deep: bool) -> list[str]:
    problems = snapshot_problems(store.snapshot_dir(ref.snapshot), ref.files, deep=deep)
    if src.sha256 and ref.extra.get("download_sha256") != src.sha256:
        problems.append(f"the stored download has sha256 {ref.extra.get('download_sha256')}, not the requested {src.sha256}")
    return problems


def _one_line(problems: list[str]) -> str:
    more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
    return problems[0] + more


# ---------------------------------------------------------------------------------------------
# pull


def pull(source: str | os.PathLike[str], *, root: str | os.PathLike[str] | None = None, progress: bool = True,
         revision: str | None = None, force: bool = False, variant: str | None = None,
         check: Callable[[Path], None] | None = None, components: Sequence[str] | None = None) -> Path:
    """Put ``source`` into ``<root>/models`` and return its snapshot folder.

    A remote source already pulled (and whose files still have their recorded sizes) is returned
    without any network access; ``force=True`` fetches it again and re-checks every existing blob
    by sha256 (this repairs a damaged store). A local folder is always re-read (it may have
    changed); unchanged files cost a hash and no space (blobs are deduplicated).
    ``variant``: an hf:// pipeline pulls that weight variant's files ("fp16"; ``None``: the default ones).
    ``components``: an hf:// pipeline pulls only those component folders (what a single file lacks).
    ``check`` (http(s) files only) is called with the downloaded file before anything is
    published; when it raises, the download is discarded and the store holds nothing new.
    """
    src = parse_source(source, revision, variant, components)
    store = _store(root)
    store.ensure()

    def waiting() -> None:
        if progress:
            print(f"waiting for another preheat process pulling {src.text} ...", file=sys.stderr)

    with store.lock(src.id, on_wait=waiting):
        ref = store.read_ref(src.id)
        reusable = ref is not None and not force and not _ref_ok(store, ref, src, deep=False)
        if src.kind == "local":
            assert src.path is not None
            if not src.path.exists():
                if reusable:
                    assert ref is not None
                    return store.snapshot_dir(ref.snapshot)
                raise ModelNotFoundError(f"model path {src.path} does not exist")
            return _pull_local(store, src, force=force)
        if reusable:
            assert ref is not None
            return store.snapshot_dir(ref.snapshot)
        if src.kind == "url":
            return _pull_url(store, src, progress=progress, force=force, check=check)
        return _pull_hf(store, src, progress=progress, force=force)


def _publish(store: Store, src: Source, kind: str, entries: list[FileEntry], *, force: bool, **extra: object) -> Path:
    """Snapshot first, ref LAST: until the ref is written nothing counts as pulled."""
    snap = build_snapshot(store, entries, deep=force)
    entries = sorted(entries, key=lambda e: e.path)
    ref = Ref(src.id, src.key, kind, snapshot_id(entries), entries, now_iso(),
              {k: v for k, v in extra.items() if v is not None})
    store.write_ref(ref)
    return snap


def _pull_local(store: Store, src: Source, *, force: bool) -> Path:
    path = src.path
    assert path is not None
    if path.is_dir():
        entries = []
        for rel, f in scan_folder(path):
            with open(f, "rb") as fh:
                sha, size = write_blob(store, fh, check_existing=force)
            entries.append(FileEntry(rel, sha, size))
        return _publish(store, src, "folder", entries, force=force)
    if is_tar_name(path.name):
        return _publish(store, src, "tar", extract_tar(store, path, str(path), check_existing=force), force=force)
    with open(path, "rb") as fh:
        sha, size = write_blob(store, fh, check_existing=force)
    return _publish(store, src, "file", [FileEntry(path.name, sha, size)], force=force)


def _pull_url(store: Store, src: Source, *, progress: bool, force: bool,
              check: Callable[[Path], None] | None = None) -> Path:
    from preheat.store import _http

    url = src.url
    assert url is not None
    tar = is_tar_name(url.split("?", 1)[0])
    name = None if tar else url_filename(url)
    part = _from_fleet_mirror(store, src) or _http.download(store, url, progress=progress)
    if check is not None:
        try:
            check(part)
        except BaseException:
            _http.discard_partial(store, url)
            raise
    sha, size = sha256_and_size(part)  # verify what is on disk, not what we think we wrote
    _share_with_fleet(sha, part, src)
    if src.sha256 and sha != src.sha256:
        _http.discard_partial(store, url)
        raise FetchError(f"sha256 mismatch for {url}: expected {src.sha256}, got {sha} (download discarded)")
    if tar:
        entries = extract_tar(store, part, url, check_existing=force)
        snap = _publish(store, src, "tar", entries, force=force, download_sha256=sha, download_size=size)
        _http.discard_partial(store, url)
        return snap
    assert name is not None
    adopt_file(store, part, sha, size, check_existing=force)
    _http.discard_partial(store, url)
    return _publish(store, src, "file", [FileEntry(name, sha, size)], force=force,
                    download_sha256=sha, download_size=size)


def _from_fleet_mirror(store: Store, src: Source) -> Path | None:
    """The download from the fleet's shared store (``PREHEAT_CACHE_URL``), when the source pins its
    sha256 (``#sha256=``): a fleet then downloads a checkpoint from the internet once. Without a
    pinned hash there is nothing trustworthy to look the blob up by, so the origin is used."""
    if not src.sha256 or src.url is None:
        return None
    from preheat.cache.remote import mirror_get
    from preheat.store import _http

    part, _ = _http.partial_paths(store, src.url)
    return part if mirror_get(src.sha256, part) else None


def _share_with_fleet(sha: str, path: Path, src: Source) -> None:
    from preheat.cache.remote import mirror_put

    # no-op without a shared store; never raises for store problems. The ref records that this
    # source uses the blob, so a remote prune keeps it (the URL's query, which may hold a token, is left out).
    mirror_put(sha, path, ref=src.id, source=src.text.split("?", 1)[0])


def plan_pull(source: str | os.PathLike[str], *, root: str | os.PathLike[str] | None = None,
              revision: str | None = None, variant: str | None = None,
              components: Sequence[str] | None = None) -> HfPlan:
    """What ``pull`` would fetch for an hf:// source, and what its repository holds (no download)."""
    from preheat.store import _hf

    src = parse_source(source, revision, variant, components)
    if src.kind != "hf":
        raise InvalidArgumentError(f"a pull plan lists hf:// sources; {src.text} is {src.kind} and is pulled whole",
                                   argument="source")
    return _hf.plan_hf(_store(root), src)


def _pull_hf(store: Store, src: Source, *, progress: bool, force: bool) -> Path:
    from preheat.store import _hf

    plan = _hf.plan_hf(store, src)
    if not plan.files:
        raise FetchError(f"{src.text} has no *.json / *.safetensors files (preheat reads safetensors only)")
    folder = _hf.download_hf(store, plan, progress=progress)
    entries = []
    for want in plan.files:  # only the plan's files: the cache's snapshot may hold other variants too
        f = folder / want.path
        if not f.is_file():
            raise FetchError(f"cannot pull {src.text}: {want.path} is missing from the Hugging Face cache {folder}")
        sha, size = link_into_blobs(store, f, check_existing=force)
        entries.append(FileEntry(want.path, sha, size))
    return _publish(store, src, "hf", entries, force=force, repo_id=src.repo_id, revision=src.revision,
                    commit=plan.commit, variant=src.variant, file=src.filename,
                    components=None if src.components is None else list(src.components))


# ---------------------------------------------------------------------------------------------
# resolve


def _offline_reason(src: Source, offline: bool | None) -> str | None:
    if offline is not None:
        return "offline=True" if offline else None
    if env_flag("PREHEAT_OFFLINE"):
        return "PREHEAT_OFFLINE is set"
    if src.kind == "hf" and env_flag("HF_HUB_OFFLINE"):
        return "HF_HUB_OFFLINE is set"
    return None


def resolve(source: str | os.PathLike[str], *, root: str | os.PathLike[str] | None = None,
            offline: bool | None = None, verify: bool = False, progress: bool = True,
            variant: str | None = None, components: Sequence[str] | None = None) -> Path:
    """The local folder for ``source``; never touches the network for something already stored.

    * a local folder that exists: returned as given (no copy); one that no longer exists but was
      pulled: its stored snapshot; a local ``.tar*`` file: its snapshot (ingested on first use).
    * ``http(s)://`` / ``hf://``: the stored snapshot when its ref exists and every file has its
      recorded size (``verify=True``: and sha256); otherwise it is pulled — unless offline
      (``offline=True``, ``$PREHEAT_OFFLINE=1``, or for hf:// ``$HF_HUB_OFFLINE=1``), which raises
      a one-line ``FetchError``.
    ``variant``, ``components``: as for ``pull`` (hf:// pipelines only; a one-file hf:// source
    ignores the variant).
    """
    src = parse_source(source)
    if (variant is not None or components is not None) and src.kind == "hf" and src.filename is None:
        src = parse_source(source, variant=variant, components=components)
    if src.kind == "local":
        assert src.path is not None
        given = Path(os.fspath(source)).expanduser() if not str(source).lower().startswith("file:") else src.path
        if src.path.is_dir() or (src.path.exists() and not is_tar_name(src.path.name)):
            return given
    store = _store(root)
    ref = store.read_ref(src.id)
    problems: list[str] = []
    if ref is not None:
        problems = _ref_ok(store, ref, src, deep=verify)
        if not problems:
            return store.snapshot_dir(ref.snapshot)
    if src.kind == "local":
        assert src.path is not None
        if not src.path.exists():
            if ref is not None:
                raise ModelNotFoundError(f"model path {src.path} does not exist and its stored copy is damaged: {_one_line(problems)}")
            raise ModelNotFoundError(f"model path {src.path} does not exist")
        return pull(src.path, root=store.root, progress=progress, force=ref is not None)
    why = _offline_reason(src, offline)
    if why:
        if ref is not None:
            raise FetchError(f"stored copy of {src.text} is damaged ({_one_line(problems)}) and {why}; "
                             f"run `preheat pull --force {src.given}` with network")
        raise FetchError(f"{src.text} is not in the store ({store.models}) and {why}; run `preheat pull {src.given}` first")
    return pull(src.given, root=store.root, progress=progress, force=ref is not None, variant=src.variant,
                components=src.components)


# ---------------------------------------------------------------------------------------------
# inspection


@dataclass(frozen=True)
class Problem:
    """One thing wrong in the store: the path concerned and a one-line message."""

    path: Path
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


def list_refs(root: str | os.PathLike[str] | None = None) -> list[Ref]:
    """Every readable ref in the store (what has been pulled), sorted by source id."""
    store = _store(root)
    return [r for sid in store.ref_ids() if (r := store.read_ref(sid)) is not None]


def verify_store(root: str | os.PathLike[str] | None = None) -> list[Problem]:
    """Re-hash every blob and every file of every ref'd snapshot; [] when the store is sound.

    Reported: blobs whose content does not match their name, unreadable or malformed refs, refs
    whose snapshot is missing files, has wrong sizes or wrong content, or whose blobs are gone.
    Not reported: ``.tmp-*`` leftovers, ``.incomplete`` downloads, unreferenced snapshots/blobs.
    """
    store = _store(root)
    problems: list[Problem] = []
    good: set[tuple[int, int]] = set()
    if store.blobs.is_dir():
        for name in sorted(os.listdir(store.blobs)):
            if name.startswith("."):
                continue
            p = store.blobs / name
            if not HEX64.match(name) or not p.is_file():
                problems.append(Problem(p, "unexpected entry in blobs/ (not named by a sha256)"))
                continue
            try:
                sha, _ = sha256_and_size(p)
            except OSError as exc:
                problems.append(Problem(p, f"unreadable blob ({exc.strerror or exc})"))
                continue
            if sha != name:
                problems.append(Problem(p, f"corrupt blob: its content has sha256 {sha}"))
            else:
                st = p.stat()
                good.add((st.st_dev, st.st_ino))
    if store.refs.is_dir():
        for name in sorted(os.listdir(store.refs)):
            if name.startswith("."):
                continue
            rp = store.refs / name
            try:
                ref = parse_ref(name, rp.read_bytes())
            except (OSError, ValueError) as exc:
                problems.append(Problem(rp, f"unreadable ref: {exc}"))
                continue
            snap = store.snapshot_dir(ref.snapshot)
            if not snap.is_dir():
                problems.append(Problem(snap, f"snapshot of {ref.source} is missing"))
                continue
            for e in ref.files:
                f = snap / e.path
                if not (store.blobs / e.sha256).is_file():
                    problems.append(Problem(store.blobs / e.sha256, f"blob of {e.path} ({ref.source}) is missing"))
                bad = snapshot_problems(snap, [e], deep=False)
                if not bad:
                    st = f.stat()
                    if (st.st_dev, st.st_ino) in good and (store.blobs / e.sha256).stat().st_ino == st.st_ino:
                        continue  # the very blob already verified above
                    bad = snapshot_problems(snap, [e], deep=True)
                for b in bad:
                    problems.append(Problem(f, f"{b} (snapshot of {ref.source})"))
    return problems

