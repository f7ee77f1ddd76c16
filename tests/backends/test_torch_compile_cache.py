"""The torch compile cache: AOTInductor packages and torch.compile artifacts as preheat entries,
under the same integrity rules as the JAX cache (manifest + sha256, quarantine, recompile)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("diffusers")

from preheat.backends.torch import load_torch_pipeline as torch_load  # noqa: E402
from preheat.backends.torch.compile_cache import TorchCompiler, torch_key_fields  # noqa: E402
from preheat.cache.keys import key_of  # noqa: E402
from preheat.cache.entries import LoadingMarker, open_entry, publish_entry  # noqa: E402
from tests._support.numerics import px_diff
from tests._support.torch_models import MICRO  # noqa: E402
from tests._support.reference import save_tiny_pipeline  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
# guided (the model default, scale 2): the UNet sees batch 4
CALL = dict(sampler="ddim", steps=3, seed=[1, 2], class_labels=[3, 4])


@pytest.fixture(scope="module", autouse=True)
def _private_inductor_cache(tmp_path_factory):
    """Torch's own local caches in a private folder (not the user's /tmp/torchinductor_<user>)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("torchinductor")))
        yield


@pytest.fixture(scope="module")
def micro(tmp_path_factory):
    return save_tiny_pipeline(tmp_path_factory.mktemp("micro"), config=MICRO)


@pytest.fixture(scope="module")
def micro_other_weights(tmp_path_factory):
    """Same architecture, other weights: a "fine-tune" of ``micro``."""
    return save_tiny_pipeline(tmp_path_factory.mktemp("micro-ft"), seed=1, config=MICRO)


@pytest.fixture(scope="module")
def eager_pixels(micro):
    return torch_load(micro).generate(2, **CALL)


@pytest.fixture(scope="module")
def aot_root(tmp_path_factory):
    return tmp_path_factory.mktemp("aot-root")


