"""`preheat bench sampler`: what the one-program loop costs, and how fast it runs.

- loop overhead: the compiled whole-loop program against N separately compiled denoiser calls at
  the same batch (same model work, dispatched one step at a time). Goal: <= 2%.
- images/s at each batch size.
- achieved GFLOP/s (XLA's cost analysis of one denoiser call x calls) against the measured
  matmul rate of this machine.
- progress cost: the same loop compiled with step progress (``preheat.progress``: a host
  callback per step, to a registered no-op callback), timed interleaved with the loop without
  it. Goal: <= 1% of a call; above it, progress stays a static switch (``Signature.progress``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from preheat.bench.common import fmt_summary, machine_line, summary, timed
from preheat.bench.random_models import materialize_model

__all__ = ["bench_sampler", "matmul_gflops", "markdown"]


def matmul_gflops(n: int = 2048, repeats: int = 5) -> float:
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    times = timed(lambda: f(a).block_until_ready(), repeats)
    return 2 * n**3 / summary(times)["median"] / 1e9


def bench_sampler(model: str | None, batches: list[int], steps: int, sampler: str | None, repeats: int,
                  workdir: Path, size: tuple[int, int] | None = None) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    import preheat

    pipe = preheat.load(materialize_model(model, workdir), cache="off")
    sampler = sampler or pipe.defaults["sampler"]
    from preheat.families.inputs import IMAGE_SIZE, example_inputs

    inputs: dict[str, Any] = example_inputs(pipe.family.input_specs(pipe))
    if size is not None:
        inputs.update(IMAGE_SIZE.inputs(size))
    else:  # a tiny random model at its tiny size
        from preheat.bench.random_models import random_name, sized_inputs

        inputs.update(sized_inputs(random_name(model), {}))
    rows = []
    for b in batches:
        sig, args = pipe.prepare(b, steps=steps, sampler=sampler, seed=0, **inputs)
        program = pipe.executable(sig, args)
        loop, loop_progress = _with_and_without_progress(pipe, program, b, repeats,
                                                          dict(steps=steps, sampler=sampler, seed=0, **inputs))
        # The same model work, one separately compiled call at a time.
        calls_per_step = sig.spec.max_model_calls_per_step
        model_batch = 2 * b if sig.guided else b
        cond, uncond = args.cond, args.uncond
        model_cond = jax.tree.map(lambda c, u: jnp.concatenate([c, u]), cond, uncond) if sig.guided else cond
        # Fed like the loop: noise at the plan's timesteps (a call's time depends on its data:
        # zeros at one mid timestep ran up to 2x faster than noise at t=999 on the cifar model).
        x = jax.random.normal(jax.random.key(0), (model_batch, *sig.sample_shape), sig.dtype)
        ts = [jnp.full((model_batch,), args.plan.timesteps[i], jnp.float32) for i in range(steps)]
        denoise = jax.jit(pipe.apply).lower(pipe.params, x, ts[0], model_cond).compile()

        def calls() -> None:
            for t in ts:
                for _ in range(calls_per_step):
                    denoise(pipe.params, x, t, model_cond).block_until_ready()

        n_calls = steps * calls_per_step
        flops_per_call = float((denoise.cost_analysis() or {}).get("flops", float("nan")))
        loop_s = summary(loop)
        progress_s = summary(loop_progress)
        calls_s = summary(timed(calls, repeats))
        row = {
            "batch": b, "steps": steps, "sampler": sampler, "guided": sig.guided,
            "sample_shape": list(sig.sample_shape),
            "loop_s": loop_s, "separate_calls_s": calls_s, "progress_loop_s": progress_s,
            "progress_cost": progress_s["median"] / loop_s["median"] - 1.0,
            "progress_per_step_s": (progress_s["median"] - loop_s["median"]) / steps,
            "loop_overhead": loop_s["median"] / calls_s["median"] - 1.0,
            "images_per_s": b / loop_s["median"],
            "gflop_per_image_per_step": flops_per_call * calls_per_step / b / 1e9,
            "achieved_gflops": flops_per_call * n_calls / loop_s["median"] / 1e9,
        }
        if not pipe.family.pixels_in_loop:  # the other stages' share of a whole call
            pipe.generate(b, steps=steps, sampler=sampler, seed=0, **inputs)  # compile every stage first
            shares: dict[str, list[float]] = {"encode": [], "denoise": [], "decode": []}
            for _ in range(repeats):
                pipe.generate(b, steps=steps, sampler=sampler, seed=0, **inputs)
                total = pipe.last.run_s
                for stage in shares:
                    shares[stage].append(pipe.last.stages[stage].run_s / total)
            row["stage_share"] = {stage: summary(v) for stage, v in shares.items()}
        rows.append(row)
    return {"model": model or "built-in:digits", "machine": machine_line(), "matmul_gflops": matmul_gflops(),
            "rows": rows}


def _with_and_without_progress(pipe: Any, program: Any, b: int, repeats: int,
                               inputs: dict[str, Any]) -> tuple[list[float], list[float]]:
    """Run times of the loop without and with step progress, alternating (one under the same load
    as the other): the progress program reports to a registered callback that does nothing."""
    import time

    import numpy as np

    from preheat.progress import ignore, reporting

    psig, pargs = pipe.prepare(b, progress=ignore, **inputs)
    sig, args = pipe.prepare(b, **inputs)
    with reporting(ignore) as reporter:
        pargs = pargs._replace(plan=pargs.plan._replace(progress_id=np.int32(reporter.id)))
        with_progress = pipe.executable(psig, pargs)
        np.asarray(with_progress(pargs)), np.asarray(program(args))  # warm both
        times: tuple[list[float], list[float]] = ([], [])
        for _ in range(repeats):
            for out, (fn, a) in zip(times, ((program, args), (with_progress, pargs))):
                start = time.perf_counter()
                np.asarray(fn(a))
                out.append(time.perf_counter() - start)
        if reporter.step != inputs["steps"]:
            raise RuntimeError(f"the progress program reported {reporter.step} of {inputs['steps']} steps")
    return times


def markdown(result: dict[str, Any]) -> str:
    lines = [f"**{result['model']}** — {result['machine']}; measured f32 matmul rate "
             f"{result['matmul_gflops']:.1f} GFLOP/s", "",
             "| batch | steps | sampler | loop s, median (min–max) | N separate calls s | loop overhead | images/s | "
             "GFLOP/img/step | achieved GFLOP/s (% of matmul) | with progress s | progress cost (per step) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    shares = []
    for r in result["rows"]:
        pct = 100 * r["achieved_gflops"] / result["matmul_gflops"]
        if "stage_share" in r:
            s = r["stage_share"]
            shares.append(f"batch {r['batch']}: text encoding {100 * s['encode']['median']:.1f}%, denoising "
                          f"{100 * s['denoise']['median']:.1f}%, VAE decoding {100 * s['decode']['median']:.1f}% "
                          "of a call's run time (medians)")
        lines.append(f"| {r['batch']} | {r['steps']} | {r['sampler']}{' +cfg' if r['guided'] else ''} | "
                     f"{fmt_summary(r['loop_s'])} | {fmt_summary(r['separate_calls_s'])} | "
                     f"{100 * r['loop_overhead']:+.1f}% | {r['images_per_s']:.2f} | {r['gflop_per_image_per_step']:.3f} | "
                     f"{r['achieved_gflops']:.1f} ({pct:.0f}%) | {fmt_summary(r['progress_loop_s'])} | "
                     f"{100 * r['progress_cost']:+.1f}% ({1e6 * r['progress_per_step_s']:+.0f} µs) |")
    if shares:
        lines += [""] + [f"- {line}" for line in shares]
    return "\n".join(lines)
