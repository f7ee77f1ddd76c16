"""``hf://org/repo[/file.safetensors][@revision]``: what to fetch from the Hub, then fetch only that.

A published pipeline repository holds several times the bytes one pipeline needs: ``.bin`` and
safetensors copies of every weight, several variants (``fp16``, ``non_ema``) and top-level
single-file checkpoints. So a pull first *plans* (``plan_hf``): it lists the repository and reads
its ``model_index.json``, then keeps only

* ``model_index.json``;
* in each component folder that file names: ``*.json`` (configs, shard indexes, tokenizer
  files), ``*.txt`` (merges) and ``*.model`` (sentencepiece), and the ``*.safetensors`` of the
  variant asked for (``<stem>[.<variant>][-00001-of-0000N].safetensors``; ``None``: no variant).

A repository without ``model_index.json`` (one model, a LoRA) keeps ``HF_PATTERNS``;
``hf://org/repo/path/file.safetensors`` (or ``.gguf``) keeps that one file. A source narrowed to some components
(``parse_source(..., components=)``: what a single file of a published model lacks, such as its
tokenizer folders) keeps the same files of those folders only, and skips ``model_index.json``
(the shipped configs have it). The plan is what ``preheat pull
--dry-run`` prints; ``download_hf`` then hands exactly its paths to ``snapshot_download``.

huggingface_hub keeps its own cache under ``<root>/models/hf`` (``models--org--repo/{blobs,
snapshots,refs}``); its files are hardlinked (copied if that fails) into preheat's blobs after
hashing, so the store does not hold them twice. Offline (``HF_HUB_OFFLINE``) or with the Hub
unreachable, the plan is made from that cache's snapshot folder instead of the Hub's listing.

Authentication (``HF_TOKEN``), ``HF_ENDPOINT`` and ``HF_HUB_OFFLINE`` are huggingface_hub's own
settings and are honoured by it. Every fetch error becomes one ``FetchError`` line.
"""

from __future__ import annotations

import fnmatch
import json
import posixpath
import re
from pathlib import Path
from typing import Any, NamedTuple

from preheat.errors import FetchError, ModelFormatError, ModelNotFoundError
from preheat.store._layout import HF_PATTERNS, Source, Store, one_line

