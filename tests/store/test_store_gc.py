"""``collect_orphans``: a re-pull of a changed folder leaves its old snapshot and blob unnamed;
they go once older than the grace period, and what a ref names never does."""

from __future__ import annotations

import time
from pathlib import Path
from typing import NamedTuple

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
    their snapshot is named by a ref; made from a store file that is gone, it goes after the grace
    period, as does a stale ``.tmp-*`` folder of a conversion killed mid-write. Made from a file
    outside the cache root that is missing, it stays (the drive may be unmounted) until
    ``drop_missing_sources``."""
    import os

    from preheat.files import write_made_from
    from preheat.store import derived_folders

    root = tmp_path / "root"
    snap = pull(make_model(tmp_path / "model"), root=root, progress=False)
    vae = snap / "unet" / "diffusion_pytorch_model.safetensors"  # a snapshot file a ref names
    gone = tmp_path / "gone.safetensors"
    gone.write_bytes(b"x")
    kind = root / "models" / "single"
    live, dead, linked, tmp, away = (kind / n for n in ("live", "dead", "linked", ".tmp-abc", "away"))
    for folder in (live, dead, linked, tmp, away):
        folder.mkdir(parents=True)
    inside = root / "models" / "random" / "was-here.safetensors"  # a store-side input, removed
    write_made_from(live, [vae, tmp_path / "model" / "model_index.json"])
    write_made_from(dead, [inside, vae])
    write_made_from(away, [gone, vae])
    (linked / "vae.safetensors").symlink_to(vae)  # no record: its links are what it was made from
    gone.unlink()
    later = time.time() + 7200

    assert collect_orphans(root, grace_s=3600) == []  # young
    young = {d.name: d for d in derived_folders(root, grace_s=3600)}  # dead already, and says so; kept a while
    assert young["single/dead"].state == "dead" and not young["single/dead"].collect
    assert "; kept until " in young["single/dead"].why and young["single/live"].state == "live"
    states = {d.name: d.state for d in derived_folders(root, grace_s=3600, now=later)}
    assert states == {"single/.tmp-abc": "stale-tmp", "single/away": "missing-source", "single/dead": "dead",
                      "single/linked": "live", "single/live": "live"}
    assert collect_orphans(root, grace_s=3600, now=later) == ["single/.tmp-abc", "single/dead"]
    assert live.is_dir() and linked.is_dir() and away.is_dir() and not dead.exists() and not tmp.exists()
    os.unlink(linked / "vae.safetensors")
    (linked / "vae.safetensors").symlink_to(tmp_path / "nowhere")  # outside the root, missing: kept too
    assert collect_orphans(root, grace_s=3600, now=later) == []
    assert collect_orphans(root, grace_s=3600, now=later, drop_missing_sources=True, dry_run=True) == [
        "single/away", "single/linked"]
    assert collect_orphans(root, grace_s=3600, now=later, drop_missing_sources=True) == ["single/away", "single/linked"]
    assert not away.exists() and not linked.exists() and live.is_dir()
    assert verify_store(root) == []


def test_a_conversion_of_an_unmounted_file_is_kept_and_read_again_once_it_is_back(tmp_path, monkeypatch):
    """A real single file on a "drive" outside the cache root, converted; the drive unmounted (the
    folder moved away): `cache prune` keeps the conversion and says why, `cache ls` too; mounted again,
    the same conversion is what the file reads as (not converted again). Its snapshot's ref moved by a
    re-pull, the conversion goes whatever its source."""
    import os

    from click.testing import CliRunner
    from safetensors.numpy import save_file

    from preheat.cli import main
    from preheat.models.single_file import materialize
    from preheat.store import _gc
    from tests._support.ldm_files import to_original
    from tests._support.sd_fixtures import save_tiny_sd

    root = tmp_path / "home"
    monkeypatch.setenv("PREHEAT_HOME", str(root))
    folder = save_tiny_sd(tmp_path / "sd1", kind="sd1")
    config = pull(folder, root=root, progress=False)  # the config folder from the store, as hf:// gives it
    drive = tmp_path / "mnt"
    drive.mkdir()
    path = drive / "tiny-sd1.safetensors"
    save_file(to_original(folder, "sd1"), str(path))
    converted = materialize(path, config, root)
    made = (converted / "unet" / "diffusion_pytorch_model.safetensors").stat().st_mtime_ns
    monkeypatch.setattr(_gc.time, "time", lambda: os.stat(converted).st_mtime + 7200)  # past the grace period

    drive.rename(tmp_path / "mnt-away")  # unmounted
    out = CliRunner().invoke(main, ["cache", "prune"])
    assert out.exit_code == 0, out.output
    assert f"kept single/{converted.name}: its source {path.resolve()} is missing (an unmounted drive?); kept " \
           "until `preheat cache prune --drop-missing-sources`" in out.output, out.output
    assert converted.is_dir()
    ls = CliRunner().invoke(main, ["cache", "ls"], env={"COLUMNS": "400"})
    assert ls.exit_code == 0 and f"single/{converted.name}" in ls.output and "keeps" in ls.output, ls.output

    (tmp_path / "mnt-away").rename(drive)  # mounted again: the same file, the same conversion
    assert materialize(path, config, root) == converted
    assert (converted / "unet" / "diffusion_pytorch_model.safetensors").stat().st_mtime_ns == made

    drive.rename(tmp_path / "mnt-away")
    out = CliRunner().invoke(main, ["cache", "prune", "--drop-missing-sources"])
    assert out.exit_code == 0 and f"collected single/{converted.name}: its source" in out.output, out.output
    assert not converted.exists()
    (tmp_path / "mnt-away").rename(drive)

    converted = materialize(path, config, root)  # converted again; then the config folder's ref moves
    weights = folder / "unet" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-4] + b"\0\0\0\0")  # another commit of the config folder
    config = pull(folder, root=root, progress=False)
    monkeypatch.setattr(_gc.time, "time", lambda: os.stat(converted).st_mtime + 7200)
    out = CliRunner().invoke(main, ["cache", "prune"])  # the old snapshot goes, and the conversion made from
    assert out.exit_code == 0 and "unreferenced weight files" in out.output, out.output  # its configs (an LDM
    assert f"collected single/{converted.name}: made from snapshot " in out.output, out.output  # file links none
    assert not converted.exists()  # of its weights, but the new commit's folder names another conversion)
    assert materialize(path, config, root).name != converted.name


def test_a_conversion_of_a_file_rewritten_in_place_is_made_again_and_collected(tmp_path, monkeypatch):
    """A real single file outside the cache root, converted by a load, then rewritten in place (the
    same path and size, new content): the next load converts it again and reads the new tensors;
    the old conversion is stale (its record's size and mtime are not the file's), so `cache ls`
    says prune collects it and why, `cache prune` collects it, and the new one stays."""
    import os

    import numpy as np
    from click.testing import CliRunner
    from safetensors.numpy import save_file

    import preheat
    from preheat.cli import main
    from preheat.store import _gc, derived_folders
    from tests._support.ldm_files import to_original
    from tests._support.sd_fixtures import save_tiny_sd

    root = tmp_path / "home"
    monkeypatch.setenv("PREHEAT_HOME", str(root))
    folder = save_tiny_sd(tmp_path / "sd1", kind="sd1")
    path = tmp_path / "mnt" / "tiny-sd1.safetensors"
    path.parent.mkdir()
    tensors = to_original(folder, "sd1")
    save_file(tensors, str(path))
    preheat.load(path, backend="torch", config=folder)  # converted (the folder both backends read)
    (old,) = (root / "models" / "single").iterdir()

    key = "model.diffusion_model.input_blocks.0.0.weight"  # the UNet's conv_in
    tensors[key] = (tensors[key] * 0.5).astype(np.float32)
    size, before = path.stat().st_size, path.stat().st_mtime_ns
    save_file(tensors, str(path))  # rewritten in place: the same path and size
    os.utime(path, ns=(before, max(path.stat().st_mtime_ns, before + 2_000_000_000)))  # a 2 s-mtime filesystem too
    assert path.stat().st_size == size  # only the mtime tells
    pipe = preheat.load(path, backend="torch", config=folder)
    (new,) = set((root / "models" / "single").iterdir()) - {old}  # converted again
    np.testing.assert_array_equal(pipe.pipe.unet.conv_in.weight.detach().numpy(), tensors[key])  # the new content

    monkeypatch.setattr(_gc.time, "time", lambda: os.stat(new).st_mtime + 7200)  # past the grace period
    states = {d.name: (d.state, d.why) for d in derived_folders(root)}
    assert states[f"single/{new.name}"][0] == "live"
    state, why = states[f"single/{old.name}"]
    assert state == "changed-source" and why.startswith(f"its source {path.resolve()} changed since it was made ("), why
    ls = CliRunner().invoke(main, ["cache", "ls"], env={"COLUMNS": "400"})
    assert ls.exit_code == 0, ls.output
    (row,) = [ln for ln in ls.output.splitlines() if f"single/{old.name}" in ln]
    assert "collects" in row and "changed since it was made" in row, ls.output
    out = CliRunner().invoke(main, ["cache", "prune"])
    assert out.exit_code == 0, out.output
    assert f"collected single/{old.name}: its source {path.resolve()} changed since it was made (" in out.output, out.output
    assert f"single/{new.name}" not in out.output  # live: kept, nothing said
    assert not old.exists() and new.is_dir()
    assert list((root / "models" / "single").iterdir()) == [new]


def test_an_edited_config_json_makes_its_conversion_stale_and_a_touched_one_does_not(tmp_path, monkeypatch):
    """A real single file converted with a config folder outside the cache root. The config's JSON
    touched and written again with the same bytes: the next conversion is the same folder, still
    live. Edited (another scheduler setting): converted again into another folder holding the edit,
    and the old one is stale ("its config file ... changed", by the sha256 recorded beside it) at
    once: `cache ls` and `prune` say so while its hour of grace keeps it ("kept until ... UTC"),
    then `prune` collects it and keeps the new one."""
    import json
    import os

    from click.testing import CliRunner
    from safetensors.numpy import save_file

    from preheat.cli import main
    from preheat.models.single_file import materialize
    from preheat.store import _gc, derived_folders
    from tests._support.ldm_files import to_original
    from tests._support.sd_fixtures import save_tiny_sd

    root = tmp_path / "home"
    monkeypatch.setenv("PREHEAT_HOME", str(root))
    folder = save_tiny_sd(tmp_path / "sd1", kind="sd1")  # the config folder
    path = tmp_path / "tiny-sd1.safetensors"
    save_file(to_original(folder, "sd1"), str(path))
    old = materialize(path, folder, root)

    config = folder / "scheduler" / "scheduler_config.json"
    body, st = config.read_bytes(), config.stat()
    config.write_bytes(body)  # the same bytes, a later mtime (a checkout, a copy)
    os.utime(config, ns=(st.st_atime_ns, st.st_mtime_ns + 2_000_000_000))
    assert materialize(path, folder, root) == old  # reused: a config is named by its content
    later = os.stat(old).st_mtime + 7200  # past the grace period
    assert {d.name: d.state for d in derived_folders(root, now=later)} == {f"single/{old.name}": "live"}

    edited = {**json.loads(body), "beta_end": 0.02}
    config.write_text(json.dumps(edited))
    new = materialize(path, folder, root)
    assert new != old and json.loads((new / "scheduler" / "scheduler_config.json").read_text())["beta_end"] == 0.02

    states = {d.name: d for d in derived_folders(root)}  # now: both younger than the hour
    stale, fresh = states[f"single/{old.name}"], states[f"single/{new.name}"]
    assert fresh.state == "live" and not fresh.collect
    assert stale.state == "changed-source" and not stale.collect and stale.kept_until is not None
    assert stale.why.startswith(f"its config file {config.resolve()} changed since it was made (sha256 "), stale.why
    assert "; kept until " in stale.why and stale.why.endswith("UTC, 3600 s after it was made (prune's grace)")
    ls = CliRunner().invoke(main, ["cache", "ls"], env={"COLUMNS": "500"})
    assert ls.exit_code == 0, ls.output
    (row,) = [ln for ln in ls.output.splitlines() if f"single/{old.name}" in ln]
    assert "changed-source" in row and "keeps" in row and "kept until" in row, ls.output
    out = CliRunner().invoke(main, ["cache", "prune"])
    assert out.exit_code == 0, out.output
    assert f"kept single/{old.name}: its config file {config.resolve()} changed since it was made" in out.output
    assert old.is_dir() and new.is_dir()

    monkeypatch.setattr(_gc.time, "time", lambda: os.stat(new).st_mtime + 7200)  # past the grace period
    out = CliRunner().invoke(main, ["cache", "prune"])
    assert out.exit_code == 0, out.output
    assert f"collected single/{old.name}: its config file {config.resolve()} changed since it was made (sha256 " \
           in out.output and "kept until" not in out.output, out.output
    assert not old.exists() and list((root / "models" / "single").iterdir()) == [new]


class Conversion(NamedTuple):
    source: Path  # the single file
    config: Path  # its config folder, outside the cache root
    folder: Path  # what it was converted into


def convert_copies(tmp_path: Path, root: Path, count: int) -> list[Conversion]:
    """``count`` real single files of one tiny SD 1.x model, each converted into ``root`` with a
    config folder of its own (the first, then copies of it): as many conversions, all live."""
    import shutil

    from safetensors.numpy import save_file

    from preheat.models.single_file import materialize
    from tests._support.ldm_files import to_original
    from tests._support.sd_fixtures import save_tiny_sd

    first = save_tiny_sd(tmp_path / "sd1", kind="sd1")
    tensors = to_original(first, "sd1")
    made = []
    for i in range(count):
        config = first if i == 0 else shutil.copytree(first, tmp_path / f"sd1-{i}", symlinks=True)
        source = tmp_path / f"tiny-sd1-{i}.safetensors"
        save_file(tensors, str(source))
        made.append(Conversion(source, config, materialize(source, config, root)))
    assert len({m.folder for m in made}) == count
    return made


def test_a_deleted_config_file_makes_its_conversion_stale_and_a_missing_source_keeps_its_own(tmp_path, monkeypatch):
    """Three real single files converted, each with its own config folder outside the cache root.
    A config file deleted from the first's config folder (the rest of it still there): the folder is
    mounted, so the file is gone, not away, and no load reads that config again; the conversion is
    stale ("its config file ... was removed", not a missing source) and `prune` collects it. The
    second's source file deleted, and the third's whole config folder moved away: either may be an
    unmounted drive, so both stay missing sources, kept until `--drop-missing-sources`."""
    import os

    from click.testing import CliRunner

    from preheat.cli import main
    from preheat.store import _gc, derived_folders

    root = tmp_path / "home"
    monkeypatch.setenv("PREHEAT_HOME", str(root))
    made = convert_copies(tmp_path, root, 3)
    (_, config0, gone), (path1, _, away), (_, config2, unmounted) = made

    deleted = config0 / "scheduler" / "scheduler_config.json"  # recorded with its sha256
    deleted.unlink()
    path1.unlink()
    config2.rename(tmp_path / "away")
    later = max(os.stat(m.folder).st_mtime for m in made) + 7200  # past the grace period
    states = {d.name: d for d in derived_folders(root, now=later)}
    stale = states[f"single/{gone.name}"]
    assert stale.state == "changed-source" and stale.collect, stale
    assert stale.why == (f"its config file {deleted.resolve()} was removed since it was made (the rest of its config "
                         "folder is there): no load reaches this one"), stale.why
    assert states[f"single/{away.name}"].state == "missing-source", states
    assert states[f"single/{away.name}"].why.startswith(f"its source {path1.resolve()} is missing")
    kept = states[f"single/{unmounted.name}"]
    assert kept.state == "missing-source" and not kept.collect and f"{tmp_path / 'sd1-2'}" in kept.why, kept

    monkeypatch.setattr(_gc.time, "time", lambda: later)
    out = CliRunner().invoke(main, ["cache", "prune"])
    assert out.exit_code == 0, out.output
    assert f"collected single/{gone.name}: its config file {deleted.resolve()} was removed" in out.output, out.output
    for folder in (away, unmounted):
        assert f"kept single/{folder.name}: its source " in out.output, out.output
    assert "--drop-missing-sources" in out.output
    assert not gone.exists() and away.is_dir() and unmounted.is_dir()


def test_a_deleted_weights_file_of_a_config_folder_still_there_makes_its_conversion_stale(tmp_path, monkeypatch):
    """Two real single files converted, each with its own config folder outside the cache root, and
    the VAE's weights deleted from both config folders (the rest of each still there). The weights
    are recorded by where they are, as the config folder's (``config_weights``): the folder is
    mounted, so the file is gone, not away, and the conversion is stale ("its config folder's
    weights file ... was removed"), collected by `prune`. The second's record is rewritten as one
    made before that field was (no ``config_weights``): it reads as before, a kept missing source."""
    import json
    import os

    from click.testing import CliRunner

    from preheat.cli import main
    from preheat.files import MADE_FROM
    from preheat.store import _gc, derived_folders

    root = tmp_path / "home"
    monkeypatch.setenv("PREHEAT_HOME", str(root))
    made = convert_copies(tmp_path, root, 2)
    (_, config0, gone), (_, config1, old) = made
    record = json.loads((old / MADE_FROM).read_text())
    record.pop("config_weights", None)  # as written before this field was
    (old / MADE_FROM).write_text(json.dumps(record))

    deleted = [c / "vae" / "diffusion_pytorch_model.safetensors" for c in (config0, config1)]
    for weights in deleted:
        weights.unlink()
    later = max(os.stat(m.folder).st_mtime for m in made) + 7200  # past the grace period
    states = {d.name: d for d in derived_folders(root, now=later)}
    stale = states[f"single/{gone.name}"]
    assert stale.state == "changed-source" and stale.collect, stale
    assert stale.why == (f"its config folder's weights file {deleted[0].resolve()} was removed since it was made "
                         "(the rest of its config folder is there): no load reaches this one"), stale.why
    kept = states[f"single/{old.name}"]
    assert kept.state == "missing-source" and not kept.collect, kept
    assert kept.why.startswith(f"its source {deleted[1].resolve()} is missing"), kept.why

    monkeypatch.setattr(_gc.time, "time", lambda: later)
    out = CliRunner().invoke(main, ["cache", "prune"])
    assert out.exit_code == 0, out.output
    assert f"collected single/{gone.name}: its config folder's weights file {deleted[0].resolve()} was removed" \
           in out.output, out.output
    assert f"kept single/{old.name}: its source {deleted[1].resolve()} is missing" in out.output, out.output
    assert not gone.exists() and old.is_dir()
