"""preheat.image_input: every accepted form gives PIL's own conversion (what diffusers' image
processors start from), and every bad file is one InvalidArgumentError naming the input, decided
from the header before pixels are decoded."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from preheat.errors import InvalidArgumentError, PreheatError
from preheat.families.inputs import Image as ImageType
from preheat.families.inputs import InputSpec
from preheat.image_input import read_image, set_max_pixels


def encoded(image: Image.Image, fmt: str, **save: object) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **save)
    return buf.getvalue()


def rgba(h: int = 12, w: int = 20) -> Image.Image:
    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 256, (h, w, 4), dtype=np.uint8), "RGBA")


@pytest.mark.parametrize("fmt", ["PNG", "WEBP"])
def test_lossless_files_paths_bytes_and_data_uris_give_pils_rgb(tmp_path: Path, fmt: str) -> None:
    source = rgba()
    data = encoded(source, fmt, **({"lossless": True} if fmt == "WEBP" else {}))
    expected = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    path = tmp_path / "in.img"  # the format comes from the header, not the name
    path.write_bytes(data)
    uri = f"data:image/{fmt.lower()};base64," + base64.b64encode(data).decode()
    for value in (data, path, str(path), uri, Image.open(io.BytesIO(data))):
        out = read_image(value)
        assert out.dtype == np.uint8 and out.shape == (12, 20, 3)
        np.testing.assert_array_equal(out, expected)


def test_arrays_and_modes_convert_as_pil_does() -> None:
    rng = np.random.default_rng(1)
    for array in (rng.integers(0, 256, (5, 7, 3), dtype=np.uint8), rng.integers(0, 256, (5, 7, 4), dtype=np.uint8),
                  rng.integers(0, 256, (5, 7), dtype=np.uint8), rng.integers(0, 256, (5, 7, 1), dtype=np.uint8)):
        expected = np.asarray(Image.fromarray(array.squeeze(-1) if array.shape[-1:] == (1,) else array).convert("RGB"))
        np.testing.assert_array_equal(read_image(array), expected)
    la = Image.fromarray(rng.integers(0, 256, (5, 7, 2), dtype=np.uint8), "LA")
    np.testing.assert_array_equal(read_image(la), np.asarray(la.convert("RGB")))
    mask = read_image(rgba(), "mask_image", mask=True)
    assert mask.shape == (12, 20)
    np.testing.assert_array_equal(mask, np.asarray(rgba().convert("L")))


def test_exif_orientation_is_applied() -> None:
    image = Image.fromarray(np.arange(6 * 10 * 3, dtype=np.uint8).reshape(6, 10, 3))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90° clockwise to view
    data = encoded(image, "JPEG", exif=exif.tobytes(), quality=95)
    out = read_image(data)
    assert out.shape == (10, 6, 3)  # stored 10 wide, shown 6 wide
    from PIL import ImageOps

    np.testing.assert_array_equal(out, np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB")))


def one_line(exc: pytest.ExceptionInfo, argument: str) -> str:
    assert isinstance(exc.value, PreheatError) and exc.value.argument == argument
    text = str(exc.value)
    assert "\n" not in text
    return text


def test_bad_files_are_one_line_errors_naming_the_input(tmp_path: Path) -> None:
    png = encoded(rgba(), "PNG")
    cases = {
        "is GIF": encoded(rgba().convert("P"), "GIF"),
        "is BMP": encoded(rgba().convert("RGB"), "BMP"),
        "not an image": b"hello, not an image",
        "truncated": png[: len(png) // 2],
        "not valid base64": "data:image/png;base64,@@@",
        "without base64": "data:image/png,abc",
        "does not exist": str(tmp_path / "missing.png"),
        "is a URL": "https://example.invalid/x.png",
        "uint8": np.zeros((4, 4, 3), np.float32),
        "has shape": np.zeros((4, 4, 2), np.uint8),
        "must be a PIL image": 3.5,
    }
    for words, value in cases.items():
        with pytest.raises(InvalidArgumentError) as exc:
            read_image(value, "image")
        assert words in one_line(exc, "image"), (words, str(exc.value))


def test_a_decompression_bomb_is_refused_from_its_header() -> None:
    bomb = encoded(Image.new("1", (5000, 4000)), "PNG")  # 20 M pixels in a few kB
    assert len(bomb) < 100_000
    with pytest.raises(InvalidArgumentError) as exc:
        read_image(bomb, "image", limit=4096 * 4096)
    assert "5000x4000" in one_line(exc, "image")
    try:  # the process-wide limit (a server's --max-image-pixels), PIL's own bomb check with it
        set_max_pixels(64 * 64)
        with pytest.raises(InvalidArgumentError, match="at most 4096"):
            read_image(encoded(rgba(65, 64), "PNG"), "image")
        assert Image.MAX_IMAGE_PIXELS == 64 * 64
        assert read_image(encoded(rgba(64, 64), "PNG")).shape == (64, 64, 3)
    finally:
        set_max_pixels(4096 * 4096)
    with pytest.raises(InvalidArgumentError, match="positive int"):
        set_max_pixels(0)


def test_the_image_input_type_checks_through_its_spec() -> None:
    spec = InputSpec("image", ImageType(), "The init image.")
    assert spec.check(None, 2) is None  # optional: absent means text-to-image
    assert spec.check(encoded(rgba(), "PNG"), 2).shape == (12, 20, 3)
    assert InputSpec("mask_image", ImageType(mask=True), "The mask.").check(encoded(rgba(), "PNG"), 1).shape == (12, 20)
    assert spec.schema()["type"] == "string" and spec.type.from_text("image", "a.png") == "a.png"
    with pytest.raises(InvalidArgumentError) as exc:
        spec.check(b"nope", 1)
    one_line(exc, "image")
