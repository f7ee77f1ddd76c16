"""The comparison helpers themselves, including the case another CPU would produce: a torch
table that is one ulp off somewhere else than on this machine."""

from __future__ import annotations

import numpy as np
import pytest

from tests._support.numerics import assert_within_ulps, correctly_rounded_f32, ulp_distance


def test_ulp_distance_counts_float32_steps_across_zero():
    x = np.float32(1.0)
    up = np.nextafter(x, np.float32(2))
    assert ulp_distance(x, x)[0] == 0
    assert ulp_distance(x, up)[0] == 1
    assert ulp_distance(np.float32(0.0), np.float32(-0.0))[0] == 0
    tiny = np.nextafter(np.float32(0), np.float32(1))
    assert ulp_distance(tiny, -tiny)[0] == 2


def test_one_ulp_off_anywhere_passes_and_two_fail():
    rng = np.random.default_rng(0)
    ours = np.sqrt(rng.uniform(0.01, 100, 1000).astype(np.float32))
    for fraction in (0.0, 0.05, 0.2, 1.0):  # how many entries a given CPU's kernel rounds differently
        theirs = ours.copy()
        idx = rng.choice(ours.size, int(fraction * ours.size), replace=False)
        direction = np.where(rng.random(idx.size) < 0.5, np.float32(np.inf), np.float32(-np.inf))
        theirs[idx] = np.nextafter(ours[idx], direction)
        assert_within_ulps(ours, theirs, 1)
    theirs = ours.copy()
    theirs[7] = np.nextafter(np.nextafter(ours[7], np.float32(np.inf)), np.float32(np.inf))
    with pytest.raises(AssertionError, match="2 ulp"):
        assert_within_ulps(ours, theirs, 1)


def test_nan_is_never_within_bounds():
    with pytest.raises(AssertionError, match="NaN"):
        assert_within_ulps(np.float32(np.nan), np.float32(np.nan))


def test_correctly_rounded_sqrt_reference():
    rng = np.random.default_rng(1)
    q = rng.uniform(1e-6, 1e6, 10_000).astype(np.float32)
    # numpy's float32 sqrt is IEEE (correctly rounded); the float64 route must agree exactly
    np.testing.assert_array_equal(np.sqrt(q), correctly_rounded_f32(np.sqrt(q.astype(np.float64))))
