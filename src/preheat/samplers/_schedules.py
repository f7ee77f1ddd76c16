"""Noise schedules on the host, in numpy, bit-for-bit with diffusers on a CPU.

diffusers builds its tables with torch float32 CPU kernels and then switches to numpy float64
for timestep spacing and interpolation. We reproduce each rounding step, not just the math:

* ``torch.linspace`` (CPU, float32) evaluates ``start + step * i`` (first half) and
  ``end - step * (n - 1 - i)`` (second half) in float32 with the multiply-add *fused*
  (one rounding; the kernel is compiled with FMA contraction on x86-64 AVX2/AVX-512 and
  aarch64). :func:`torch_linspace_f32` reproduces that. On a CPU without FMA, torch itself
  would round twice and differ from both us and other machines in the last bit.
* ``torch.cumprod`` (CPU, float32) accumulates in float64 and rounds each output to float32.
* timestep spacing, ``np.interp`` and the Karras ramp are float64 numpy, as in diffusers.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

from preheat.errors import SchedulerConfigError

__all__ = [
    "torch_linspace_f32",
    "betas",
    "alphas_cumprod",
    "train_sigmas",
    "spaced_timesteps",
    "interp_sigmas",
    "karras_sigmas",
    "sigma_to_t",
    "flux_sigmas",
    "flow_sigma_range",
    "flow_shift",
    "flow_time_shift",
    "flow_stretch_to_terminal",
    "exponential_sigmas",
    "edm_sigmas",
    "edm_noise",
    "rescale_zero_terminal_snr",
]

_F32 = np.float32


def _fma_f32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Elementwise ``a * b + c`` rounded once to float32 (1-D; a, c float32, b an integer < 2**29).

    The float64 product of a 24-bit mantissa and a small integer is exact, so the float64
    sum has one rounding. Rounding that again to float32 can only differ from a single
    rounding when the float64 sum lands exactly on a float32 midpoint; those rare entries
    are settled with exact rationals.
    """
    a64, b64, c64 = (np.asarray(v, dtype=np.float64) for v in (a, b, c))
    s64 = a64 * b64 + c64
    out = s64.astype(_F32)
    up = np.nextafter(out, _F32(np.inf)).astype(np.float64)
    down = np.nextafter(out, _F32(-np.inf)).astype(np.float64)
    here = out.astype(np.float64)
    on_mid = (s64 == (here + up) / 2) | (s64 == (here + down) / 2)
    for k in np.flatnonzero(on_mid):
        exact = Fraction(a64[k]) * Fraction(b64[k]) + Fraction(c64[k])
        mid = Fraction(s64[k])
        if exact != mid:  # the true value is off the midpoint: round towards it
            lo_hi = sorted((here[k], up[k] if s64[k] > here[k] else down[k]))
            out[k] = _F32(lo_hi[1] if exact > mid else lo_hi[0])
    return out


def torch_linspace_f32(start: float, end: float, n: int) -> np.ndarray:
    """``torch.linspace(start, end, n, dtype=torch.float32)`` as the CPU kernel computes it."""
    if n == 1:
        return np.array([start], dtype=_F32)
    s, e = _F32(start), _F32(end)
    step = (e - s) / _F32(n - 1)  # float32 division, as the kernel
    i = np.arange(n)
    first = i < n // 2
    k = np.where(first, i, n - 1 - i).astype(_F32)
    out = np.where(
        first,
        _fma_f32(np.full(n, step), k, np.full(n, s)),
        _fma_f32(np.full(n, -step), k, np.full(n, e)),
    )
    return out.astype(_F32)


