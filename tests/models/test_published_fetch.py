"""A single file loaded with no ``config=`` fetches only what it lacks from its published repository
(issue 28, items 1 and 5): the tokenizer folders of an LDM file, and a FLUX.1 transformer file's
text encoders, VAE and tokenizers, through the weights store (``hf://`` with ``components=``),
against a stand-in for the Hub on 127.0.0.1 (``tests/_support/hub_server.py``).

Tiny random files are no published model, so tiny stand-ins take the published models' place
(``Published`` entries whose shipped configs are the tiny folder's, as in ``test_published``), and
the stand-in Hub serves the tiny folder as their "published repository", laid out as published:
every component's weights and configs, plus a top-level single file that must not be fetched.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest

import preheat
from preheat.errors import FetchError, ModelFormatError
from preheat.models import published as module
from tests._support import flow_fixtures
from tests._support.bfl_files import to_bfl
from tests._support.hub_server import FakeHub, pointed_at
from tests._support.ldm_files import to_original
from tests._support.sd_fixtures import save_tiny_sd


def _repo_files(folder: Path, single: Path) -> dict[str, bytes]:
    """The folder as a published repository holds it, with the single file at its top level."""
    files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    files[single.name] = single.read_bytes()
    return files


def _stand_in(base: Path, folder: Path, name: str, repo: str, layout: str, **scheduler: str) -> module.Published:
    """A published model whose shipped configs are ``folder``'s (no weights, no tokenizers), under ``base``."""
    shutil.copytree(folder, base / name, ignore=shutil.ignore_patterns("*.safetensors", "tokenizer*"))
    if scheduler:
        path = base / name / "scheduler" / "scheduler_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **scheduler}))
    return module.Published(name, name, repo, layout, "any file", lambda shapes: True)


class Flux(NamedTuple):
    """The module's tiny FLUX.1-dev: its folder, its transformer as a BFL single file, and that as a
    Q8_0 GGUF (city96's layout; None without the gguf extra). Built once: each test copies nothing
    of it, it only reads it (its stand-in repository and published entry are the test's own)."""

    folder: Path
    path: Path
    q8: Path | None


@pytest.fixture(scope="module")
def flux(tmp_path_factory) -> Flux:
    from safetensors.numpy import load_file, save_file

    base = tmp_path_factory.mktemp("flux")
    folder = flow_fixtures.save_tiny_flow_model(base / "flux-dev", "flux-dev")
    path = base / "flux1-tiny.safetensors"
    save_file(to_bfl(load_file(str(folder / "transformer" / "diffusion_pytorch_model.safetensors"))), str(path))
    try:
        import gguf
    except ModuleNotFoundError:
        return Flux(folder, path, None)
    from tests._support.gguf_files import write_gguf

    q8 = base / "flux1-tiny-Q8_0.gguf"
    write_gguf(q8, load_file(str(path)), gguf.GGMLQuantizationType.Q8_0)  # the BFL tensors, 2-D weights in Q8_0
    return Flux(folder, path, q8)


GGUF_CALL = dict(steps=2, sampler="flow_euler", guidance=3.5, width=32, height=32)


def _gguf_draw(pipe) -> np.ndarray:
    noise = np.random.default_rng(3).standard_normal((1, 4, 16, 16)).astype(np.float32)
    return pipe.generate("a watercolor fox", noise=noise, **GGUF_CALL)


def _same_conversion(ours: Path, theirs: Path) -> list[str]:
    """Two converted folders hold the same files, byte for byte (links read through), but the
    record of what each was made from: the JAX engine reads nothing else, so they draw the same
    image (without a compile of its own to show it). Returns their paths."""
    from preheat.files import MADE_FROM

    parts = sorted(p.relative_to(theirs).as_posix() for p in theirs.rglob("*") if p.is_file())
    assert parts == sorted(p.relative_to(ours).as_posix() for p in ours.rglob("*") if p.is_file())
    for part in parts:  # every weight, config and tokenizer file the same; what each was made from, its own
        assert (ours / part).read_bytes() == (theirs / part).read_bytes() or part == MADE_FROM, part
    return parts


