"""Host-side schedule arithmetic against torch/diffusers, bit for bit."""

from __future__ import annotations

import sys
import warnings

import numpy as np
import pytest
import torch

import diffusers
from preheat.samplers import SAMPLERS, SchedulerConfig, make_plan
from preheat.samplers import _schedules as S
from tests._support.numerics import assert_within_ulps, correctly_rounded_f32
from tests._support.sampler_ref import torch_train_sigmas

SCHEDULES = [
    ("linear", 0.0001, 0.02),
    ("scaled_linear", 0.00085, 0.012),
    ("squaredcos_cap_v2", 0.0001, 0.02),
]
FMA_CPU = torch.backends.cpu.get_cpu_capability() != "DEFAULT"


def test_linspace_matches_torch() -> None:
    """Bitwise where torch's kernel fuses the multiply-add (its AVX2/AVX-512/NEON builds): one
    IEEE rounding of ``a * b + c`` has a single correct answer. Elsewhere torch rounds twice,
    which is within 1 ulp of ours."""
    rng = np.random.default_rng(0)
    cases = [(0.0001, 0.02, 1000), (0.00085**0.5, 0.012**0.5, 1000), (0.0001, 0.02, 2), (0.5, 0.25, 3)]
    cases += [(float(a), float(a + rng.uniform(0, 1)), int(n))
              for a, n in zip(rng.uniform(1e-5, 0.5, 60), rng.integers(2, 5000, 60))]
    for a, b, n in cases:
        ours = S.torch_linspace_f32(a, b, n)
        theirs = torch.linspace(a, b, n, dtype=torch.float32).numpy()
        assert ours.dtype == np.float32
        if FMA_CPU:
            np.testing.assert_array_equal(ours.view(np.int32), theirs.view(np.int32), err_msg=f"{(a, b, n)}")
        else:
            assert_within_ulps(ours, theirs, 1, f"linspace{(a, b, n)}")


