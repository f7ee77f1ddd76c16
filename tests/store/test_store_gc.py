"""``collect_orphans``: a re-pull of a changed folder leaves its old snapshot and blob unnamed;
they go once older than the grace period, and what a ref names never does."""

from __future__ import annotations

import time

from preheat.store import collect_orphans, pull, verify_store
from tests._support.store_fixtures import make_model


def test_orphans_of_a_re_pull_are_collected_after_the_grace_period(tmp_path):
    root = tmp_path / "root"
    src = make_model(tmp_path / "model", seed=0)
    first = pull(src, root=root, progress=False)
    weights = src / "unet" / "diffusion_pytorch_model.safetensors"
    make_model(tmp_path / "other", seed=1)
    weights.write_bytes((tmp_path / "other" / "unet" / "diffusion_pytorch_model.safetensors").read_bytes())
    second = pull(src, root=root, progress=False)
    assert first != second and first.is_dir()
    blobs = root / "models" / "blobs"
    before = {p.name for p in blobs.iterdir()}

    assert collect_orphans(root, grace_s=3600) == []  # young: may belong to a pull in progress
    listed = collect_orphans(root, grace_s=3600, now=time.time() + 7200, dry_run=True)
    assert first.exists() and {p.name for p in blobs.iterdir()} == before
    removed = collect_orphans(root, grace_s=3600, now=time.time() + 7200)
    assert removed == listed
    assert removed[0] == f"snapshots/{first.name}" and len(removed) == 2  # the old snapshot and the old weights
    assert not first.exists() and second.is_dir()
    assert not (blobs / removed[1].split("/")[1]).exists()
    assert verify_store(root) == []  # the pulled source is whole
    assert collect_orphans(root, grace_s=0, now=time.time() + 7200) == []  # what a ref names stays


def test_an_unreadable_ref_stops_collection(tmp_path):
    root = tmp_path / "root"
    src = make_model(tmp_path / "model")
    pull(src, root=root, progress=False)
    ref = next((root / "models" / "refs").iterdir())
    ref.write_text("{not json")
    assert collect_orphans(root, grace_s=0, now=time.time() + 10) == []


def test_folders_made_from_the_store_go_with_what_they_were_made_from(tmp_path):
    """A folder beside the store (``models/<kind>/<name>``) that names its inputs
    (``preheat.files.MADE_FROM``, or links for a folder without a record) stays while they do and
    their snapshot is named by a ref; made from a file that is gone, it goes after the grace period,
    as does a stale ``.tmp-*`` folder of a conversion killed mid-write."""
    import os

    from preheat.files import write_made_from

    root = tmp_path / "root"
    snap = pull(make_model(tmp_path / "model"), root=root, progress=False)
    vae = snap / "unet" / "diffusion_pytorch_model.safetensors"  # a snapshot file a ref names
    gone = tmp_path / "gone.safetensors"
    gone.write_bytes(b"x")
    kind = root / "models" / "single"
    live, dead, linked, tmp = kind / "live", kind / "dead", kind / "linked", kind / ".tmp-abc"
    for folder in (live, dead, linked, tmp):
        folder.mkdir(parents=True)
    write_made_from(live, [vae, tmp_path / "model" / "model_index.json"])
    write_made_from(dead, [gone, vae])
    (linked / "vae.safetensors").symlink_to(vae)  # no record: its links are what it was made from
    gone.unlink()
    later = time.time() + 7200

    assert collect_orphans(root, grace_s=3600) == []  # young
    assert collect_orphans(root, grace_s=3600, now=later) == ["single/.tmp-abc", "single/dead"]
    assert live.is_dir() and linked.is_dir() and not dead.exists() and not tmp.exists()
    os.unlink(linked / "vae.safetensors")
    (linked / "vae.safetensors").symlink_to(tmp_path / "nowhere")
    assert collect_orphans(root, grace_s=3600, now=later) == ["single/linked"]
    assert verify_store(root) == []