def _flux_file_and_repo(flux: Flux, tmp_path: Path,
                        published: Any) -> tuple[Path, Path, module.Published, dict[str, bytes]]:
    """The module's tiny FLUX.1-dev folder and its BFL single file, the folder published as
    ``example/tiny-flux`` (configs shipped), and the files its repository holds."""
    entry = _stand_in(tmp_path / "assets", flux.folder, "tiny-flux", "example/tiny-flux", "bfl")
    published(tmp_path / "assets", entry)
    return flux.folder, flux.path, entry, _repo_files(flux.folder, flux.path)


@pytest.fixture(scope="module")
def sd1(tmp_path_factory):
    """(folder, LDM single file, stand-in assets, stand-in entry) of a tiny SD 1.x."""
    from safetensors.numpy import save_file

    base = tmp_path_factory.mktemp("sd1")
    folder = save_tiny_sd(base / "sd1", kind="sd1")
    path = base / "tiny-sd1.safetensors"
    save_file(to_original(folder, "sd1"), str(path))
    entry = _stand_in(base / "assets", folder, "tiny-sd1", "example/tiny-sd1", "ldm")
    return folder, path, base / "assets", entry


@pytest.fixture
def published(monkeypatch, tmp_path):
    """Installs stand-in published models: ``published(assets, *entries)``."""
    monkeypatch.setenv("PREHEAT_HOME", str(tmp_path / "home"))

    def install(assets: Path, *entries: module.Published) -> None:
        monkeypatch.setattr(module, "CONFIGS", assets)
        monkeypatch.setattr(module, "PUBLISHED", entries)

    return install


@pytest.fixture
def hub_of(monkeypatch):
    """Starts a stand-in Hub for one repository and points huggingface_hub at it."""
    servers = []

    def start(repo: str, files: dict[str, bytes], gated: bool = False) -> FakeHub:
        srv = FakeHub(repo, files, gated=gated).start()
        servers.append(srv)
        pointed_at(monkeypatch, srv.base)
        return srv

    yield start
    for srv in servers:
        srv.stop()


def _draw(pipe) -> np.ndarray:
    noise = np.random.default_rng(3).standard_normal((1, 4, 16, 16)).astype(np.float32)
    return pipe.generate("a lighthouse at dusk", noise=noise, steps=3, sampler="ddim", guidance=5.0,
                         width=32, height=32)


def test_an_ldm_file_without_config_fetches_only_its_tokenizer(sd1, published, hub_of, tmp_path, monkeypatch):
    folder, path, assets, entry = sd1
    published(assets, entry)
    hub = hub_of(entry.repo, _repo_files(folder, path))

    ours = _draw(preheat.load(path))
    tokenizer = {p: len(b) for p, b in hub.files.items() if p.startswith("tokenizer/")}
    assert "tokenizer/vocab.json" in tokenizer and hub.downloaded() == tokenizer  # no model_index.json, no weights, no top-level file
    # the folder as config= is another conversion (its own weights beside the configs), run by the
    # program just compiled (the weights are its arguments)
    with_folder = _draw(preheat.load(path, config=folder))
    assert len(list((tmp_path / "home" / "models" / "single").iterdir())) == 2
    assert np.array_equal(ours, with_folder) and ours.std() > 5  # the same weights, tokenizer and configs

    hub.hits.clear()  # stored: a restart sends no request, even offline
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert preheat.load(path, cache="off").family.name == "stable-diffusion"
    assert hub.hits == []


