"""The ship gate of the built-in text-to-image model: does an independent classifier read the
prompted digit in what the folder draws?

The classifier is scikit-learn's SVC trained on the real 8x8 digits (values 0..16); a sample
(16x16 RGB uint8) is brought to the same form by its grey level averaged over 2x2 blocks.
Styles are checked by a pixel statistic: "bold" samples carry more ink than "thin" ones.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from preheat.train.text_digits_data import prompt_for

__all__ = ["Agreement", "to_digits_8x8", "check_folder"]


class Agreement(NamedTuple):
    accuracy: float  # share of samples the classifier reads as the prompted digit
    samples: int
    bold_ink: float  # mean ink (0..1) of "a bold D" samples
    thin_ink: float  # ... and of "a thin D" samples


def to_digits_8x8(images: np.ndarray) -> np.ndarray:
    """(N, 16, 16, 3) uint8 -> (N, 64) in load_digits' 0..16 scale (2x2 block means of the grey level)."""
    grey = images.astype(np.float32).mean(-1) / 255.0  # (N, 16, 16)
    n, h, w = grey.shape
    return grey.reshape(n, h // 2, 2, w // 2, 2).mean((2, 4)).reshape(n, -1) * 16.0


def _prompts(samples: int) -> tuple[list[str], np.ndarray]:
    """``samples`` prompts over the 10 digits, word and numeral forms alternating: "a seven", "a 7"."""
    digits = np.arange(samples) % 10
    return [prompt_for(int(d), numeral=bool((i // 10) % 2)) for i, d in enumerate(digits)], digits


def check_folder(folder: str | Path, samples: int = 100, seed: int = 0, **call: Any) -> Agreement:
    """Sample ``samples`` images through ``preheat.load(folder)`` (fixed seed) and score them."""
    from sklearn.datasets import load_digits
    from sklearn.svm import SVC

    import preheat

    digits = load_digits()
    classifier = SVC(gamma=0.001).fit(digits.data, digits.target)
    pipe = preheat.load(folder, cache="off")
    prompts, wanted = _prompts(samples)
    images = np.asarray(pipe.generate(prompts, seed=seed, **call))
    accuracy = float((classifier.predict(to_digits_8x8(images)) == wanted).mean())
    ink = {style: float(np.asarray(pipe.generate([prompt_for(d, style) for d in range(10)], seed=seed + 1, **call)
                                   ).mean() / 255.0) for style in ("bold", "thin")}
    return Agreement(accuracy, samples, ink["bold"], ink["thin"])
