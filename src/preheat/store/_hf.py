"""``hf://org/repo[@revision]``: ``huggingface_hub.snapshot_download`` into ``<root>/models/hf``.

huggingface_hub keeps its own cache there (``models--org--repo/{blobs,snapshots,refs}``); its
files are then hardlinked (copied if that fails) into preheat's blobs after hashing, so the
store does not hold them twice. Only ``*.json``, ``*.safetensors``, ``*.md`` and ``*.txt`` are
fetched: preheat reads safetensors only, and ``*.bin`` / ``*.ckpt`` duplicates can be gigabytes.

Authentication (``HF_TOKEN``), ``HF_ENDPOINT`` and ``HF_HUB_OFFLINE`` are huggingface_hub's own
settings and are honoured by it. Every error becomes one ``FetchError`` line.
"""

from __future__ import annotations

import fnmatch
from pathlib import Path

from preheat.errors import FetchError
from preheat.store._layout import HF_PATTERNS, Source, Store, one_line


def _message(src: Source, exc: BaseException, cache_dir: Path) -> str:
    from huggingface_hub import constants, errors

    first = one_line((str(exc).strip().splitlines() or [type(exc).__name__])[0])
    if isinstance(exc, errors.GatedRepoError):
        return f"{src.text} is gated: accept its terms on huggingface.co, then set HF_TOKEN"
    if isinstance(exc, errors.RepositoryNotFoundError):
        return f"{src.text}: repository not found on the Hugging Face Hub (if it is private, set HF_TOKEN)"
    if isinstance(exc, errors.RevisionNotFoundError):
        return f"{src.text}: revision {src.revision!r} not found on the Hugging Face Hub"
    if isinstance(exc, errors.LocalEntryNotFoundError):
        if constants.HF_HUB_OFFLINE:
            return (f"cannot pull {src.text}: HF_HUB_OFFLINE is set and it is not in the local "
                    f"Hugging Face cache {cache_dir}")
        cause = first[len("Got: "):] if first.startswith("Got: ") else first
        return f"cannot pull {src.text}: the Hugging Face Hub is unreachable ({cause}) and it is not in the local cache"
    return f"cannot pull {src.text}: {type(exc).__name__}: {first}"


def download_hf(store: Store, src: Source, *, progress: bool) -> tuple[Path, str]:
    """Run ``snapshot_download``; returns (its snapshot folder, the resolved commit hash)."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
    except ImportError:
        raise FetchError(f"cannot pull {src.text}: hf:// sources need huggingface_hub (pip install huggingface_hub)") from None
    assert src.repo_id is not None
    was_disabled = are_progress_bars_disabled()
    if not progress:
        disable_progress_bars()
    try:
        folder = snapshot_download(src.repo_id, revision=src.revision, cache_dir=store.hf, allow_patterns=HF_PATTERNS)
    except Exception as exc:  # huggingface_hub, httpx and OSError all land here
        raise FetchError(_message(src, exc, store.hf)) from None
    finally:
        if not progress and not was_disabled:
            enable_progress_bars()
    folder = Path(folder)
    return folder, folder.name


def wanted(rel: str) -> bool:
    name = rel.rsplit("/", 1)[-1]
    return any(fnmatch.fnmatch(name, pat) for pat in HF_PATTERNS)