@pytest.fixture(scope="module")
def aot_first(micro, aot_root):
    """The first AOT pipeline on an empty root: exports, compiles, stores (once for the module)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PREHEAT_HOME", str(aot_root))
        pipe = torch_load(micro, compile="aot")
        pixels = pipe.generate(2, **CALL)
    return pipe, pixels


def _fresh(path, root, monkeypatch, compile="aot"):
    monkeypatch.setenv("PREHEAT_HOME", str(root))
    return torch_load(path, compile=compile)


def _entries(root: Path) -> list[Path]:
    kind = root / "compile" / "torch"
    return sorted(p for p in kind.iterdir() if p.is_dir() and not p.name.startswith(".")) if kind.is_dir() else []


def _max_diff(a, b) -> int:
    return int(px_diff(a, b).max())


def test_aot_first_run_compiles_stores_and_matches_eager(aot_first, aot_root, eager_pixels):
    pipe, pixels = aot_first
    event = pipe.compiler.events[0]
    assert event["mode"] == "aot" and event["layer"] == "none" and event["store"] == "written"
    assert event["miss"] == "no entries yet"
    assert pipe.compiler.events[0]["trace_lower_s"] > 0 and pipe.compiler.events[0]["compile_or_load_s"] > 0
    (entry,) = _entries(aot_root)
    manifest = json.loads((entry / "manifest.json").read_text())
    assert set(manifest["files"]) == {"model.pt2"}  # the package alone: a hit builds no CPU probe
    assert manifest["fields"]["shapes"] == {"model_batch": 4, "sample": [1, 8, 8], "class_labels": True}
    assert _max_diff(pixels, eager_pixels) <= 1


def test_aot_second_pipeline_loads_the_package(aot_first, aot_root, micro, monkeypatch):
    _, first_pixels = aot_first
    pipe = _fresh(micro, aot_root, monkeypatch)
    pixels = pipe.generate(2, **CALL)
    assert pipe.last.cache_layer == "aot"
    assert pipe.last.trace_lower_s == 0.0  # no Dynamo, no export, no Inductor
    np.testing.assert_array_equal(pixels, first_pixels)
    pipe.generate(2, **CALL)
    assert pipe.last.cache_layer == "memory"


def test_aot_package_holds_no_weights(aot_first, aot_root, micro_other_weights, monkeypatch):
    """A fine-tune (same architecture, other weights) loads the same package with its own weights."""
    _, first_pixels = aot_first
    pipe = _fresh(micro_other_weights, aot_root, monkeypatch)
    pixels = pipe.generate(2, **CALL)
    assert pipe.last.cache_layer == "aot"
    assert len(_entries(aot_root)) == 1
    assert _max_diff(pixels, torch_load(micro_other_weights).generate(2, **CALL)) <= 1
    assert _max_diff(pixels, first_pixels) > 10


@pytest.mark.slow  # a second AOTInductor compile (~20 s); test_bad_entries_are_quarantined damages entries cheaply
def test_aot_bit_flipped_package_is_quarantined_and_recompiled(aot_first, aot_root, micro, monkeypatch):
    _, first_pixels = aot_first
    (entry,) = _entries(aot_root)
    package = entry / "model.pt2"
    data = bytearray(package.read_bytes())
    data[len(data) // 2] ^= 0x40
    package.write_bytes(bytes(data))

    pipe = _fresh(micro, aot_root, monkeypatch)
    pixels = pipe.generate(2, **CALL)
    assert pipe.last.cache_layer == "none"  # recompiled, not an error
    event = pipe.compiler.events[0]
    assert "sha256" in event["quarantined"] and event["store"] == "written"
    quarantined = list((aot_root / "quarantine").iterdir())
    assert len(quarantined) == 1 and "sha256" in (quarantined[0] / "QUARANTINED").read_text()
    np.testing.assert_array_equal(pixels, first_pixels)
    (entry,) = _entries(aot_root)  # a new, valid entry
    assert open_entry(entry.parent, entry.name) is not None


# ------------------------------------------------------------------ bad entries, without compiling

def _fake_entry(root: Path, mode: str) -> tuple[TorchCompiler, str, dict, Path]:
    fields = torch_key_fields({"kind": "test"}, mode=mode, model_batch=2, sample_chw=(1, 8, 8),
                              class_conditional=True, dtype="float32", device="cpu")
    key = key_of(fields)
    compiler = TorchCompiler(root=root)
    first = {"model.pt2": os.urandom(4096)} if mode == "aot" else {"mega.bin": os.urandom(4096)}
    files = {**first, "kernels.tar": os.urandom(1024)}
    entry, won = publish_entry(compiler.kind_dir, key, files, fields)
    assert won
    return compiler, key, fields, entry.path


def _truncate(path: Path) -> None:
    f = sorted(p for p in path.iterdir() if p.suffix in (".pt2", ".bin"))[0]
    f.write_bytes(f.read_bytes()[:100])


def _bad_manifest(path: Path) -> None:
    (path / "manifest.json").write_text("{not json")


def _other_key(path: Path) -> None:
    m = json.loads((path / "manifest.json").read_text())
    m["key"] = "0" * 32
    (path / "manifest.json").write_text(json.dumps(m))


def _other_fields(path: Path) -> None:
    m = json.loads((path / "manifest.json").read_text())
    m["fields"]["torch"] = "0.0.1"
    (path / "manifest.json").write_text(json.dumps(m))


def _missing_file(path: Path) -> None:
    sorted(p for p in path.iterdir() if p.suffix in (".pt2", ".bin", ".tar"))[0].unlink()


def _crashed_load(path: Path) -> None:
    (path / f"{LoadingMarker.PREFIX}{socket.gethostname()}.999999999.12345").write_text("x")


@pytest.mark.parametrize("mode", ["aot", "inductor"])
@pytest.mark.parametrize("damage", [_truncate, _bad_manifest, _other_key, _other_fields, _missing_file, _crashed_load],
                         ids=lambda f: f.__name__.strip("_"))
def test_bad_entries_are_quarantined(tmp_path, mode, damage):
    compiler, key, fields, path = _fake_entry(tmp_path, mode)
    record: dict = {}
    assert compiler._open(key, fields, record) is not None  # intact: served
    damage(path)
    record = {}
    assert compiler._open(key, fields, record) is None  # damaged: a miss, never an exception
    assert record["quarantined"]
    assert not path.exists()
    assert len(list((tmp_path / "quarantine").iterdir())) == 1


def test_entries_go_to_the_fleet_store_in_the_background(tmp_path):
    """A written entry is queued for the fleet store, not pushed on the compiling thread; the
    bounded wait reports what is left; once pushed, a new machine (empty root) pulls it."""
    from tests._support.gated import GatedStore

    store = GatedStore(tmp_path / "store")
    fields = torch_key_fields({"kind": "test"}, mode="inductor", model_batch=2, sample_chw=(1, 8, 8),
                              class_conditional=False, dtype="float32", device="cpu")
    key = key_of(fields)
    compiler = TorchCompiler(root=tmp_path / "a", remote=store)
    record: dict = {}
    compiler._publish(key, {"mega.bin": os.urandom(512), "kernels.tar": b""}, fields, record)
    assert record["store"] == "written" and record["remote_push"] == "queued"  # returned with the push held
    assert store.entered.wait(120)
    assert compiler.wait_pushes(0.05) is False and compiler.background.pending == 1
    store.gate.set()
    assert compiler.wait_pushes(120) is True and compiler.background.results == [(key, "pushed")]

    other = TorchCompiler(root=tmp_path / "b", remote=store)
    record = {}
    assert other._open(key, fields, record) is not None and record["remote"] == "hit"


# ------------------------------------------------------------------ torch.compile (Inductor)

_CHILD = """
import json, sys
import numpy as np
from preheat.backends.torch import load_torch_pipeline
from tests._support.torch_models import count_cpp_builds
builds = count_cpp_builds()
pipe = load_torch_pipeline(sys.argv[1], compile="inductor")
pixels = pipe.generate(2, sampler="ddim", steps=3, seed=[1, 2], class_labels=[3, 4])
print("RESULT " + json.dumps({"layer": pipe.last.cache_layer, "trace": pipe.last.trace_lower_s,
                               "compile": pipe.last.compile_s, "builds": len(builds), "events": pipe.compiler.events,
                               "pixels": pixels.tolist()}, default=str))
