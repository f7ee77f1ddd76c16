"""The built-in text-to-image model's data: scikit-learn's digits, two stroke styles, and prompts.

Images: the 1,797 8x8 ``load_digits`` images (values 0..16), upsampled bilinearly to 16x16,
white ink on black, as RGB in [-1, 1] (the three channels equal: diffusers' VAE is RGB).
Styles, each checkable by a pixel statistic (mean ink):

    ""       the image as it is
    "bold"   strokes dilated: a 2x2 grey-level maximum filter at 16x16 (more ink)
    "thin"   strokes eroded: ink below the stroke's core faded (the image squared in [0, 1]), then
             a 2x2 grey-level minimum filter where it keeps the digit legible (less ink)

Prompts name the digit by word or numeral, with or without an article and a style:
"a seven", "7", "a bold 3", "an eight", "a thin zero". The empty prompt is the null condition
(15% of training examples) that classifier-free guidance needs.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = ["IMAGE_SIZE", "NAMES", "STYLES", "ARTICLES", "WORDS", "PromptTable", "digit_images", "styled",
           "prompt_table", "prompt_for"]

IMAGE_SIZE = 16
NAMES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
STYLES = ("", "bold", "thin")
ARTICLES = ("a", "an", "")
# every whole word of the prompts is one BPE token (numerals are single bytes: already tokens)
WORDS = ("a", "an", *NAMES, "bold", "thin")


def digit_images() -> tuple[np.ndarray, np.ndarray]:
    """(N, 16, 16) float32 ink in [0, 1] (bilinear upsampling of the 8x8 digits), (N,) int32 labels."""
    import jax
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = digits.images.astype(np.float32) / 16.0  # (N, 8, 8)
    x = np.asarray(jax.image.resize(x, (x.shape[0], IMAGE_SIZE, IMAGE_SIZE), "bilinear"))
    return np.clip(x, 0.0, 1.0), digits.target.astype(np.int32)


def styled(ink: np.ndarray, style: str) -> np.ndarray:
    """``ink`` (N, 16, 16) in [0, 1] drawn in ``style`` (one of STYLES), same shape and range."""
    from scipy.ndimage import grey_dilation, grey_erosion

    if style == "":
        return ink
    if style == "bold":
        return grey_dilation(ink, size=(1, 2, 2))
    if style == "thin":
        return grey_erosion(np.square(ink), size=(1, 2, 2)) * 0.5 + np.square(ink) * 0.5
    raise ValueError(f"unknown style {style!r}; choose from {STYLES}")


def to_rgb(ink: np.ndarray) -> np.ndarray:
    """(N, 16, 16) ink in [0, 1] -> (N, 16, 16, 3) in [-1, 1] (what the VAE encodes)."""
    return np.repeat((ink * 2.0 - 1.0)[..., None], 3, axis=-1).astype(np.float32)


def prompt_for(digit: int, style: str = "", numeral: bool = False, article: str = "a") -> str:
    """The prompt text: ``prompt_for(7, "bold")`` -> "a bold seven"."""
    word = str(digit) if numeral else NAMES[digit]
    return " ".join(w for w in (article, style, word) if w)


class PromptTable(NamedTuple):
    """Every training prompt once: ``prompts[i]`` is digit ``digit[i]`` in style ``style[i]``;
    the last prompt is the empty one (the null condition)."""

    prompts: tuple[str, ...]
    digit: np.ndarray  # (P,) int32, -1 for the empty prompt
    style: np.ndarray  # (P,) int32 index into STYLES, -1 for the empty prompt


def prompt_table() -> PromptTable:
    rows = [(prompt_for(d, s, numeral, a), d, i)
            for d in range(10) for i, s in enumerate(STYLES) for numeral in (False, True) for a in ARTICLES]
    rows.append(("", -1, -1))
    prompts, digit, style = zip(*rows)
    return PromptTable(tuple(prompts), np.asarray(digit, np.int32), np.asarray(style, np.int32))