COMPONENT_FILES = ("*.json", "*.txt", "*.model")  # configs and indexes; tokenizer vocab/merges/spiece
# <stem>[.<variant>][-NNNNN-of-NNNNN].safetensors: diffusers' and transformers' weight file names
_WEIGHTS = re.compile(r"^[^.]+?(?:\.(?P<variant>.+?))?(?:-\d{5}-of-\d{5})?\.safetensors$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


class RepoFile(NamedTuple):
    path: str  # repository-relative POSIX path
    size: int  # bytes


class HfPlan(NamedTuple):
    """What a pull of an hf:// source fetches, out of everything its repository holds."""

    source: Source
    commit: str  # the resolved commit (the cache's snapshot name when planned offline)
    files: tuple[RepoFile, ...]  # what is fetched, sorted by path
    repo_files: tuple[RepoFile, ...]  # everything in the repository at that commit
    cached: Path | None  # planned from huggingface_hub's cache (offline): its snapshot folder

    @property
    def bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def repo_bytes(self) -> int:
        return sum(f.size for f in self.repo_files)


# ---------------------------------------------------------------------------------------------
# choosing the files (no network)


def _variant_of(name: str) -> str | None:
    m = _WEIGHTS.match(name)
    return m.group("variant") if m else None


def _components(model_index: dict[str, Any]) -> list[str]:
    """The component folders ``model_index.json`` names (``[library, class]`` entries that are not null)."""
    return sorted(k for k, v in model_index.items()
                  if not k.startswith("_") and isinstance(v, list) and len(v) == 2 and all(v))


def select(src: Source, listing: tuple[RepoFile, ...], model_index: dict[str, Any] | None) -> tuple[RepoFile, ...]:
    """The files of ``listing`` that the pull of ``src`` needs (see the module docstring).

    A variant that no component has, or that a component with weights lacks, is a one-line
    ``ModelFormatError`` naming the variants found (a loader would fail on it later, after the bytes).
    """
    if src.filename is not None:
        one = [f for f in listing if f.path == src.filename]
        if not one:
            raise ModelNotFoundError(f"{src.text}: the repository has no file {src.filename}")
        return tuple(one)
    if src.components is not None:  # a single file's missing parts: those folders, no model_index.json
        absent = [c for c in src.components if not any(posixpath.dirname(f.path) == c for f in listing)]
        if absent:
            raise ModelNotFoundError(f"{src.text} has no {', '.join(c + '/' for c in absent)} folder")
        keep, names = [], list(src.components)
    elif model_index is None:
        return tuple(f for f in listing if any(fnmatch.fnmatch(posixpath.basename(f.path), p) for p in HF_PATTERNS))
    else:
        keep, names = [f for f in listing if f.path == "model_index.json"], _components(model_index)
    lacking: dict[str, set[str]] = {}  # component -> the variants it has, when it lacks the one asked for
    seen: set[str] = set()
    for comp in names:
        inside = [f for f in listing if posixpath.dirname(f.path) == comp]
        keep += [f for f in inside if any(fnmatch.fnmatch(posixpath.basename(f.path), p) for p in COMPONENT_FILES)]
        weights = [f for f in inside if f.path.endswith(".safetensors")]
        variants = {_variant_of(posixpath.basename(f.path)) or "default" for f in weights}
        seen |= variants
        chosen = [f for f in weights if _variant_of(posixpath.basename(f.path)) == src.variant]
        if weights and not chosen:
            lacking[comp] = variants
        keep += chosen
    if lacking:
        asked = src.variant or "default"
        found = ", ".join(sorted(seen)) or "none"
        if asked not in seen:
            raise ModelFormatError(f"{src.text} has no {asked!r} weight variant (its safetensors variants: {found})")
        which = "; ".join(f"{c} has only {', '.join(sorted(v))}" for c, v in sorted(lacking.items()))
        raise ModelFormatError(f"{src.text}: not every component has {asked!r} weights ({which})")
    return tuple(sorted(keep))


# ---------------------------------------------------------------------------------------------
# planning and fetching


def _hub() -> Any:
    try:
        import huggingface_hub
    except ImportError:
        raise FetchError("hf:// sources need huggingface_hub (pip install huggingface_hub)") from None
    return huggingface_hub


def _message(src: Source, exc: BaseException, cache_dir: Path) -> str:
    from huggingface_hub import constants, errors

    first = one_line((str(exc).strip().splitlines() or [type(exc).__name__])[0])
    if isinstance(exc, errors.GatedRepoError):
        return f"{src.text} is gated: accept its terms on huggingface.co, then set HF_TOKEN"
    if isinstance(exc, errors.RepositoryNotFoundError):
        return f"{src.text}: repository not found on the Hugging Face Hub (if it is private, set HF_TOKEN)"
    if isinstance(exc, errors.RevisionNotFoundError):
        return f"{src.text}: revision {src.revision!r} not found on the Hugging Face Hub"
    if isinstance(exc, errors.EntryNotFoundError):
        return f"{src.text}: a file is not in the repository ({first})"
    if isinstance(exc, (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled)) or _unreachable(exc):
        if constants.HF_HUB_OFFLINE:
            return (f"cannot pull {src.text}: HF_HUB_OFFLINE is set and it is not in the local "
                    f"Hugging Face cache {cache_dir}")
        cause = first[len("Got: "):] if first.startswith("Got: ") else f"{type(exc).__name__}: {first}"
        return f"cannot pull {src.text}: the Hugging Face Hub is unreachable ({cause}) and it is not in the local cache"
    return f"cannot pull {src.text}: {type(exc).__name__}: {first}"


def _unreachable(exc: BaseException) -> bool:
    """A connection that failed (not an HTTP answer): huggingface_hub's HTTP client, by its name."""
    try:
        import httpx2 as client  # what huggingface_hub >= 2 uses
    except ImportError:
        import httpx as client
    return isinstance(exc, (client.ConnectError, client.TimeoutException))


def _cached_snapshot(store: Store, src: Source) -> Path | None:
    """huggingface_hub's cached snapshot folder for ``src``'s revision, if it has one."""
    assert src.repo_id is not None
    repo_dir = store.hf / ("models--" + src.repo_id.replace("/", "--"))
    rev = src.revision or "main"
    if not _COMMIT.match(rev):
        try:
            rev = (repo_dir / "refs" / rev).read_text().strip()
        except OSError:
            return None
    folder = repo_dir / "snapshots" / rev
    return folder if _COMMIT.match(rev) and folder.is_dir() else None


def _plan_cached(store: Store, src: Source, exc: BaseException) -> HfPlan:
    folder = _cached_snapshot(store, src)
    if folder is None:
        raise FetchError(_message(src, exc, store.hf)) from None
    listing = tuple(sorted(RepoFile(p.relative_to(folder).as_posix(), p.stat().st_size)
                           for p in folder.rglob("*") if p.is_file()))
    index = folder / "model_index.json"
    wanted = src.filename is None and src.components is None
    model_index = _read_index(src, index.read_bytes()) if index.is_file() and wanted else None
    return HfPlan(src, folder.name, select(src, listing, model_index), listing, folder)


def _read_index(src: Source, raw: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        doc = None
    if not isinstance(doc, dict):
        raise ModelFormatError(f"{src.text}: its model_index.json is not a JSON object")
    return doc


def plan_hf(store: Store, src: Source) -> HfPlan:
    """List the repository (or, offline, the cached snapshot) and choose what to fetch."""
    hub = _hub()
    from huggingface_hub import constants, errors
    from huggingface_hub.hf_api import RepoFile as HubFile

    assert src.repo_id is not None
    if constants.HF_HUB_OFFLINE:
        return _plan_cached(store, src, errors.OfflineModeIsEnabled("HF_HUB_OFFLINE is set"))
    api = hub.HfApi()
    try:
        commit = api.repo_info(src.repo_id, revision=src.revision).sha
        listing = tuple(sorted(RepoFile(f.path, int(f.size)) for f in api.list_repo_tree(
            src.repo_id, recursive=True, revision=commit) if isinstance(f, HubFile)))
        model_index = None
        if src.filename is None and src.components is None and any(f.path == "model_index.json" for f in listing):
            index = hub.hf_hub_download(src.repo_id, "model_index.json", revision=commit, cache_dir=store.hf)
            model_index = _read_index(src, Path(index).read_bytes())
    except Exception as exc:  # huggingface_hub, httpx and OSError all land here
        if _unreachable(exc):
            return _plan_cached(store, src, exc)  # as snapshot_download does: the cache, if it has it
        raise FetchError(_message(src, exc, store.hf)) from None
    return HfPlan(src, commit, select(src, listing, model_index), listing, None)


def download_hf(store: Store, plan: HfPlan, *, progress: bool) -> Path:
    """Fetch exactly ``plan.files`` into huggingface_hub's cache; returns its snapshot folder."""
    if plan.cached is not None:
        return plan.cached
    hub = _hub()
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    from preheat.terminal import shown

    src = plan.source
    was_disabled = are_progress_bars_disabled()
    progress = progress and shown()  # bytes, rate, time left: on a terminal only
    if not progress:
        disable_progress_bars()
    try:
        folder = hub.snapshot_download(src.repo_id, revision=plan.commit, cache_dir=store.hf,
                                       allow_patterns=[f.path for f in plan.files])
    except Exception as exc:  # huggingface_hub, httpx and OSError all land here
        raise FetchError(_message(src, exc, store.hf)) from None
    finally:
        if not progress and not was_disabled:
            enable_progress_bars()
    return Path(folder)


def fetch_head(plan: HfPlan, stop: int) -> bytes:
    """The first ``stop`` bytes of a one-file plan's file (``hf://org/repo/file.gguf``), by an HTTP
    Range request: what a dry run reads a single file's header from without fetching its tensors.
    A server that ignores the range is read only that far (the body is streamed, then closed)."""
    hub = _hub()
    from huggingface_hub.utils import build_hf_headers, hf_raise_for_status

    src = plan.source
    (file,) = [f for f in plan.files if f.path == src.filename]
    url = hub.hf_hub_url(src.repo_id, file.path, revision=plan.commit)
    headers = {**build_hf_headers(), "Range": f"bytes=0-{stop - 1}"}
    data = bytearray()
    try:
        with hub.get_session().stream("GET", url, headers=headers, follow_redirects=True) as response:
            hf_raise_for_status(response)
            for chunk in response.iter_bytes():
                data += chunk
                if len(data) >= stop:
                    break
    except Exception as exc:  # huggingface_hub, httpx and OSError all land here
        raise FetchError(_message(src, exc, Path("(no cache: a header read)"))) from None
    return bytes(data[:stop])
