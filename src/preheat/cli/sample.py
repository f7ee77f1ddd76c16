"""`preheat sample`: images from a model, a grid PNG, and the phase timings."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import click

from preheat.cli._support import one_line_errors
from preheat.cli.family_options import FamilyInputsCommand, family_values, flag_errors, parse_flags
from preheat.errors import InvalidArgumentError
from preheat.timings import process_age_s

__all__ = ["sample", "save_grid", "save_png"]


def save_grid(images: list, path: Path, upscale: int | None = None) -> None:
    """A square-ish grid PNG, written atomically (never a partial file)."""
    import io

    from PIL import Image

    from preheat.files import atomic_write_bytes

    n = len(images)
    cols = math.ceil(math.sqrt(n))
    rows = math.ceil(n / cols)
    w, h = images[0].size
    scale = upscale or max(1, 64 // max(w, h))
    grid = Image.new(images[0].mode, (cols * w, rows * h))
    for i, im in enumerate(images):
        grid.paste(im, ((i % cols) * w, (i // cols) * h))
    if scale > 1:
        grid = grid.resize((grid.width * scale, grid.height * scale), Image.NEAREST)
    buf = io.BytesIO()
    grid.save(buf, format="PNG")
    atomic_write_bytes(path, buf.getvalue())


def save_png(image: Any, path: Path) -> None:
    import io

    from preheat.files import atomic_write_bytes

    buf = io.BytesIO()
    image.save(buf, format="PNG")
    atomic_write_bytes(path, buf.getvalue())


@click.command("sample", cls=FamilyInputsCommand, options_metavar="[MODEL] [OPTIONS]")
@click.option("--n", "n", type=int, help="Number of images (default: 16 for class models, 1 for text-to-image).")
@click.option("--steps", type=int, help="Denoising steps (model default when absent).")
@click.option("--sampler", help="ddpm, ddim, euler, euler_a, heun, dpmpp_2m, dpmpp_2m_karras.")
@click.option("--seed", default=0, show_default=True, type=int, help="Image i uses seed + i.")
@click.option("--guidance", type=float, help="Classifier-free guidance scale (1 = off).")
@click.option("--eta", default=0.0, type=float, help="DDIM stochasticity.")
@click.option("--lora", "loras", multiple=True, metavar="SRC[:SCALE]",
              help="A LoRA (path, http(s)://, hf://org/repo/file) and its scale (default 1); repeat to combine.")
@click.option("--out", default="samples.png", show_default=True, type=click.Path(dir_okay=False, path_type=Path))
@click.option("--save-images", type=click.Path(file_okay=False, path_type=Path), help="Also write each image here.")
@click.option("--report", type=click.Path(dir_okay=False, path_type=Path), help="Write the phase timings as JSON.")
@click.option("--dtype", default="float32", show_default=True, help="float32, bfloat16 or float16.")
@click.option("--variant", help="Weight files *.VARIANT.safetensors (e.g. fp16).")
@click.option("--cache", type=click.Choice(["full", "xla", "off"]), help="Compile cache layers (default: full).")
@click.option("--backend", type=click.Choice(["jax", "torch"]), default="jax", show_default=True)
@click.option("--compile", "compile_mode", type=click.Choice(["none", "inductor", "aot", "regional"]), default="none",
              show_default=True, help="torch backend: eager, torch.compile, AOTInductor, or regional (repeated blocks).")
@click.option("--quiet", is_flag=True, help="No progress or summary.")
@click.pass_context
@one_line_errors
def sample(ctx: click.Context, n: int | None, steps: int | None, sampler: str | None,
           seed: int, guidance: float | None, eta: float, loras: tuple[str, ...], out: Path, save_images: Path | None,
           report: Path | None, dtype: str, variant: str | None, cache: str | None, backend: str, compile_mode: str,
           quiet: bool) -> None:
    """Sample images from MODEL (a diffusers folder or hf://org/repo; default: the built-in digits model).
    The model's own inputs (--prompt, --class, --width, ...) are listed below."""
    from rich.console import Console

    import preheat.engine  # noqa: F401  (jax: counted as import time, not weight loading)

    if backend == "jax":
        import flax.nnx  # noqa: F401  (the JAX models' library: import time too, not the model phase)

    started_at_age = process_age_s()  # interpreter start + imports, before any preheat work
    console = Console(stderr=True, quiet=quiet)
    if n is not None and n <= 0:
        raise InvalidArgumentError(f"--n {n} must be a positive int")
    if steps is not None and steps <= 0:
        raise InvalidArgumentError(f"--steps {steps} must be a positive int")
    if out.suffix.lower() != ".png":
        raise InvalidArgumentError(f"--out {out} must end in .png")
    model, flags = parse_flags(ctx.args)  # MODEL, and the family's inputs (typed once its specs are known)

    kwargs = dict(steps=steps, sampler=sampler, guidance=guidance, seed=seed, eta=eta)
    if loras:
        from preheat.lora import parse_cli

        kwargs["lora"] = [parse_cli(spec) for spec in loras]

    def first_call(view: Any) -> list[dict[str, Any]]:
        return [{"n": n or view.family.preview_n, **kwargs, **family_values(view, flags)}]

    # the first call, known before the weights are: its executables load while they are read
    options: dict[str, Any] = {"prefetch": first_call} if backend == "jax" and not loras else {}
    with console.status("loading model…"):
        t0 = time.perf_counter()
        import preheat

        pipe = preheat.load(model, dtype=dtype, cache=cache, backend=backend, compile=compile_mode, variant=variant,
                            **options)
        load_s = time.perf_counter() - t0
    kwargs.update(family_values(pipe, flags))
    n = n or pipe.family.preview_n
    with console.status("compiling and sampling (first call)…"), flag_errors(pipe):
        t0 = time.perf_counter()
        images = pipe(n, **kwargs)
        first_call_s = time.perf_counter() - t0
        first = pipe.last
        to_first_image = process_age_s()
    with console.status("sampling again (second call)…"):
        t0 = time.perf_counter()
        pipe(n, **kwargs)
        second_call_s = time.perf_counter() - t0
        warm_run_s = pipe.last.run_s

    save_grid(images, out)
    if save_images:
        save_images.mkdir(parents=True, exist_ok=True)
        for i, im in enumerate(images):
            save_png(im, save_images / f"{i:04d}.png")
    resolved = {"sampler": sampler or pipe.defaults["sampler"], "steps": steps or pipe.defaults["steps"]}
    record = {
        "model": model or "built-in:digits",
        "family": pipe.family.name,
        "backend": backend if backend == "jax" else f"torch/{compile_mode}",
        "batch": n,
        "steps": resolved["steps"],
        "sampler": resolved["sampler"],
        "import_s": started_at_age,
        "load_s": load_s,
        "weights_s": load_s,
        "trace_lower_s": first.trace_lower_s,
        "compile_s": first.compile_s,
        "compile_or_load_s": first.compile_s,
        "first_run_s": first.run_s,
        "warm_run_s": warm_run_s,
        "first_call_s": first_call_s,
        "second_call_s": second_call_s,
        "per_image_s": second_call_s / n,
        "cache_layer": first.cache_layer,
        "remote": next((e.get("remote") for e in (pipe.compiler.events if pipe.compiler else []) if "remote" in e), None),
        "cache_events": pipe.compiler.events if pipe.compiler is not None else [],
        "process_start_to_first_image_s": to_first_image,
        "guided": pipe.is_guided(guidance),
        "stages": first.to_dict().get("stages", {}),
    }
    startup = pipe.startup  # the JAX engine's phases (preheat.timings.Phases); None for torch
    if startup is not None:
        record["startup"] = startup.to_dict()
    weights_load = pipe.load_report  # the JAX engine's (preheat.models.weights.LoadReport); None for torch
    if weights_load is not None:
        record.update(weights_read_s=weights_load.seconds, abstract_s=weights_load.abstract_s,
                      weights_bytes=weights_load.bytes_read, peak_host_bytes=weights_load.peak_host_bytes,
                      transient_host_bytes=weights_load.transient_host_bytes, weights_load=weights_load.to_dict())
    if report:
        from preheat.files import atomic_write_bytes

        atomic_write_bytes(report, (json.dumps(record, indent=2) + "\n").encode())
    console.print(
        f"[bold]wrote[/] {out}  ({n} images, {resolved['sampler']}, {resolved['steps']} steps)\n"
        f"load {load_s:.2f}s · first call {first_call_s:.2f}s (trace+lower {first.trace_lower_s:.2f}s, "
        f"compile {first.compile_s:.2f}s, cache: {first.cache_layer}) · second call {second_call_s:.3f}s · "
        f"{second_call_s / n * 1000:.1f} ms/image",
        soft_wrap=True,
    )
