"""preheat.model_source: one resolution of MODEL for every surface, and the cheap check a server
runs before it binds its port."""

from __future__ import annotations

import sys

import pytest

from preheat.errors import InvalidArgumentError, MissingExtraError, ModelNotFoundError
from preheat.model_source import BUILTIN_MODEL, check_model, model_root, random_defaults


def test_check_model_passes_what_can_load_and_fails_a_missing_path_in_one_line(tmp_path) -> None:
    for ok in (None, "builtin:digits", "random:sd1-tiny", str(tmp_path), "hf://org/repo"):
        check_model(ok)  # reads nothing: a store source is the load's to pull
    with pytest.raises(ModelNotFoundError, match=f"^model path {tmp_path / 'gone'} does not exist$"):
        check_model(str(tmp_path / "gone"))
    with pytest.raises(InvalidArgumentError, match="unknown built-in model 'builtin:nope'"):
        check_model("builtin:nope")
    with pytest.raises(InvalidArgumentError, match="unknown random model 'random:nope'; choose from random:sd1-tiny"):
        check_model("random:nope")


def test_random_defaults_are_a_tiny_models_size_and_inputs() -> None:
    assert random_defaults("random:sd1-tiny") == ((32, 32), ())
    assert random_defaults("random:kontext-tiny") == ((32, 32), (("image_resize", "none"),))
    assert random_defaults("random:sd15") == (None, ())  # full size: its family's own
    assert random_defaults("/some/folder") == (None, ()) and random_defaults(None) == (None, ())


def test_model_root_writes_a_random_folder_once_under_the_cache_root(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("PREHEAT_HOME", str(tmp_path))
    assert model_root(None) == BUILTIN_MODEL
    folder = model_root("random:ddpm-cifar10-32")  # the pixel one: written with JAX, no torch needed
    assert folder == tmp_path / "random" / "ddpm-cifar10-32" and (folder / "model_index.json").is_file()
    assert capsys.readouterr().err.strip() == f"random:ddpm-cifar10-32: writing a random-weight folder at {folder} (once)"
    assert model_root("random:ddpm-cifar10-32") == folder and capsys.readouterr().err == ""  # reused


def test_load_of_a_random_model_without_the_torch_extra_is_one_line(tmp_path, monkeypatch) -> None:
    """``make run`` installs the runtime only: a random folder written with diffusers says which
    extra provides it, in one line, before anything is written."""
    import preheat

    monkeypatch.setenv("PREHEAT_HOME", str(tmp_path))
    monkeypatch.setitem(sys.modules, "diffusers", None)  # `import diffusers` raises ImportError
    with pytest.raises(MissingExtraError) as err:
        preheat.load("random:sd1-tiny")
    assert str(err.value) == ('random:sd1-tiny (its folder is written with torch, diffusers and transformers) needs '
                              'the torch extra: pip install ".[torch]" (No module named \'diffusers\')')
    assert not (tmp_path / "random" / "sd1-tiny").exists()
