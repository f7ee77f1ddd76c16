"""Float comparisons that hold on every CPU: exact where exactness is a property, ulp-bounded
where two libraries compute a rounded function their own way.

IEEE 754 requires +, -, *, / and sqrt to be correctly rounded, so a float32 result computed by
numpy (which uses those operations) is exact and machine-independent. torch's float32 CPU
kernels for ``sqrt``/``pow``/``exp``/``log`` are picked per CPU (SLEEF, MKL VML, AVX2 or
AVX-512 code paths) and promise only about 1 ulp, so which entries of a table land one ulp
off changes from one processor to the next. Tests therefore compare our (correctly rounded)
values with torch's within ``max_ulps`` per element, with no cap on how many elements differ,
and check our side exactly against a float64 reference.
"""

from __future__ import annotations

import numpy as np

__all__ = ["ulp_distance", "assert_within_ulps", "correctly_rounded_f32", "assert_pixels_close", "px_diff", "mean_abs_px"]


def _ordered(x: np.ndarray) -> np.ndarray:
    """float32 bits mapped to integers that increase with the float (so adjacent floats differ by 1)."""
    bits = np.asarray(x, dtype=np.float32).view(np.int32).astype(np.int64)
    return np.where(bits < 0, -(bits & 0x7FFFFFFF), bits)


def ulp_distance(a, b) -> np.ndarray:
    """Elementwise number of float32 steps between ``a`` and ``b`` (0 = bitwise equal; +0 == -0)."""
    a32 = np.atleast_1d(np.asarray(a, dtype=np.float32))
    b32 = np.atleast_1d(np.asarray(b, dtype=np.float32))
    if np.isnan(a32).any() or np.isnan(b32).any():
        raise AssertionError("NaN in a float comparison")
    return np.abs(_ordered(a32) - _ordered(b32))


def assert_within_ulps(ours, theirs, max_ulps: int = 1, what: str = "") -> None:
    """Every element of ``ours`` within ``max_ulps`` float32 steps of ``theirs``."""
    d = ulp_distance(ours, theirs)
    if d.size and int(d.max()) > max_ulps:
        i = int(np.argmax(d))
        raise AssertionError(
            f"{what or 'values'} differ by {int(d.max())} ulp (> {max_ulps}) at index {i}: "
            f"{np.atleast_1d(ours).ravel()[i]!r} vs {np.atleast_1d(theirs).ravel()[i]!r}")


def correctly_rounded_f32(exact_f64) -> np.ndarray:
    """The float32 nearest a float64 value. For sqrt of a float32 input this *is* the correctly
    rounded float32 sqrt: float64 carries more than 2 * 24 + 2 bits, so no double rounding."""
    return np.asarray(exact_f64, dtype=np.float64).astype(np.float32)


def assert_pixels_close(ours: np.ndarray, theirs: np.ndarray, mean_tol: float = 1.0, max_tol: int = 8,
                        shape: tuple[int, ...] | None = None) -> None:
    """uint8 images within the parity suites' bound of a reference (mean |Δ| <= ``mean_tol`` levels
    of 255, max <= ``max_tol``), and not a flat image (a bound a blank output would also meet)."""
    assert ours.shape == theirs.shape and ours.dtype == np.uint8, (ours.shape, theirs.shape, ours.dtype)
    if shape is not None:
        assert ours.shape == shape, ours.shape
    diff = px_diff(ours, theirs)
    print(f"mean |Δpx| {diff.mean():.4f}, max {diff.max()}")
    assert diff.mean() <= mean_tol and diff.max() <= max_tol, (diff.mean(), diff.max())
    assert ours.std() > 5  # not a flat image


def px_diff(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """|a - b| of two uint8 images (or batches), per pixel, in levels of 255 (int32: no wrap-around)."""
    return np.abs(np.asarray(a).astype(np.int32) - np.asarray(b).astype(np.int32))


def mean_abs_px(a: np.ndarray, b: np.ndarray) -> float:
    """Mean |difference| of two uint8 images, in levels of 255 (how far an input moved an image)."""
    return float(px_diff(a, b).mean())


def counting_traces(pipe):
    """(a copy of ``pipe`` with no executables, the list its denoiser's traces append to): a call
    that reuses a program adds nothing; one that needs a new program adds a trace."""
    import dataclasses

    from preheat.cache.executables import Executables

    pipe = dataclasses.replace(pipe, executables=Executables())
    traces: list[int] = []
    apply = pipe.apply

    def counting(*args):
        traces.append(1)
        return apply(*args)

    pipe.apply = counting
    return pipe, traces
