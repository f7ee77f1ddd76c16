"""Diffusion samplers as pure JAX functions, numerically matching diffusers' schedulers.

Design (k-diffusion's shape, optax-style pure functions): a sampler sees the model only as a
callable; schedules (host, numpy) are separate from solvers (device, jax); there is no hidden
step counter -- the step index is an argument and all carried data is in the solver's state, a
NamedTuple of that solver's own type (each solver is a pair of pure functions ``init`` / ``step``
over it, optax's way; ``SamplerState`` is any of them); noise is supplied explicitly by the caller.

Where the code lives: ``_tables`` and ``_config`` (the config keys each diffusers class reads),
``_schedules``, ``_rows`` and ``_plan`` (host: diffusers' ``set_timesteps`` into a padded ``Plan``),
``_core``, ``_onestep``, ``_multistep`` and ``_loop`` (device: the shared math, the solvers that
remember nothing, the ones that remember earlier steps, and the loop generic over them).

Public API::

    SAMPLERS: tuple[str, ...]                 # DIFFUSION_SAMPLERS + FLOW_SAMPLERS + EDM_SAMPLERS
    DIFFUSION_SAMPLERS: tuple[str, ...]       # ddpm .. dpmpp_2m_karras, lcm, tcd, unipc, dpmpp_2m_sde(_karras), pndm,
                                              #   deis, lms, dpm2, dpm2_a, dpmpp_sde, dpmpp_2s(_karras)
    FLOW_SAMPLERS: tuple[str, ...]            # ("flow_euler", "flow_heun")
    EDM_SAMPLERS: tuple[str, ...]             # ("edm_euler", "edm_dpmpp_2m", "edm_dpmpp_2m_sde")
    DETERMINISTIC_SAMPLERS: tuple[str, ...]   # samplers without per-step noise (flow ones included)
    MU_SIGMAS_SAMPLERS: tuple[str, ...]       # samplers whose make_plan takes mu / sigmas
    TIMESTEPS_SAMPLERS: tuple[str, ...]       # samplers whose make_plan takes custom timesteps (lcm, tcd)
    TIMESTEP_SPACINGS: tuple[str, ...]        # ("leading", "linspace", "trailing")
    DIFFUSERS_CLASS: dict[str, str]           # sampler -> the diffusers scheduler class it reproduces
    DPM_FIXED_SETTINGS: dict[str, dict]       # dpm++ sampler -> the settings of its class its name fixes
    SchedulerConfig.from_dict(d: Mapping) -> SchedulerConfig      # diffusers scheduler_config.json
    SchedulerConfig.from_file(path) -> SchedulerConfig
    load_scheduler_config(config | dict | file | folder) -> SchedulerConfig
    with_overrides(config, sampler, {key: value}) -> SchedulerConfig   # Class.from_config(config, key=value)
    find_scheduler_config(pipeline_root, model_dir) -> path of scheduler_config.json
    make_spec(config, sampler: str) -> SolverSpec                   # static: jit static argument
    make_plan(config, sampler: str, steps: int, *, eta: float = 0.0,
              mu: float | None = None, sigmas: array | None = None,
              timesteps: ints | None = None) -> Plan      # runtime pytree
    flow_mu(config, image_seq_len: int) -> float    # mu for use_dynamic_shifting (calculate_shift)
    flux_sigmas(steps: int) -> np.ndarray          # the custom sigmas FluxPipeline passes
    config_kind(config) -> "flow" | "diffusion" | "edm" | None
    samplers_of_kind(config) -> the samplers that config takes (all when its kind is unknown)
    init(spec, plan, noise) -> SamplerState   # the solver's own state type (a NamedTuple, the sample x first)
    step(spec, model, plan, state, i, noise_fn) -> SamplerState
    denoise_loop(spec, model, plan, noise, noise_fn, start=None, restart=None) -> x0   # init + lax.fori_loop
                                                                 #   (restart: a fresh solver from that step)
    Start(index, x0, pure_noise, keep=None)   # img2img / inpainting: begin at step index from x0
    noised(spec, plan, x0, noise, i) -> x_i   # diffusers' add_noise / scale_noise at step i
    strength_start(steps, strength, rule) -> index   # the pipeline's get_timesteps(strength)
    handoff_step(plan, T, fraction) -> index   # denoising_end / denoising_start: where a second pipeline goes on

    model(x_in, t) -> raw output   # x_in shaped like the sample, t a float32 scalar timestep
    noise_fn(i, k) -> noise        # standard normal, shaped like the sample; draw k of step i

Samplers (the diffusers class each reproduces; "static steps?" = does a different step
count need a recompile)::

    sampler          diffusers class (settings)                         model calls/step   static steps?
    ---------------  -------------------------------------------------  -----------------  -------------
    ddpm             DDPMScheduler (fixed_small, fixed_small_log,       1                  no
                     fixed_large)
    ddim             DDIMScheduler (eta is runtime data in the Plan)    1                  no
    euler            EulerDiscreteScheduler                             1                  no
    euler_a          EulerAncestralDiscreteScheduler                    1                  no
    heun             HeunDiscreteScheduler                              2 (1 on the last)  no
    dpmpp_2m         DPMSolverMultistepScheduler (dpmsolver++, order 2, 1                  no
                     midpoint, lower_order_final)
    dpmpp_2m_karras  same, use_karras_sigmas=True                       1                  no
    lcm              LCMScheduler (original_inference_steps,            1                  no
                     timestep_scaling; re-noised between steps)
    tcd              TCDScheduler (original_inference_steps; eta =      1                  no
                     gamma is runtime data in the Plan)
    unipc            UniPCMultistepScheduler (predict_x0; bh2, bh1;     1                  no
                     solver_order 1..3, lower_order_final,
                     disable_corrector, Karras, final_sigmas_type)
    dpmpp_2m_sde     DPMSolverMultistepScheduler (sde-dpmsolver++,      1                  no
                     order 2, midpoint, lower_order_final; one noise
                     draw per step from noise_fn)
    dpmpp_2m_sde_karras  same, use_karras_sigmas=True                   1                  no
    pndm             PNDMScheduler (skip_prk_steps=True: PLMS; steps    1 (steps + 1 calls  no
                     + 1 rows, the second timestep twice; set_alpha_     for steps >= 2)
                     to_one; epsilon / v_prediction)
    deis             DEISMultistepScheduler (log-rho on eps; solver_     1                  no
                     order 1..3, lower_order_final, Karras; the last
                     step lands on timestep 0's sigma, not 0)
    lms              LMSDiscreteScheduler (order 4: this and the last    1                  no
                     three derivatives, exact Lagrange integrals in
                     the Plan; Karras)
    dpm2             KDPM2DiscreteScheduler (Euler to the log-midpoint  2 (1 on the last)  no
                     sigma, the model there, the step along its
                     derivative; Karras)
    dpm2_a           KDPM2AncestralDiscreteScheduler (DPM2 aimed at     2 (1 on the last)  no
                     sigma_down, then noise of std sigma_up; Karras)
    dpmpp_sde        DPMSolverSDEScheduler (two ancestral DPM-Solver-1  2 (1 on the last)  no
                     moves, to the log-midpoint and on; their noises
                     one Brownian path's, two draws a step; Karras)
    dpmpp_2s         DPMSolverSinglestepScheduler (dpmsolver++, order   1                  no
                     2, midpoint: singlestep pairs, the second from
                     the pair's start; linspace timesteps always)
    dpmpp_2s_karras  same, use_karras_sigmas=True                       1                  no
    flow_euler       FlowMatchEulerDiscreteScheduler (shift, dynamic     1                  no
                     shifting with mu, custom sigmas, invert_sigmas,
                     shift_terminal, Karras / exponential sigmas)
    flow_heun        FlowMatchHeunDiscreteScheduler (shift)              2 (1 on the last)  no
    edm_euler        EDMEulerScheduler (sigma_data, karras /             1                  no
                     exponential sigmas, rho, final_sigmas_type)
    edm_dpmpp_2m     EDMDPMSolverMultistepScheduler (dpmsolver++;       1                  no
                     solver_order 1..2, midpoint / heun,
                     lower_order_final, euler_at_final)
    edm_dpmpp_2m_sde same, sde-dpmsolver++ (one noise draw per step)   1                  no

Diffusion vs flow matching vs EDM: a config saved by a ``FlowMatch*`` class (``_class_name``) takes
only FLOW_SAMPLERS, an ``EDM*`` class only EDM_SAMPLERS, any other class only DIFFUSION_SAMPLERS;
without ``_class_name`` the keys decide (``shift``, ``use_dynamic_shifting``, ... mean flow;
``sigma_data``, ``sigma_schedule``, ``rho`` mean EDM; ``beta_schedule``, ``prediction_type``, ...
mean diffusion; none: any sampler). EDM samplers feed the model ``c_in x`` at ``t = c_noise =
log(sigma) / 4`` and take ``x0 = c_skip x + c_out F`` from its output (``SolverSpec.sigma_data``).
Another kind's samplers are a one-line ``SchedulerConfigError`` naming the accepted ones. Flow samplers feed the
model the sample unscaled at ``t = sigma * num_train_timesteps`` and read its output as the
velocity ``noise - x0`` (``SolverSpec.prediction_type == "flow"``); ``init_noise_sigma`` is 1.
What a pipeline passes to ``set_timesteps`` is a ``make_plan`` argument, so data: ``mu``
(required with ``use_dynamic_shifting``; compute it with ``flow_mu`` from the image's token
count) and custom ``sigmas`` (Flux: ``flux_sigmas(steps)``), for flow_euler only, as only
its diffusers class takes them.

No sampler needs a static step count: the schedule is a ``Plan`` of arrays padded to
``num_train_timesteps + 1`` rows (its shapes do not depend on ``steps``), the trip count
``plan.n_steps`` is a traced int32 scalar driving ``lax.fori_loop``, and per-step differences
(dpm++'s and UniPC's per-step orders, UniPC's corrector steps, Heun's single model call onto
sigma = 0) are data read at the traced index, selected with ``jnp.where`` / ``lax.cond``; what a
multistep solver remembers (dpm++'s previous x0, UniPC's earlier x0s and the sample its corrector
starts from, PLMS's earlier outputs and its call counter, which restarts at an img2img ``Start`` as
diffusers' fresh scheduler does) is carried in that solver's state (``DpmState``, ``UniPCState``,
``PlmsState``, ...). Only ``SolverSpec`` (solver,
prediction type, clipping, DDPM variance type, UniPC's highest order and B(h)) is static.

Numerics: ``make_plan`` reproduces diffusers' host arithmetic (torch float32 CPU kernels,
then numpy float64): given the same betas and training sigma table, timesteps, sigmas and
alphas_cumprod are bitwise identical. Our own tables are IEEE-exact (correctly rounded sqrt,
one rounding per fused multiply-add); torch picks its float32 kernels per CPU, and its
``** 0.5`` is not always correctly rounded, so its tables (and ``init_noise_sigma``) can be
1 ulp from ours at entries that change from one processor to the next. The solver steps are float32 jax and agree with diffusers' float32 torch
steps to 1e-5 (rtol and atol); where float32 cancellation dominates (sigma-space steps from
sigma ~ 1e2 .. 2e4 down to O(1)) they agree to within diffusers' own float32 noise floor.
tests/samplers measures both.

Config keys: see ``_tables.py`` (what each class reads, with its defaults) and ``_config.py``. Absent keys take the defaults of the diffusers class the
sampler maps to (so a DDIM-saved config used with "euler" behaves like
``EulerDiscreteScheduler.from_config``); values that change the math and are not implemented
raise ``SchedulerConfigError`` with a one-line message naming the key.
"""

