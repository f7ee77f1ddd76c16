"""Image inputs are declarations alone: the toy image family (``family.py``) declares the shared
``image`` / ``mask_image`` / ``strength`` and blends the image into its output, so that what a
surface passed in can be read back from the pixels (a black mask returns the image itself).

    Python API   the image's pixels arrive; a mask needs its image, of its size; strength in (0, 1]
    CLI          --image/--mask/--strength reach the call; the grid's first row is the input
    warm-up      an image variant and an image + mask variant, each at every served size
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import preheat
from preheat.errors import InvalidArgumentError
from tests._support.image_files import png
from tests._support.toy_models import toy_folder

GREY = np.full((16, 16, 3), 200, np.uint8)
BLACK = np.zeros((16, 16), np.uint8)


@pytest.fixture(scope="module")
def toy(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    with pytest.MonkeyPatch.context() as mp:
        folder = toy_folder(tmp_path_factory.mktemp("toy") / "toy-image", mp)
        yield folder, preheat.load(folder, cache="off")


def test_the_pixels_of_an_image_arrive_and_its_relations_are_checked(toy) -> None:
    _, pipe = toy
    call = dict(steps=1, guidance=1.0, seed=3, class_labels=0)
    kept = pipe.generate(2, image=GREY, mask_image=BLACK, **call)
    assert kept.shape == (2, 16, 16, 1) and (kept == 200).all()  # a black mask keeps the image's own pixels
    plain = pipe.generate(1, **call)
    half = pipe.generate(1, image=GREY, strength=0.5, **call)
    full = pipe.generate(1, image=GREY, strength=1.0, **call)
    np.testing.assert_array_equal(full, plain)  # strength 1: all of it repainted
    assert np.abs(half.astype(int) - 200).mean() < np.abs(plain.astype(int) - 200).mean()
    for bad, argument, words in [(dict(strength=0.0), "strength", "(0, 1]"), (dict(strength=1.5), "strength", "(0, 1]"),
                                 (dict(mask_image=BLACK), "mask_image", "needs image"),
                                 (dict(image=GREY, mask_image=BLACK[:8]), "mask_image", "same size"),
                                 (dict(image=b"GIF89a" + b"\0" * 30), "image", "")]:
        with pytest.raises(InvalidArgumentError) as err:
            pipe.check(1, **bad)
        assert err.value.argument == argument and words in str(err.value) and "\n" not in str(err.value)


def test_the_cli_takes_image_flags_and_shows_input_then_output(toy, tmp_path: Path) -> None:
    from click.testing import CliRunner
    from PIL import Image

    from preheat.cli import main

    folder, _ = toy
    (tmp_path / "in.png").write_bytes(png(GREY))
    (tmp_path / "mask.png").write_bytes(png(BLACK))
    help_text = CliRunner().invoke(main, ["sample", "--help"]).output
    assert all(flag in help_text for flag in ("--image", "--mask", "--strength"))
    out = tmp_path / "grid.png"
    with pytest.MonkeyPatch.context() as mp:
        toy_folder(folder, mp)
        result = CliRunner().invoke(main, ["sample", str(folder), "--n", "1", "--steps", "1", "--guidance", "1",
                                           "--class", "0", "--image", str(tmp_path / "in.png"), "--mask",
                                           str(tmp_path / "mask.png"), "--strength", "0.6", "--cache", "off",
                                           "--out", str(out), "--quiet"])
        assert result.exit_code == 0, result.output
        grid = np.asarray(Image.open(out))  # upscaled 4x: row 0 = image, mask; row 1 = the output
        assert grid.shape == (2 * 64, 2 * 64)
        assert (grid[:64, :64] == 200).all() and (grid[:64, 64:] == 0).all() and (grid[64:, :64] == 200).all()
        bad = CliRunner().invoke(main, ["sample", str(folder), "--strength", "0", "--image", str(tmp_path / "in.png"),
                                        "--cache", "off", "--out", str(tmp_path / "b.png")])
        assert bad.exit_code == 2 and "--strength" in bad.output and "(0, 1]" in bad.output, bad.output


def test_warm_up_compiles_every_image_variant_at_every_served_size(toy) -> None:
    from preheat.warm import WarmSet, call_inputs, resolve, signatures

    _, pipe = toy
    sigs = signatures(pipe, resolve(pipe, WarmSet(max_batch_size=2, guidance=("off",))))
    assert {s.variant for s in sigs} == {(), ("image", "strength"), ("image", "mask_image", "strength")}
    assert len(sigs) == 3 * 2  # x buckets 1, 2
    inputs = call_inputs(pipe, next(s for s in sigs if s.variant == ("image", "mask_image", "strength")))
    assert inputs["image"].shape == (16, 16, 3) and inputs["mask_image"].shape == (16, 16)
    inputs.pop("progress", None)  # how the call reports, not an input of it
    pipe.check(inputs.pop("seed").__len__(), **inputs)  # a placeholder is a valid call