def test_a_flux_transformer_file_fetches_the_encoders_vae_and_tokenizers(flux, published, hub_of, tmp_path):
    """A BFL transformer-only file lacks the text encoders, the VAE and the tokenizers: those are
    fetched, the repository's transformer weights (and its top-level files) are not; the converted
    folder reads the very weights that ``config=<folder>`` gives."""
    from preheat.files import MADE_FROM
    from preheat.models.single_file import materialize

    folder, path, entry, files = _flux_file_and_repo(flux, tmp_path, published)
    files["ae.safetensors"] = (folder / "vae" / "diffusion_pytorch_model.safetensors").read_bytes()
    hub = hub_of(entry.repo, files)

    pipe = preheat.load(path, cache="off")
    assert pipe.family.name == "flux"
    wanted = ("text_encoder/", "text_encoder_2/", "tokenizer/", "tokenizer_2/", "vae/")
    assert hub.downloaded() == {p: len(b) for p, b in files.items() if p.startswith(wanted)}
    assert not any(p.startswith("transformer/") or "/" not in p for p in hub.downloaded())

    (ours,) = (tmp_path / "home" / "models" / "single").iterdir()
    theirs = materialize(path, folder, tmp_path / "other")
    parts = _same_conversion(ours, theirs)
    assert "text_encoder_2/model.safetensors" in parts and "tokenizer_2/tokenizer_config.json" in parts
    assert str((folder / "vae" / "diffusion_pytorch_model.safetensors").resolve()) in (theirs / MADE_FROM).read_text()


def _one_line(err: pytest.ExceptionInfo, *parts: str) -> str:
    message = str(err.value)
    assert "\n" not in message, message
    for part in parts:
        assert part in message, (part, message)
    return message


def test_what_cannot_be_fetched_is_one_line_naming_the_folders_and_config(sd1, published, hub_of, monkeypatch, tmp_path):
    folder, path, assets, entry = sd1
    published(assets, entry)
    needs = ("tiny-sd1.safetensors is a tiny-sd1 single file; it needs tokenizer/ from hf://example/tiny-sd1",
             "pass config=<a folder holding tokenizer/, or a tiny-sd1 diffusers folder")

    hub = hub_of(entry.repo, _repo_files(folder, path), gated=True)
    with pytest.raises(FetchError) as err:
        preheat.load(path, cache="off")
    _one_line(err, *needs, "is gated", "HF_TOKEN")
    assert hub.downloaded() == {}

    pointed_at(monkeypatch, "http://127.0.0.1:9")  # nothing listens: the Hub is unreachable
    with pytest.raises(FetchError) as err:
        preheat.load(path, cache="off")
    _one_line(err, *needs, "unreachable")

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FetchError) as err:
        preheat.load(path, cache="off")
    _one_line(err, *needs, "HF_HUB_OFFLINE is set")
    assert not (tmp_path / "home" / "models" / "refs").is_dir() or not any((tmp_path / "home" / "models" / "refs").iterdir())

    hub = hub_of(entry.repo, {p: b for p, b in _repo_files(folder, path).items() if not p.startswith("tokenizer/")})
    with pytest.raises(FetchError) as err:  # a repository without the folder
        preheat.load(path, cache="off")
    _one_line(err, *needs, "has no tokenizer/ folder")


def test_sd2_is_the_768_v_model_unless_the_base_is_named(tmp_path, published, hub_of):
    """The two SD 2.x models have the same tensors: a file is taken as the 768 px v-prediction one,
    as diffusers' ``from_single_file`` does; ``config=`` the base model's name reads it as the 512 px
    epsilon one, fetching only the tokenizer from that model's repository."""
    from safetensors.numpy import save_file

    folder = save_tiny_sd(tmp_path / "sd2", kind="sd2")  # its scheduler: v-prediction
    path = tmp_path / "tiny-sd2.safetensors"
    save_file(to_original(folder, "sd2"), str(path))
    assets = tmp_path / "assets"
    v = _stand_in(assets, folder, "tiny-sd2", "example/tiny-sd2", "ldm")
    base = _stand_in(assets, folder, "tiny-sd2-base", "example/tiny-sd2-base", "ldm", prediction_type="epsilon")
    published(assets, v, base)
    hub = hub_of(base.repo, _repo_files(folder, path))

    assert module.infer_file(path) == v  # the first that fits
    pipe = preheat.load(path, config="tiny-sd2-base", cache="off")
    assert pipe.scheduler_config.prediction_type == "epsilon"
    assert sorted(hub.downloaded()) == sorted(p for p in hub.files if p.startswith("tokenizer/"))
    hub.hits.clear()  # the repository as config= is the same model: what the file lacks, already stored
    assert preheat.load(path, config=f"hf://{base.repo}", cache="off").scheduler_config.prediction_type == "epsilon"
    assert hub.hits == []
    for spelling in ("tiny-sd2-base", "example/tiny-sd2-base", "hf://example/tiny-sd2-base"):
        assert module.named(spelling) == base
    assert module.named("example/tiny-sd2") == v and module.named(str(folder)) is None

    hub_of(v.repo, _repo_files(folder, path))
    assert preheat.load(path, cache="off").scheduler_config.prediction_type == "v_prediction"