def betas(schedule: str, beta_start: float, beta_end: float, num_train: int) -> np.ndarray:
    """float32 betas ``[num_train]`` for one of the supported ``beta_schedule`` values."""
    if schedule == "linear":
        return torch_linspace_f32(beta_start, beta_end, num_train)
    if schedule == "scaled_linear":
        r = torch_linspace_f32(beta_start**0.5, beta_end**0.5, num_train)
        return (r * r).astype(_F32)  # torch ``** 2`` is one float32 multiply
    if schedule == "squaredcos_cap_v2":
        # Nichol & Dhariwal's cosine alpha-bar, discretised in Python float64 then float32.
        def alpha_bar(t: float) -> float:
            return math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2

        out = [
            min(1 - alpha_bar((i + 1) / num_train) / alpha_bar(i / num_train), 0.999)
            for i in range(num_train)
        ]
        return np.asarray(out, dtype=np.float64).astype(_F32)
    raise SchedulerConfigError(
        f"beta_schedule={schedule!r} is not supported; supported: linear, scaled_linear, squaredcos_cap_v2"
    )


def alphas_cumprod(beta: np.ndarray) -> np.ndarray:
    """float32 ``cumprod(1 - beta)`` with torch's CPU float64 accumulator."""
    alphas = (_F32(1.0) - beta).astype(_F32)
    return np.cumprod(alphas.astype(np.float64)).astype(_F32)


def train_sigmas(alpha_bar: np.ndarray) -> np.ndarray:
    """float32 ``sqrt((1 - a) / a)`` per training timestep (ascending in t)."""
    return np.sqrt((_F32(1.0) - alpha_bar) / alpha_bar).astype(_F32)


def spaced_timesteps(
    spacing: str, num_train: int, steps: int, offset: int, *, top: int | None = None, extra_point: bool = False
) -> np.ndarray:
    """Descending float64 timesteps for ``steps`` inference steps (not yet rounded/cast).

    ``top`` replaces ``num_train`` as the upper end of the range (dpm++'s
    ``lambda_min_clipped``); ``extra_point`` spaces ``steps + 1`` points and drops the
    lowest (dpm++ does so for linspace and leading spacing).
    """
    top = num_train if top is None else top
    points = steps + 1 if extra_point else steps
    if spacing == "linspace":
        ts = np.linspace(0, top - 1, points)[::-1][:steps]
    elif spacing == "leading":
        ratio = top // points
        ts = (np.arange(0, points) * ratio).round()[::-1][:steps] + offset
    elif spacing == "trailing":
        ts = np.round(np.arange(top, 0, -num_train / steps)) - 1
    else:
        raise SchedulerConfigError(
            f"timestep_spacing={spacing!r} is not supported; supported: leading, linspace, trailing"
        )
    return np.ascontiguousarray(ts, dtype=np.float64)


def lcm_timesteps(num_train: int, original_steps: int, steps: int, sampler: str = "lcm") -> np.ndarray:
    """LCMScheduler's (and TCDScheduler's) descending int64 timesteps: ``steps`` evenly spaced
    indices into the distillation grid ``k - 1, 2k - 1, .., original_steps * k - 1``
    (``k = num_train // original_steps``)."""
    if original_steps > num_train:
        raise SchedulerConfigError(f"original_inference_steps={original_steps} is not supported; it must be <= "
                                   f"num_train_timesteps ({num_train})")
    if steps > original_steps:
        raise SchedulerConfigError(f"steps={steps} is not supported for sampler {sampler!r}; it must be <= "
                                   f"original_inference_steps ({original_steps}), the grid it picks steps from")
    k = num_train // original_steps
    grid = (np.arange(1, original_steps + 1) * k - 1)[::-1]  # [original_steps] descending
    picks = np.floor(np.linspace(0, len(grid), num=steps, endpoint=False)).astype(np.int64)
    return grid[picks].astype(np.int64)


def interp_sigmas(timesteps: np.ndarray, sigmas_train: np.ndarray) -> np.ndarray:
    """float64 sigmas at (possibly fractional) timesteps, linear in t as diffusers does."""
    return np.interp(timesteps, np.arange(0, len(sigmas_train)), sigmas_train)