def test_fma_rounds_once_on_a_float32_midpoint() -> None:
    """a*b + c whose float64 sum lands exactly on a float32 midpoint (2**24 + 1) while the exact
    value lies above it: one rounding gives 2**24 + 2, double rounding would give 2**24."""
    found = None
    for m in range(2**23 + 1, 2**23 + 5000):  # m * b = 2**52 + r with 0 < r < 2**22
        b = -(-(2**52) // m)
        r = m * b - 2**52
        if 0 < r < 2**22 and b < 2**29:
            found = (m, b)
            break
    assert found is not None
    m, b = found
    a = np.array([np.float32(m) * np.float32(2.0**-52)], dtype=np.float32)  # exact: m has 24 bits
    assert float(a[0]) * b == pytest.approx(1.0, abs=1e-6)
    c = np.array([2.0**24], dtype=np.float32)
    naive = (a.astype(np.float64) * b + c.astype(np.float64)).astype(np.float32)
    assert naive[0] == 2.0**24  # double rounding lands on the even neighbour below
    assert S._fma_f32(a, np.array([float(b)]), c)[0] == 2.0**24 + 2  # m * b (53 bits) is exact in float64


@pytest.mark.parametrize("num_train", [1000, 777, 2])
@pytest.mark.parametrize("schedule,start,end", SCHEDULES)
def test_betas_and_alphas_cumprod_match_diffusers(schedule: str, start: float, end: float, num_train: int) -> None:
    sched = diffusers.DDPMScheduler(
        num_train_timesteps=num_train, beta_schedule=schedule, beta_start=start, beta_end=end
    )
    b = S.betas(schedule, start, end, num_train)
    ab = S.alphas_cumprod(b)
    if FMA_CPU or schedule == "squaredcos_cap_v2":
        np.testing.assert_array_equal(b, sched.betas.numpy())
        np.testing.assert_array_equal(ab, sched.alphas_cumprod.numpy())
    else:  # torch rounds its linspace twice here (see test_linspace_matches_torch)
        assert_within_ulps(b, sched.betas.numpy(), 2, "betas")  # scaled_linear squares a 1-ulp error
    # the cumulative product itself is exact given the same betas (float64 accumulator, one rounding)
    np.testing.assert_array_equal(S.alphas_cumprod(sched.betas.numpy()), sched.alphas_cumprod.numpy())


@pytest.mark.parametrize("schedule,start,end", SCHEDULES)
def test_train_sigmas_are_correctly_rounded_and_within_one_ulp_of_torch(
    schedule: str, start: float, end: float
) -> None:
    """Ours is IEEE sqrt, exact against a float64 reference. torch's float32 ``** 0.5`` uses a
    kernel chosen per CPU that is not always correctly rounded: each entry is within 1 ulp of
    ours, and how many entries differ depends on the processor, so that is not bounded."""
    ab = S.alphas_cumprod(S.betas(schedule, start, end, 1000))
    ours = S.train_sigmas(ab)
    q = (np.float32(1.0) - ab) / ab  # two IEEE float32 operations: identical in torch (checked)
    t = torch.from_numpy(ab)
    np.testing.assert_array_equal(q, ((1 - t) / t).numpy())
    np.testing.assert_array_equal(ours, correctly_rounded_f32(np.sqrt(q.astype(np.float64))))
    assert_within_ulps(ours, torch_train_sigmas(ab), 1, "training sigmas")


@pytest.mark.parametrize("schedule,start,end", SCHEDULES)
def test_zero_terminal_snr_rescale_matches_diffusers(schedule: str, start: float, end: float, monkeypatch) -> None:
    """``rescale_betas_zero_snr``: every operation of diffusers' rescale, each IEEE float32. With torch's
    own square roots in place of ours the betas are bitwise equal (the rest of its arithmetic is ours);
    with ours, alphas_cumprod stays within 1e-5 of diffusers' (torch's float32 sqrt is not correctly
    rounded on every CPU, and 1000 ratios and their product carry that: ~4e-6 measured). The terminal
    alphas_cumprod is exactly 0 (ddim's class) or 2**-24 (euler's: its largest sigma stays finite)."""
    import diffusers.schedulers.scheduling_ddim as ddim_module

    beta = S.betas(schedule, start, end, 1000)
    theirs = ddim_module.rescale_zero_terminal_snr(torch.from_numpy(beta)).numpy()
    ours = S.rescale_zero_terminal_snr(beta)
    with monkeypatch.context() as torch_roots:  # ours, fed torch's square roots
        torch_roots.setattr(np, "sqrt", lambda x: torch.from_numpy(np.asarray(x)).sqrt().numpy())
        np.testing.assert_array_equal(S.rescale_zero_terminal_snr(beta), theirs)
    ab, ab_theirs = S.alphas_cumprod(ours), S.alphas_cumprod(theirs)
    assert ab[-1] == ab_theirs[-1] == 0 and ours[-1] == 1
    np.testing.assert_allclose(ab[:-1], ab_theirs[:-1], rtol=1e-5)
    config = {"beta_schedule": schedule, "beta_start": start, "beta_end": end, "rescale_betas_zero_snr": True,
              "timestep_spacing": "trailing", "prediction_type": "v_prediction"}
    for cls, sampler in ((diffusers.DDIMScheduler, "ddim"), (diffusers.EulerDiscreteScheduler, "euler")):
        plan = make_plan(SchedulerConfig.from_dict(config), sampler, 4)
        terminal = cls(**config).alphas_cumprod.numpy()[-1]
        assert terminal == (0.0 if sampler == "ddim" else np.float32(2.0**-24))
        if sampler == "ddim":
            assert plan.alpha_bar[0] == 0  # the first step starts at zero SNR
        else:
            assert plan.sigmas[0] == correctly_rounded_f32(np.sqrt((1 - 2.0**-24) / 2.0**-24))


@pytest.mark.parametrize("karras", [False, True])
@pytest.mark.parametrize("schedule,start,end", SCHEDULES)
def test_dpm2_midpoints_match_diffusers(schedule: str, start: float, end: float, karras: bool) -> None:
    """dpm2's second call: at the log-midpoint sigma of each step (KDPM2's ``sigmas_interpol``) within
    1 ulp (ours is correctly rounded; torch's float32 log, lerp and exp are not: the float32 log of a
    sigma ~1e4 alone moves the result by ~10 ulps), and the model's t there (``_sigma_to_t``) within
    1e-3 of a training step; 0 on the last step, where diffusers makes no second call."""
    config = {"beta_schedule": schedule, "beta_start": start, "beta_end": end, "use_karras_sigmas": karras}
    theirs = diffusers.KDPM2DiscreteScheduler(**config)
    for steps in (1, 2, 7, 20, 50):
        theirs.set_timesteps(steps)
        plan = make_plan(SchedulerConfig.from_dict(config), "dpm2", steps)
        mid_theirs = theirs.sigmas_interpol.numpy()[1::2][:steps]  # [s_mid0, s_mid1, ..., 0]
        t_theirs = theirs.timesteps.numpy()[1::2]  # the second calls' t (none on the last step)
        ours = plan.mid_sigmas[:steps]
        assert ours[-1] == mid_theirs[-1] == 0
        np.testing.assert_allclose(ours, mid_theirs, rtol=2e-6)  # torch: up to ~10 ulps at 1e4
        np.testing.assert_array_equal(correctly_rounded_f32(np.sqrt(plan.sigmas[:steps].astype(np.float64)
                                                                    * plan.sigmas[1:steps + 1])), ours)
        np.testing.assert_allclose(plan.mid_timesteps[:steps - 1], t_theirs, atol=1e-3)


@pytest.mark.parametrize("karras", [False, True])
@pytest.mark.parametrize("schedule,start,end", SCHEDULES)
def test_dpm2_a_midpoints_are_the_next_sigma(schedule: str, start: float, end: float, karras: bool,
                                             monkeypatch) -> None:
    """dpm2_a's second call: at the geometric mean of sigma_i and its ``sigma_down = sigma_{i+1}^2 / sigma_i``,
    which is sigma_{i+1} itself (exactly, here). KDPM2Ancestral's float32 tables cancel in sigma_down (off by
    percents, or NaN, from a cosine schedule's ~2e4), so they are compared as diffusers builds them in
    float64: the midpoints within 2e-6 (our sigmas are rounded to float32, theirs not) plus what float64
    still cancels (``2**-52 (sigma_i / sigma_{i+1})^2``: a 2-step cosine schedule's ratio is ~3e6), the t
    there within 1e-3 of a training step."""
    from tests._support import sampler_ref

    config = {"beta_schedule": schedule, "beta_start": start, "beta_end": end, "use_karras_sigmas": karras}
    theirs = diffusers.KDPM2AncestralDiscreteScheduler(**config)
    monkeypatch.setattr(sys.modules[type(theirs).__module__], "np", sampler_ref._Float64Numpy())
    for steps in (1, 2, 7, 20, 50):
        theirs.set_timesteps(steps)
        plan = make_plan(SchedulerConfig.from_dict(config), "dpm2_a", steps)
        ours = plan.mid_sigmas[:steps]
        np.testing.assert_array_equal(ours, plan.sigmas[1:steps + 1])
        mid_theirs = theirs.sigmas_interpol.numpy()[0::2][:steps]  # [s_mid0, s_mid1, ..., 0] (not KDPM2's roll)
        assert theirs.sigmas_interpol.dtype == torch.float64 and ours[-1] == mid_theirs[-1] == 0
        ratio = plan.sigmas[:steps - 1].astype(np.float64) / plan.sigmas[1:steps]
        bound = (2e-6 + 2.0**-52 * ratio**2) * mid_theirs[:-1]
        assert np.all(np.abs(ours[:-1] - mid_theirs[:-1]) <= bound), (ours, mid_theirs)
        np.testing.assert_allclose(plan.mid_timesteps[:steps - 1], theirs.timesteps.numpy()[1::2], atol=1e-3)


@pytest.mark.parametrize("karras", [False, True])
@pytest.mark.parametrize("schedule,start,end", SCHEDULES)
def test_dpmpp_sde_midpoints_match_diffusers(schedule: str, start: float, end: float, karras: bool,
                                             monkeypatch) -> None:
    """dpmpp_sde's second call: its t is DPMSolverSDE's own (``_second_order_timesteps``, float64, from the
    sigmas before their float32 cast), bitwise as float32 given torch's training sigmas (their float32
    ``** 0.5`` is not correctly rounded on every CPU: sampler_ref.torch_train_sigmas); its sigma is the
    correctly rounded geometric mean of the step's float32 sigmas, within 2e-6 of what its ``step``
    computes in torch float32 (``sigma_fn(t + (t_next - t) / 2)``, through log and exp)."""
    from tests._support.sampler_ref import inject_torch_tables

    inject_torch_tables(monkeypatch)
    config = {"beta_schedule": schedule, "beta_start": start, "beta_end": end, "use_karras_sigmas": karras}
    theirs = diffusers.DPMSolverSDEScheduler(**config)
    for steps in (1, 2, 7, 20, 50):
        theirs.set_timesteps(steps)
        plan = make_plan(SchedulerConfig.from_dict(config), "dpmpp_sde", steps)
        np.testing.assert_array_equal(plan.mid_timesteps[:steps - 1],
                                      theirs.timesteps.numpy()[1::2].astype(np.float32))
        sig = theirs.sigmas[0::2]  # [s_0 .. s_{n-1}] float32; the last step has no midpoint
        sig_next = torch.cat([sig[1:], theirs.sigmas[-1:]])
        t, t_next = -sig.log(), -sig_next.log()
        mid_theirs = (-(t + (t_next - t) * 0.5)).exp()[: steps - 1].numpy()
        ours = plan.mid_sigmas[:steps]
        assert ours[-1] == 0
        np.testing.assert_allclose(ours[:-1], mid_theirs, rtol=2e-6)
        np.testing.assert_array_equal(ours, correctly_rounded_f32(np.sqrt(plan.sigmas[:steps].astype(np.float64)
                                                                          * plan.sigmas[1:steps + 1])))


def test_sigma_to_t_matches_diffusers() -> None:
    sched = diffusers.EulerDiscreteScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012)
    log_sigmas = np.log(np.array(((1 - sched.alphas_cumprod) / sched.alphas_cumprod) ** 0.5))
    rng = np.random.default_rng(1)
    sigmas = np.concatenate([np.exp(rng.uniform(-6, 4, 200)), [1e-12, 0.0, 1e6, 0.0291675, 14.6146]])
    ours = S.sigma_to_t(sigmas, log_sigmas)
    theirs = np.array([sched._sigma_to_t(s, log_sigmas) for s in sigmas])
    np.testing.assert_array_equal(ours, theirs)