def test_a_named_model_the_file_does_not_fit_is_one_line(sd1, published):
    folder, path, assets, entry = sd1
    other = module.Published("tiny-other", "tiny other", "example/other", "ldm", "a cross-attention width of 77",
                             lambda shapes: False)
    published(assets, entry, other)
    with pytest.raises(ModelFormatError) as err:
        preheat.load(path, config="tiny-other", cache="off")
    _one_line(err, "tiny-sd1.safetensors is not a tiny other single file (that model has a cross-attention width of 77)")


def test_pull_dry_run_of_a_single_file_lists_exactly_what_it_fetches(sd1, published, hub_of, tmp_path):
    from click.testing import CliRunner

    from preheat.cli.pull import pull_command

    folder, path, assets, entry = sd1
    published(assets, entry)
    hub = hub_of(entry.repo, _repo_files(folder, path))
    tokenizer = {p: len(b) for p, b in hub.files.items() if p.startswith("tokenizer/")}

    out = CliRunner().invoke(pull_command, [str(path), "--dry-run"])
    assert out.exit_code == 0, out.output
    lines = out.output.splitlines()
    assert lines[0] == f"{path} is a tiny-sd1 single file; it needs these files of hf://example/tiny-sd1:"
    listed = {ln.split()[1]: int(ln.split()[0].replace(",", "")) for ln in lines[1:-1]}
    assert listed == tokenizer
    assert lines[-1].split()[0] == f"{sum(tokenizer.values()):,d}" and f"{len(tokenizer)} files" in lines[-1]
    assert hub.downloaded() == {}  # listed, not fetched

    out = CliRunner().invoke(pull_command, [str(path), "--quiet"])  # the pull: the file, and what it lacks
    assert out.exit_code == 0, out.output
    assert hub.downloaded() == tokenizer
    hub.hits.clear()
    preheat.load(path, cache="off")  # then the load needs no request
    assert hub.hits == []

    out = CliRunner().invoke(pull_command, [str(path), "--dry-run", "--config", "nosuch"])
    assert out.exit_code == 2 and out.output == "error: --config names a published model (tiny-sd1); not 'nosuch'\n"