def karras_sigmas(sigma_min: float, sigma_max: float, steps: int, rho: float = 7.0) -> np.ndarray:
    """Karras et al. (2022) ramp, uniform in ``sigma ** (1 / rho)``; float64 ``[steps]``."""
    ramp = np.linspace(0, 1, steps)
    min_inv = float(sigma_min) ** (1 / rho)
    max_inv = float(sigma_max) ** (1 / rho)
    return (max_inv + ramp * (min_inv - max_inv)) ** rho


def sigma_to_t(sigmas: np.ndarray, log_train_sigmas: np.ndarray) -> np.ndarray:
    """Fractional timesteps whose (log-linearly interpolated) train sigma equals ``sigmas``.

    The log is taken element by element on float64 scalars, as diffusers does, because
    numpy's vectorised log may differ from its scalar log in the last bit.
    """
    log_train = log_train_sigmas
    n = log_train.shape[0]
    out = np.empty(len(sigmas), dtype=np.float64)
    for j, sigma in enumerate(np.asarray(sigmas, dtype=np.float64)):
        log_sigma = np.log(np.maximum(sigma, 1e-10))
        # last train index whose log-sigma is <= log_sigma (0 if none), kept below n - 1
        low = min(max(int(np.count_nonzero(log_sigma - log_train >= 0)) - 1, 0), n - 2)
        lo, hi = log_train[low], log_train[low + 1]
        w = np.clip((lo - log_sigma) / (lo - hi), 0, 1)
        out[j] = (1 - w) * low + w * (low + 1)
    return out


# --- flow matching (FlowMatchEulerDiscreteScheduler / FlowMatchHeunDiscreteScheduler) ------------
# diffusers mixes dtypes here: the training table is torch float32, the
# default schedule float64 numpy, custom sigmas float32 numpy. Each function below is written
# exactly as diffusers' expression, so that applied to an array of the same dtype it rounds the
# same way (numpy >= 2 keeps a Python scalar "weak": float32 array op float -> float32, as torch).


def flux_sigmas(steps: int) -> np.ndarray:
    """The custom sigmas FluxPipeline passes to ``set_timesteps``: float64 ``[steps]``."""
    return np.linspace(1.0, 1 / steps, steps)


def flow_shift(sigmas: np.ndarray, shift: float) -> np.ndarray:
    """The static resolution-independent shift ``shift * s / (1 + (shift - 1) * s)``."""
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def flow_sigma_range(num_train: int, shift: float, dynamic: bool) -> tuple[float, float]:
    """(sigma_max, sigma_min) of diffusers' float32 training table, shifted unless ``dynamic``.

    The constructor computes ``linspace(1, T, T) / T`` (torch float32) and shifts it *before*
    ``set_timesteps`` shifts again; only the two ends are used afterwards.
    """
    ends = np.array([num_train, 1], dtype=_F32) / num_train  # IEEE float32 division, as torch
    if not dynamic:
        ends = flow_shift(ends, shift)
    return ends[0].item(), ends[1].item()


def flow_time_shift(kind: str, mu: float, t: np.ndarray) -> np.ndarray:
    """Resolution-dependent shift (``use_dynamic_shifting``); diffusers' ``time_shift(mu, 1.0, t)``."""
    sigma = 1.0
    if kind == "exponential":
        return math.exp(mu) / (math.exp(mu) + (1 / t - 1) ** sigma)
    if kind == "linear":
        return mu / (mu + (1 / t - 1) ** sigma)
    raise SchedulerConfigError(f"time_shift_type={kind!r} is not supported; supported: 'exponential', 'linear'")


def flow_stretch_to_terminal(t: np.ndarray, shift_terminal: float) -> np.ndarray:
    """Stretch the schedule so that its last value is ``shift_terminal`` (LTX-Video)."""
    one_minus_z = 1 - t
    scale_factor = one_minus_z[-1] / (1 - shift_terminal)
    return 1 - (one_minus_z / scale_factor)


