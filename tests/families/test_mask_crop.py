"""``padding_mask_crop``'s host side (``preheat.families.mask_crop``) is diffusers' to the pixel:
the crop box (``VaeImageProcessor.get_crop_region``), the image and mask cropped and filled to the
output size (``preprocess(crops_coords=..., resize_mode="fill")``) and the output pasted back
(``apply_overlay``), on masks by every edge, boxes of every aspect, and outputs wider, taller and
square -- so a crop's pixels can differ from diffusers' only by what the model makes of them."""

from __future__ import annotations

import numpy as np
import pytest

from preheat.errors import InvalidArgumentError
from preheat.families import mask_crop


def _pil(array: np.ndarray):
    from PIL import Image

    return Image.fromarray(array)


def _processors():
    from diffusers.image_processor import VaeImageProcessor

    image = VaeImageProcessor(vae_scale_factor=8)  # what diffusers' inpaint pipelines build
    mask = VaeImageProcessor(vae_scale_factor=8, do_normalize=False, do_binarize=True, do_convert_grayscale=True)
    return image, mask


def _cases(count: int) -> list[tuple[np.ndarray, int, int, int]]:
    """(mask (H, W), width, height, pad): a box of one grey level anywhere (often by an edge), at
    times a stray white pixel, outputs of every aspect, pads from 0 to past the image."""
    rng = np.random.default_rng(7)
    cases = []
    for _ in range(count):
        h, w = (int(v) for v in rng.integers(8, 64, 2))
        m = np.zeros((h, w), np.uint8)
        top, left = int(rng.integers(0, h)), int(rng.integers(0, w))
        m[top: int(rng.integers(top + 1, h + 1)), left: int(rng.integers(left + 1, w + 1))] = rng.integers(1, 256)
        if rng.random() < 0.3:
            m[rng.integers(0, h), rng.integers(0, w)] = 255
        width, height = (int(v) * 8 for v in rng.integers(1, 9, 2))
        cases.append((m, width, height, int(rng.integers(0, 40))))
    return cases


def test_the_box_the_crops_and_the_paste_back_are_diffusers():
    image_processor, mask_processor = _processors()
    rng = np.random.default_rng(8)
    filled = 0
    for m, width, height, pad in _cases(150):
        theirs = image_processor.get_crop_region(_pil(m), width, height, pad=pad)
        box = mask_crop.crop_region(m, width, height, pad)
        assert tuple(box) == tuple(theirs), (m.shape, width, height, pad)
        left, top, right, bottom = box
        filled += (right - left) * height != (bottom - top) * width  # the box is not the output's aspect

        image = rng.integers(0, 256, (*m.shape, 3), dtype=np.uint8)
        pixels = image_processor.preprocess(_pil(image), height=height, width=width, crops_coords=theirs,
                                            resize_mode="fill")[0].numpy().transpose(1, 2, 0)
        ours = mask_crop.fill_resized(image[top:bottom, left:right], width, height)
        np.testing.assert_array_equal(ours.astype(np.float32) / 255 * 2 - 1, pixels)
        mask = mask_processor.preprocess(_pil(m), height=height, width=width, crops_coords=theirs,
                                         resize_mode="fill")[0, 0].numpy()
        ours = mask_crop.fill_resized(m[top:bottom, left:right], width, height).astype(np.float32) / 255
        np.testing.assert_array_equal(np.where(ours < 0.5, 0.0, 1.0), mask)

        generated = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
        pasted = image_processor.apply_overlay(_pil(m), _pil(image), _pil(generated), theirs)
        np.testing.assert_array_equal(mask_crop.overlay(generated, image, m, box), np.asarray(pasted))
    assert filled > 20  # the fill's stretched edges were exercised, not only exact aspects


def test_a_box_by_the_edge_is_shifted_back_inside():
    m = np.zeros((32, 48), np.uint8)
    m[26:31, 34:43] = 255  # 9 x 5, padded by 2 to 13 x 8 (clamped at the bottom)
    assert mask_crop.crop_region(m, 32, 32, 2) == (32, 19, 45, 32)  # grown to 13 x 13, moved up by 3
    assert mask_crop.crop_region(m, 32, 32, 100) == (0, 0, 48, 32)  # past the image: all of it


def test_an_all_black_mask_has_no_box():
    with pytest.raises(InvalidArgumentError) as info:
        mask_crop.crop_region(np.zeros((16, 16), np.uint8), 32, 32, 2)
    assert info.value.argument == "padding_mask_crop" and "\n" not in str(info.value)