def test_gc_keeps_a_live_conversion_and_collects_one_no_load_reaches(flux, published, hub_of, tmp_path, monkeypatch):
    """A FLUX.1 transformer file's converted folder links the VAE and text encoders of the snapshot
    the store fetched. ``collect_orphans`` (``preheat cache prune``) keeps it and that snapshot
    while a ref names it: the next load sends no request and converts nothing. Once a re-pull of
    the repository's new commit moves the ref, the old snapshot, the old converted folder and its
    config folder go together (no link left dangling), and the next load converts against the
    new snapshot, still with no request."""
    import os
    import time

    from preheat.cache.manage import disk_usage
    from preheat.store import collect_orphans, pull
    from tests._support.hub_server import FakeHub

    folder, path, entry, files = _flux_file_and_repo(flux, tmp_path, published)
    hub = hub_of(entry.repo, files)
    models = tmp_path / "home" / "models"
    call = dict(noise=np.random.default_rng(3).standard_normal((1, 4, 16, 16)).astype(np.float32), steps=2,
                sampler="flow_euler", guidance=3.5, width=32, height=32)

    first = preheat.load(path, cache="off").generate("a watercolor fox", **call)
    (converted,) = (models / "single").iterdir()
    made = (converted / "transformer" / "diffusion_pytorch_model.safetensors").stat().st_mtime_ns
    later = time.time() + 7200  # past the grace period
    assert collect_orphans(tmp_path / "home", grace_s=3600, now=later) == []  # all of it named by a ref
    hub.hits.clear()
    again = preheat.load(path, cache="off").generate("a watercolor fox", **call)
    assert hub.hits == [] and np.array_equal(again, first)  # no request, the same image
    assert list((models / "single").iterdir()) == [converted]  # read as it was: not converted again
    assert (converted / "transformer" / "diffusion_pytorch_model.safetensors").stat().st_mtime_ns == made

    # the repository's next commit rewrites a tokenizer config (the same tokenizer), and what the file
    # lacks is pulled again: the ref moves to a new snapshot
    changed = {**files, "tokenizer/tokenizer_config.json": files["tokenizer/tokenizer_config.json"] + b"\n"}
    hub2 = FakeHub(entry.repo, changed, commit="cd" * 20).start()
    try:
        pointed_at(monkeypatch, hub2.base)
        pull(f"hf://{entry.repo}", components=module.needed(path).components, force=True, progress=False)
        (old_configs,) = (models / "single-configs").iterdir()
        before = disk_usage(models)
        removed = collect_orphans(tmp_path / "home", grace_s=3600, now=later)
        assert f"single/{converted.name}" in removed and f"single-configs/{old_configs.name}" in removed
        assert sum(r.startswith("snapshots/") for r in removed) == 1  # the old snapshot
        assert not converted.exists() and not old_configs.exists()
        assert [p for p in models.rglob("*") if p.is_symlink() and not os.path.exists(p)] == []
        freed = before - disk_usage(models)
        print(f"gc after the re-pull: {len(removed)} paths, {freed} bytes freed of {before}")
        assert freed >= os.path.getsize(path)  # at least the converted transformer

        hub2.hits.clear()
        third = preheat.load(path, cache="off").generate("a watercolor fox", **call)
        assert hub2.hits == [] and np.array_equal(third, first)  # stored: converted again, nothing fetched
        assert collect_orphans(tmp_path / "home", grace_s=3600, now=later) == []
    finally:
        hub2.stop()