def exponential_sigmas(sigma_min: float, sigma_max: float, steps: int) -> np.ndarray:
    """Uniform in log sigma from ``sigma_max`` to ``sigma_min``; float64 ``[steps]``."""
    return np.exp(np.linspace(math.log(sigma_max), math.log(sigma_min), steps))


# --- EDM (EDMEulerScheduler / EDMDPMSolverMultistepScheduler) -----------------------------------
# Both classes build their sigmas with torch: EDMEulerScheduler's Karras ramp in float64,
# EDMDPMSolverMultistepScheduler's in float32, and both exponential schedules in float32
# (``torch.linspace``'s default dtype), then ``c_noise = 0.25 * log(sigma)`` in float32. torch's
# float32 ``pow``, ``exp`` and ``log`` kernels are not correctly rounded (within 1 ulp); ours are
# (float64, rounded once), so a few entries may sit 1 ulp from torch's (tests/samplers bounds them).


def _round_f32(values: np.ndarray) -> np.ndarray:
    return np.asarray(values, np.float64).astype(_F32)


def edm_sigmas(schedule: str, sigma_min: float, sigma_max: float, rho: float, steps: int,
               float32_ramp: bool) -> np.ndarray:
    """The EDM classes' float32 ``[steps]`` sigmas, ``sigma_max`` down to ``sigma_min``:
    Karras et al.'s ramp (uniform in ``sigma ** (1 / rho)``; its ramp float32 when
    ``float32_ramp``, as EDMDPMSolverMultistepScheduler's) or uniform in log sigma."""
    if schedule == "exponential":  # torch.linspace(log min, log max, n).exp().flip(0), float32
        logs = torch_linspace_f32(math.log(sigma_min), math.log(sigma_max), steps)
        return _round_f32(np.exp(logs.astype(np.float64)))[::-1].copy()
    if schedule != "karras":
        raise SchedulerConfigError(f"sigma_schedule={schedule!r} is not supported; supported: 'karras', "
                                   "'exponential'")
    min_inv, max_inv = sigma_min ** (1 / rho), sigma_max ** (1 / rho)  # Python floats, as diffusers
    if not float32_ramp:
        return _round_f32((max_inv + np.linspace(0.0, 1.0, steps) * (min_inv - max_inv)) ** rho)
    ramp = torch_linspace_f32(0.0, 1.0, steps)
    base = ramp * _F32(min_inv - max_inv) + _F32(max_inv)  # [steps] two float32 roundings, as torch
    return _round_f32(base.astype(np.float64) ** rho)


def edm_noise(sigmas: np.ndarray) -> np.ndarray:
    """``c_noise = log(sigma) / 4``, the time the network sees (float32; the quarter is exact)."""
    return (_round_f32(np.log(np.asarray(sigmas, np.float64))) * _F32(0.25)).astype(_F32)


def rescale_zero_terminal_snr(beta: np.ndarray) -> np.ndarray:
    """Betas rescaled to zero terminal SNR (Lin et al. 2024, Algorithm 1; ``rescale_betas_zero_snr``):
    ``sqrt(alphas_cumprod)`` shifted to end at 0 and scaled to keep its first value, then turned back
    into betas -- float32, operation for operation as diffusers' torch ``rescale_zero_terminal_snr``."""
    root = np.sqrt(alphas_cumprod(beta))  # [T] float32, IEEE sqrt as torch's
    first, last = root[0], root[-1]
    root = (root - last).astype(_F32)
    root = (root * (first / (first - last))).astype(_F32)  # two float32 scalar operations, then one multiply
    bar = (root * root).astype(_F32)  # torch ``** 2``: one multiply
    alphas = np.concatenate([bar[:1], bar[1:] / bar[:-1]]).astype(_F32)
    return (_F32(1.0) - alphas).astype(_F32)