def test_karras_sigmas_match_diffusers() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sched = diffusers.EulerDiscreteScheduler()
    for n in (1, 2, 7, 50):
        np.testing.assert_array_equal(
            S.karras_sigmas(0.0291675, 14.614647, n),
            sched._convert_to_karras(in_sigmas=np.array([14.614647, 0.0291675]), num_inference_steps=n),
        )


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_plan_shapes_do_not_depend_on_steps(sampler: str) -> None:
    """Every leaf has the same shape and dtype whatever the step count: one compiled program."""
    grid = {"original_inference_steps": 1000} if sampler in ("lcm", "tcd") else {}  # they pick steps from this grid
    config = SchedulerConfig.from_dict({"num_train_timesteps": 1000, **grid})
    plans = [make_plan(config, sampler, n) for n in (1, 7, 20, 999)]
    ref = [(np.shape(x), np.asarray(x).dtype) for x in plans[0]]
    for plan in plans[1:]:
        assert [(np.shape(x), np.asarray(x).dtype) for x in plan] == ref
    assert ref[0] == ((), np.dtype(np.int32))  # n_steps
    assert all(shape in ((), (1001,)) for name, (shape, _) in zip(plans[0]._fields, ref) if name != "lms_coeffs")
    assert np.shape(plans[0].lms_coeffs) == (1001, 4)  # every sampler's, so every plan is one pytree shape
    # pndm lists its second timestep twice (steps + 1 model calls) once there is a second one
    assert [int(p.n_steps) for p in plans] == ([1, 8, 21, 1000] if sampler == "pndm" else [1, 7, 20, 999])


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_plan_padding_is_inert(sampler: str) -> None:
    """Rows past the schedule hold harmless values; the final sigma is 0 (deis: timestep 0's)."""
    config = SchedulerConfig.from_dict({})
    plan = make_plan(config, sampler, 7)
    n = int(plan.n_steps)
    last = n
    if sampler == "deis":
        ab0 = S.alphas_cumprod(S.betas("linear", 0.0001, 0.02, 1000))[0]
        assert plan.sigmas[n] == S.train_sigmas(np.asarray([ab0]))[0] > 0
        last = n + 1
    assert np.all(plan.sigmas[last:] == 0)
    assert np.all(plan.timesteps[n:] == 0)
    assert np.all(plan.alpha_bar[n:] == 1) and np.all(plan.alpha_bar_prev[n:] == 1)
    assert np.all(plan.order[n:] == 1)
    if sampler.startswith("dpmpp_2m"):
        assert plan.order[:n].tolist() == [1, 2, 2, 2, 2, 2, 1]


def test_trailing_spacing_extra_timestep_quirk() -> None:
    """diffusers' 'trailing' spacing yields 62 timesteps, the last -1, for 61 of 1000 steps."""
    ts = S.spaced_timesteps("trailing", 1000, 61, 0)
    assert len(ts) == 62 and ts[-1] == -1


def test_lcm_steps_beyond_its_grid_are_one_line() -> None:
    from preheat.errors import SchedulerConfigError

    cfg = SchedulerConfig.from_dict({"_class_name": "LCMScheduler", "original_inference_steps": 8})
    assert int(make_plan(cfg, "lcm", 8).n_steps) == 8
    with pytest.raises(SchedulerConfigError, match=r"steps=9 .* original_inference_steps \(8\)"):
        make_plan(cfg, "lcm", 9)
    with pytest.raises(SchedulerConfigError, match="timestep_scaling=0.0"):
        SchedulerConfig.from_dict({"timestep_scaling": 0})
