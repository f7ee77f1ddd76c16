"""`preheat sample`: images from a model, a grid PNG, and the phase timings of its one call.

It draws once: a user asked for images. ``--timing`` adds a second, warm call of the same inputs
(its seconds and per image), what the start-up benchmark's children report; repeated and
steady-state timing is ``preheat bench``'s."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import click

from preheat.cli._support import one_line_errors, resolve_model
from preheat.cli.family_options import FamilyInputsCommand, flag_errors
from preheat.cli.options import CallOptions, call_options
from preheat.terminal import Phases, shown
from preheat.errors import InvalidArgumentError
from preheat.timings import process_age_s

__all__ = ["sample", "save_grid", "save_png"]


def save_grid(images: list, path: Path, upscale: int | None = None, inputs: list | None = None) -> int:
    """A square-ish grid PNG, written atomically (never a partial file). Images under 64 px are
    upscaled (nearest neighbour) so that they can be seen; returns the factor (1: none), which
    the caller states. ``inputs`` (the images a call was given: an init image, a mask) make a
    first row, left to right, above the outputs: input -> output, each fitted to the output size."""
    import io

    from PIL import Image

    from preheat.files import atomic_write_bytes

    n = len(images)
    cols = math.ceil(math.sqrt(n))
    rows = math.ceil(n / cols)
    w, h = images[0].size
    lead = [im.convert(images[0].mode).resize((w, h), Image.BILINEAR) for im in inputs or ()]
    top = 1 if lead else 0
    cols = max(cols, len(lead))
    scale = upscale or max(1, 64 // max(w, h))
    grid = Image.new(images[0].mode, (cols * w, (rows + top) * h))
    for i, im in enumerate(lead):
        grid.paste(im, (i * w, 0))
    for i, im in enumerate(images):
        grid.paste(im, ((i % cols) * w, (i // cols + top) * h))
    if scale > 1:
        grid = grid.resize((grid.width * scale, grid.height * scale), Image.NEAREST)
    buf = io.BytesIO()
    grid.save(buf, format="PNG")
    atomic_write_bytes(path, buf.getvalue())
    return scale


def save_png(image: Any, path: Path) -> None:
    import io

    from preheat.files import atomic_write_bytes

    buf = io.BytesIO()
    image.save(buf, format="PNG")
    atomic_write_bytes(path, buf.getvalue())


def _given_images(pipe: Any, kwargs: dict[str, Any]) -> list:
    """The images the call was given (its ``Image`` inputs, in declaration order) as PIL images."""
    from PIL import Image as PILImage

    from preheat.families.inputs import Image

    return [PILImage.fromarray(s.check(kwargs[s.name], 1)) for s in pipe.family.input_specs(pipe)
            if isinstance(s.type, Image) and kwargs.get(s.name) is not None]


@click.command("sample", cls=FamilyInputsCommand, options_metavar="[MODEL] [OPTIONS]")
@call_options
@click.option("--out", default="samples.png", show_default=True, type=click.Path(dir_okay=False, path_type=Path))
@click.option("--save-images", type=click.Path(file_okay=False, path_type=Path), help="Also write each image here.")
@click.option("--report", type=click.Path(dir_okay=False, path_type=Path), help="Write the phase timings as JSON.")
@click.option("--json", "as_json", is_flag=True, help="Print the phase timings as JSON on stdout.")
@click.option("--timing", is_flag=True, help="Also time a second, warm call of the same inputs (drawn again, "
              "not saved): its seconds and per image. Steady-state numbers: `preheat bench`.")
@click.option("--quiet", is_flag=True, help="No progress or summary.")
@one_line_errors
def sample(opts: CallOptions, out: Path, save_images: Path | None, report: Path | None, as_json: bool,
           timing: bool, quiet: bool) -> None:
    """Sample images from MODEL (a diffusers folder, hf://org/repo, or random:NAME; default: the built-in
    digits model). The model's own inputs (--prompt, --class, --width, ...) are listed below; an
    image-conditioned model takes --image PATH [--mask PATH] [--strength S], and the grid then
    shows the input images on its first row, the outputs below."""
    from rich.console import Console

    import preheat.engine  # noqa: F401  (jax: counted as import time, not weight loading)

    if opts.backend == "jax":
        import flax.nnx  # noqa: F401  (the JAX models' library: import time too, not the model phase)

    started_at_age = process_age_s()  # interpreter start + imports, before any preheat work
    console = Console(stderr=True, quiet=quiet)
    if out.suffix.lower() != ".png":
        raise InvalidArgumentError(f"--out {out} must end in .png", argument="--out")
    resolved = resolve_model(opts.model)
    model, opts = resolved.model, opts.sized(resolved.size, resolved.inputs)  # a tiny random model: its tiny size, unless the flags give one
    backend, compile_mode = opts.backend, opts.compile_mode
    steps, sampler = opts.steps, opts.sampler

    draw = shown(quiet)  # progress on stderr: a terminal only

    def first_call(view: Any) -> list[dict[str, Any]]:
        call = {"n": opts.batch(view), **opts.call_inputs(view)}
        if draw and view.reports_progress:  # the program the bar's call runs
            from preheat.progress import ignore

            call["progress"] = ignore
        return [call]

    # the first call, known before the weights are: its executables load while they are read
    options: dict[str, Any] = {"prefetch": first_call} if backend == "jax" and not opts.lora else {}
    with Phases(draw) as phases:  # a spinner naming the phase, with its elapsed time (a terminal only)
        with phases.phase("loading model"):
            t0 = time.perf_counter()
            import preheat

            pipe = preheat.load(model, **opts.load_options(), **options)
            load_s = time.perf_counter() - t0
        with flag_errors(pipe):
            kwargs = opts.call_inputs(pipe)
        n = opts.batch(pipe)
        if phases.on and pipe.reports_progress:  # the bar over the steps (a terminal only:
            kwargs["progress"] = phases.step  # a pipe's runs, benchmarks' included, keep the program without it)
        with phases.phase("first call", jax_steps=backend == "jax"), flag_errors(pipe):
            t0 = time.perf_counter()
            images = pipe(n, **kwargs)
            first_call_s = time.perf_counter() - t0
            first = pipe.last
            to_first_image = process_age_s()
        warm: dict[str, float] = {}
        if timing:  # a second draw of the same inputs: the warm call's time (bench repeats it)
            with phases.phase("second call (warm)"):
                t0 = time.perf_counter()
                pipe(n, **kwargs)
                second_call_s = time.perf_counter() - t0
            warm = {"warm_run_s": pipe.last.run_s, "second_call_s": second_call_s, "per_image_s": second_call_s / n}

    scale = save_grid(images, out, inputs=_given_images(pipe, kwargs))
    if save_images:
        save_images.mkdir(parents=True, exist_ok=True)
        for i, im in enumerate(images):
            save_png(im, save_images / f"{i:04d}.png")
    resolved = {"sampler": sampler or pipe.defaults["sampler"], "steps": steps or pipe.defaults["steps"]}
    record = {
        "model": opts.model or "built-in:digits",
        "family": pipe.family.name,
        "backend": backend if backend == "jax" else f"torch/{compile_mode}",
        "batch": n,
        "image_size": list(images[0].size),  # (width, height) of each image
        "grid_upscale": scale,  # the grid PNG's nearest-neighbour factor (1: none)
        "steps": resolved["steps"],
        "sampler": resolved["sampler"],
        "import_s": started_at_age,
        "load_s": load_s,
        "weights_s": load_s,
        "trace_lower_s": first.trace_lower_s,
        "compile_s": first.compile_s,
        "compile_or_load_s": first.compile_s,
        "first_run_s": first.run_s,
        "first_call_s": first_call_s,
        **warm,  # --timing only: warm_run_s, second_call_s, per_image_s
        "cache_layer": first.cache_layer,
        "remote": next((e.get("remote") for e in (pipe.compiler.events if pipe.compiler else []) if "remote" in e), None),
        "cache_events": pipe.compiler.events if pipe.compiler is not None else [],
        "process_start_to_first_image_s": to_first_image,
        "guided": pipe.is_guided(**kwargs),  # the call's inputs too: FLUX.1's true CFG is a negative prompt's
        "stages": first.to_dict().get("stages", {}),
    }
    startup = pipe.startup  # the JAX engine's phases (preheat.timings.Phases); None for torch
    if startup is not None:
        record["startup"] = startup.to_dict()
    weights_load = pipe.load_report  # the JAX engine's (preheat.models.load_report.LoadReport); None for torch
    if weights_load is not None:
        record.update(weights_read_s=weights_load.seconds, abstract_s=weights_load.abstract_s,
                      weights_bytes=weights_load.bytes_read, peak_host_bytes=weights_load.peak_host_bytes,
                      transient_host_bytes=weights_load.transient_host_bytes, weights_load=weights_load.to_dict())
    if report:
        from preheat.files import atomic_write_bytes

        atomic_write_bytes(report, (json.dumps(record, indent=2) + "\n").encode())
    if as_json:
        click.echo(json.dumps(record, indent=2))
    w, h = images[0].size
    console.print(
        f"[bold]wrote[/] {out}  ({n} images of {w}x{h}, {resolved['sampler']}, {resolved['steps']} steps"
        + (f"; the grid upscaled {scale}x, nearest neighbour, for viewing" if scale > 1 else "") + ")\n"
        f"load {load_s:.2f}s · first call {first_call_s:.2f}s (trace+lower {first.trace_lower_s:.2f}s, "
        f"compile {first.compile_s:.2f}s, cache: {first.cache_layer})"
        + (f" · second call {warm['second_call_s']:.3f}s · {warm['per_image_s'] * 1000:.1f} ms/image" if warm else ""),
        soft_wrap=True,
    )