"""


def _inductor_child(model: Path, home: Path, inductor_dir: Path) -> dict:
    env = {**os.environ, "PREHEAT_HOME": str(home), "TORCHINDUCTOR_CACHE_DIR": str(inductor_dir),
           "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(model)], env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


@pytest.mark.slow
def test_inductor_mega_cache_in_a_fresh_process(micro, micro_other_weights, eager_pixels, tmp_path):
    """Process 1 compiles and stores; process 2 (fresh Inductor cache folder, as after a pod
    restart) loads the Mega-Cache artifacts and the CPU kernels from preheat's entry; process 3
    does the same for a fine-tune (weights are graph inputs, not part of the entry)."""
    home = tmp_path / "home"
    first = _inductor_child(micro, home, tmp_path / "inductor-1")
    assert first["layer"] == "none" and first["events"][0]["store"] == "written"
    assert first["events"][0]["kernels"] > 0 and first["builds"] > 0
    second = _inductor_child(micro, home, tmp_path / "inductor-2")
    assert second["layer"] == "mega"
    assert second["builds"] == 0  # the CPU kernels came from the entry: no C++ compiler run
    np.testing.assert_array_equal(np.array(second["pixels"], np.uint8), np.array(first["pixels"], np.uint8))
    assert _max_diff(np.array(first["pixels"], np.uint8), eager_pixels) <= 1
    (entry,) = _entries(home)
    assert {"mega.bin", "kernels.tar"} <= {p.name for p in entry.iterdir()}
    tuned = _inductor_child(micro_other_weights, home, tmp_path / "inductor-3")
    assert tuned["layer"] == "mega" and tuned["builds"] == 0
    tuned_pixels = np.array(tuned["pixels"], np.uint8)
    assert _max_diff(tuned_pixels, torch_load(micro_other_weights).generate(2, **CALL)) <= 1
    assert _max_diff(tuned_pixels, eager_pixels) > 10