def test_a_weights_file_deleted_from_a_components_folder_makes_its_config_folder_stale(flux, published, tmp_path,
                                                                                       monkeypatch):
    """``config=`` a folder holding only what a FLUX.1 transformer file lacks (its tokenizers, text
    encoders and VAE; no model_index.json): the load puts them beside the shipped configs in a
    config folder under ``models/single-configs/`` (``published.with_components``), linking their
    weights, which it records as that folder's (``config_weights``). The VAE's weights deleted from
    the components folder, the rest of it still there: the folder is mounted, so the file is gone,
    not away, and no load reads that config folder again; it is stale ("its config folder's weights
    file ... was removed", not a kept missing source), as is the conversion read with it, and one
    `prune` collects both."""
    import os

    from click.testing import CliRunner

    from preheat.cli import main
    from preheat.store import _gc, derived_folders

    _flux_file_and_repo(flux, tmp_path, published)  # the stand-in published model; no fetch here
    components = tmp_path / "components"
    for name in ("text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "vae"):
        shutil.copytree(flux.folder / name, components / name)
    preheat.load(flux.path, config=components, cache="off")
    root, models = tmp_path / "home", tmp_path / "home" / "models"
    (configs,) = (models / "single-configs").iterdir()
    (converted,) = (models / "single").iterdir()
    assert (configs / "vae" / "diffusion_pytorch_model.safetensors").is_symlink()
    later = max(os.stat(f).st_mtime for f in (configs, converted)) + 7200  # past the grace period
    names = (f"single-configs/{configs.name}", f"single/{converted.name}")
    assert {d.name: d.state for d in derived_folders(root, now=later)} == {n: "live" for n in names}

    deleted = (components / "vae" / "diffusion_pytorch_model.safetensors").resolve()
    deleted.unlink()
    states = {d.name: d for d in derived_folders(root, now=later)}
    for name in names:
        assert states[name].state == "changed-source" and states[name].collect, states[name]
        assert states[name].why == (f"its config folder's weights file {deleted} was removed since it was made (the "
                                    "rest of its config folder is there): no load reaches this one"), states[name].why

    monkeypatch.setattr(_gc.time, "time", lambda: later)
    out = CliRunner().invoke(main, ["cache", "prune"])
    assert out.exit_code == 0, out.output
    for name in names:
        assert f"collected {name}: its config folder's weights file {deleted} was removed" in out.output, out.output
    assert not configs.exists() and not converted.exists()


def test_a_variant_fetches_that_variant_of_what_a_transformer_file_lacks(flux, published, hub_of, tmp_path):
    """``variant="fp16"`` with no ``config=``: what the file lacks is fetched in that variant only
    (``pull --dry-run --variant fp16`` lists it), and the converted folder links those weights under
    the default names (the file's own weights are what it holds)."""
    from click.testing import CliRunner
    from safetensors.numpy import load_file, save_file

    from preheat.cli.pull import pull_command
    from preheat.file_configs import single_file_config
    from preheat.models.single_file import materialize

    folder, path, entry, files = _flux_file_and_repo(flux, tmp_path, published)
    for name in [p for p in files if p.endswith(".safetensors") and "/" in p]:  # every component's fp16 weights
        tensors = load_file(str(folder / name))
        half = {k: v.astype(np.float16) if v.dtype == np.float32 else v for k, v in tensors.items()}
        save_file(half, str(tmp_path / "half.safetensors"))
        files[name.replace(".safetensors", ".fp16.safetensors")] = (tmp_path / "half.safetensors").read_bytes()
    hub = hub_of(entry.repo, files)
    lacked = ("text_encoder/", "text_encoder_2/", "vae/")
    fp16 = {p: len(b) for p, b in files.items() if p.startswith(lacked) and p.endswith(".fp16.safetensors")}
    assert len(fp16) == 3

    out = CliRunner().invoke(pull_command, [str(path), "--dry-run", "--variant", "fp16"])
    assert out.exit_code == 0, out.output
    listed = {ln.split()[1] for ln in out.output.splitlines()[1:-1]}
    assert set(fp16) <= listed and not any(p.endswith(".safetensors") and p not in fp16 for p in listed)
    assert hub.downloaded() == {}

    configs = single_file_config(path, None, "fp16")
    got = hub.downloaded()
    assert {p: n for p, n in got.items() if p.endswith(".safetensors")} == fp16  # no default weights
    converted = materialize(path, configs, tmp_path / "home", "fp16")
    for name in fp16:
        default = converted / name.replace(".fp16.safetensors", ".safetensors")
        assert default.read_bytes() == files[name], name  # the variant's weights, under the default name
    assert not [p for p in converted.rglob("*") if ".fp16." in p.name]


def test_a_local_gguf_without_config_pulls_what_it_lacks(flux, published, hub_of, tmp_path):
    """A FLUX.1 transformer's GGUF (Q8_0, city96's layout) is inferred from its header like a BFL
    safetensors file: `pull FILE.gguf --dry-run` lists the text encoders, VAE and tokenizers of the
    published repository (not its transformer), `pull FILE.gguf` stores the file and fetches exactly
    those, and the load then needs no request and reads the conversion of `config=<folder>`."""
    pytest.importorskip("gguf")
    from click.testing import CliRunner

    from preheat.cli.pull import pull_command
    from preheat.models.single_file import materialize

    folder, path, entry, files = _flux_file_and_repo(flux, tmp_path, published)
    q8 = flux.q8
    hub = hub_of(entry.repo, files)
    wanted = ("text_encoder/", "text_encoder_2/", "tokenizer/", "tokenizer_2/", "vae/")
    lacked = {p: len(b) for p, b in files.items() if p.startswith(wanted)}

    out = CliRunner().invoke(pull_command, [str(q8), "--dry-run"])
    assert out.exit_code == 0, out.output
    lines = out.output.splitlines()
    assert lines[0] == f"{q8} is a tiny-flux single file; it needs these files of hf://example/tiny-flux:"
    assert {ln.split()[1]: int(ln.split()[0].replace(",", "")) for ln in lines[1:-1]} == lacked
    assert hub.downloaded() == {}  # listed, not fetched

    out = CliRunner().invoke(pull_command, [str(q8), "--quiet"])
    assert out.exit_code == 0, out.output
    assert hub.downloaded() == lacked  # no transformer, no top-level file
    hub.hits.clear()
    assert preheat.load(q8, cache="off").family.name == "flux"  # no config=: inferred, read from the store
    assert hub.hits == []
    (ours,) = (tmp_path / "home" / "models" / "single").iterdir()  # what the JAX engine reads: the
    _same_conversion(ours, materialize(q8, folder, tmp_path / "other"))  # conversion of config=<folder>


def test_a_gguf_of_no_published_model_without_config_is_one_line(flux, published, tmp_path):
    pytest.importorskip("gguf")
    from preheat.errors import InvalidArgumentError

    folder, path, entry, _ = _flux_file_and_repo(flux, tmp_path, published)
    q8 = flux.q8
    published(tmp_path / "assets", entry._replace(fits=lambda shapes: False))  # the file is no published model
    with pytest.raises(InvalidArgumentError, match=r"flux1-tiny-Q8_0\.gguf is a GGUF file .* of no published model "
                                                   r"preheat infers: pass config=") as err:
        preheat.load(q8, cache="off")
    _one_line(err)


def test_a_remote_gguf_without_config_pulls_what_it_lacks(flux, published, hub_of, tmp_path, monkeypatch):
    """`hf://org/repo/file.gguf` is pulled as a local GGUF is: `pull --dry-run` reads the file's
    header alone (HTTP Range requests, grown until the header is whole) and lists the file and the
    text encoders, VAE and tokenizers it lacks; `pull` stores the file and fetches exactly those;
    the load then needs no request: the JAX engine reads the very conversion of the local file with
    `config=<folder>` (every byte; a compile to draw it would cost 7-8 s alone, 29-61 s in a loaded
    full run, and draw what those bytes draw), the torch backend draws that file's image."""
    pytest.importorskip("gguf")
    from click.testing import CliRunner

    from preheat import file_configs
    from preheat.cli.pull import pull_command
    from preheat.models.single_file import materialize

    folder, path, entry, files = _flux_file_and_repo(flux, tmp_path, published)
    q8 = flux.q8
    files[q8.name] = q8.read_bytes()  # beside the published folders, as a repository of GGUFs holds them
    hub = hub_of(entry.repo, files)
    source = f"hf://{entry.repo}/{q8.name}"
    wanted = ("text_encoder/", "text_encoder_2/", "tokenizer/", "tokenizer_2/", "vae/")
    lacked = {p: len(b) for p, b in files.items() if p.startswith(wanted)}
    size = len(files[q8.name])

    monkeypatch.setattr(file_configs, "_FIRST_READ", 256)  # the tiny file's header is a few KB: reads grow
    out = CliRunner().invoke(pull_command, [source, "--dry-run"])
    assert out.exit_code == 0, out.output
    lines = out.output.splitlines()
    assert lines[0] == f"{source} is one file of hf://{entry.repo}; a pull fetches:"
    assert lines[1].split() == [f"{size:,d}", q8.name]
    cut = lines.index(f"{source} is a tiny-flux single file; it needs these files of hf://{entry.repo}:")
    assert cut == 3 and {ln.split()[1]: int(ln.split()[0].replace(",", "")) for ln in lines[cut + 1:-1]} == lacked
    reads = [h.sent for h in hub.hits if h.method == "GET" and h.path == q8.name]
    print(f"dry run: header read in {len(reads)} range requests, {reads} bytes of a {size}-byte file")
    assert len(reads) >= 2 and reads == sorted(reads) and reads[-1] < size // 4  # grown, never the tensors
    assert set(hub.downloaded()) == {q8.name}  # nothing else fetched

    hub.hits.clear()
    out = CliRunner().invoke(pull_command, [source, "--quiet"])
    assert out.exit_code == 0, out.output
    assert hub.downloaded() == {q8.name: size, **lacked}  # the file whole, and exactly what it lacks
    hub.hits.clear()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert preheat.load(source, cache="off").family.name == "flux"  # no config=: inferred, read from the store
    assert hub.hits == []
    (ours,) = (tmp_path / "home" / "models" / "single").iterdir()  # what the JAX engine reads: the local
    _same_conversion(ours, materialize(q8, folder, tmp_path / "other"))  # file's conversion with config=<folder>

    # the torch backend too (diffusers' GGUF loader on the stored file, the fetched folders beside it)
    from tests._support.single_files import diffusers_bfl_at_tiny_widths

    with diffusers_bfl_at_tiny_widths(folder, monkeypatch):
        remote = _gguf_draw(preheat.load(source, backend="torch"))
        local = _gguf_draw(preheat.load(q8, backend="torch", config=folder))
    assert hub.hits == [] and np.array_equal(remote, local) and remote.std() > 5


def test_an_sdxl_refiner_file_pulls_only_tokenizer_2(hub_of, tmp_path, monkeypatch):
    """The SDXL refiner's own published entry (no stand-in): a file with the refiner's names and
    shapes (only the ones inference reads: small) is inferred as it, and its pull -- dry run, then
    real -- fetches tokenizer_2/ alone from its repository: the refiner has no first text encoder
    or tokenizer ([null, null] in its model_index.json), and the file holds the UNet, VAE and
    OpenCLIP bigG."""
    from click.testing import CliRunner
    from safetensors.numpy import save_file

    from preheat.cli.pull import pull_command

    monkeypatch.setenv("PREHEAT_HOME", str(tmp_path / "home"))
    entry = module.named("stable-diffusion-xl-refiner-1.0")
    path = tmp_path / "sd_xl_refiner_1.0.safetensors"
    save_file({"model.diffusion_model.label_emb.0.0.weight": np.zeros((1536, 2560), np.float16),
               "model.diffusion_model.input_blocks.0.0.weight": np.zeros((384, 4, 3, 3), np.float16),
               "conditioner.embedders.0.model.ln_final.weight": np.zeros((1280,), np.float16)}, str(path))
    assert module.infer_file(path) == entry and module.needed(path).components == ("tokenizer_2",)
    files = {"model_index.json": (module.CONFIGS / entry.name / "model_index.json").read_bytes(),
             "tokenizer_2/vocab.json": b'{"a": 0}', "tokenizer_2/merges.txt": b"#version: 0.2\n",
             "tokenizer_2/tokenizer_config.json": b"{}", "text_encoder_2/model.safetensors": b"\0" * 64,
             "unet/diffusion_pytorch_model.safetensors": b"\0" * 64,
             "vae/diffusion_pytorch_model.safetensors": b"\0" * 64,
             path.name: path.read_bytes()}
    hub = hub_of(entry.repo, files)
    tokenizer_2 = {p: len(b) for p, b in files.items() if p.startswith("tokenizer_2/")}

    out = CliRunner().invoke(pull_command, [str(path), "--dry-run"])
    assert out.exit_code == 0, out.output
    lines = out.output.splitlines()
    assert lines[0] == (f"{path} is a SDXL refiner 1.0 single file; it needs these files of "
                        "hf://stabilityai/stable-diffusion-xl-refiner-1.0:")
    assert {ln.split()[1]: int(ln.split()[0].replace(",", "")) for ln in lines[1:-1]} == tokenizer_2
    assert hub.downloaded() == {}  # listed, not fetched
    out = CliRunner().invoke(pull_command, [str(path), "--quiet"])
    assert out.exit_code == 0, out.output
    assert hub.downloaded() == tokenizer_2