from __future__ import annotations

from preheat.samplers._config import (SchedulerConfig, config_kind, find_scheduler_config, load_scheduler_config,
                                     samplers_of_kind, with_overrides)
from preheat.samplers._plan import (MU_SIGMAS_SAMPLERS, TIMESTEPS_SAMPLERS, Plan, SolverSpec, flow_mu,
                                   handoff_step, make_plan, make_spec, strength_start)
from preheat.samplers._schedules import flux_sigmas
from preheat.samplers._loop import BLEND_SOLVERS, Model, NoiseFn, SamplerState, Start, denoise_loop, init, noised, step
from preheat.samplers._tables import (DETERMINISTIC_SAMPLERS, DIFFUSERS_CLASS, DIFFUSION_SAMPLERS, DPM_FIXED_SETTINGS,
                                     EDM_SAMPLERS, FLOW_SAMPLERS, SAMPLERS, TIMESTEP_SPACINGS)

__all__ = [
    "SAMPLERS",
    "DIFFUSION_SAMPLERS",
    "FLOW_SAMPLERS",
    "EDM_SAMPLERS",
    "DETERMINISTIC_SAMPLERS",
    "MU_SIGMAS_SAMPLERS",
    "TIMESTEPS_SAMPLERS",
    "TIMESTEP_SPACINGS",
    "DIFFUSERS_CLASS",
    "DPM_FIXED_SETTINGS",
    "SchedulerConfig",
    "config_kind",
    "samplers_of_kind",
    "load_scheduler_config",
    "with_overrides",
    "find_scheduler_config",
    "SolverSpec",
    "Plan",
    "SamplerState",
    "Start",
    "BLEND_SOLVERS",
    "Model",
    "NoiseFn",
    "make_spec",
    "make_plan",
    "flow_mu",
    "flux_sigmas",
    "init",
    "step",
    "denoise_loop",
    "noised",
    "strength_start",
    "handoff_step",
]
