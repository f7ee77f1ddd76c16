"""`preheat sample`: images from a model, a grid PNG, and the phase timings."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import click

from preheat.cli._support import one_line_errors
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


@click.command("sample")
@click.argument("model", required=False)
@click.option("--n", "n", type=int, help="Number of images (default: 16 for class models, 1 for text-to-image).")
@click.option("--prompt", help="Text-to-image models: the prompt.")
@click.option("--negative-prompt", help="Text-to-image models: what to steer away from (needs guidance).")
@click.option("--width", type=int, help="Text-to-image models: image width (default: the model's).")
@click.option("--height", type=int, help="Text-to-image models: image height (default: the model's).")
@click.option("--class", "classes", multiple=True, help="Class index or label; repeat for one per image.")
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
@one_line_errors
def sample(model: str | None, n: int | None, prompt: str | None, negative_prompt: str | None, width: int | None,
           height: int | None, classes: tuple[str, ...], steps: int | None, sampler: str | None,
           seed: int, guidance: float | None, eta: float, loras: tuple[str, ...], out: Path, save_images: Path | None,
           report: Path | None, dtype: str, variant: str | None, cache: str | None, backend: str, compile_mode: str,
           quiet: bool) -> None:
    """Sample images from MODEL (a diffusers folder or hf://org/repo; default: the built-in digits model)."""
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

    labels: Any = None
    if classes:
        labels = list(classes) if len(classes) > 1 else classes[0]
    family_inputs = dict(class_labels=labels, prompt=prompt, negative_prompt=negative_prompt, width=width,
                         height=height)
    kwargs = dict(steps=steps, sampler=sampler, guidance=guidance, seed=seed, eta=eta,
                  **{k: v for k, v in family_inputs.items() if v is not None})
    if loras:
        from preheat.lora import parse_cli

        kwargs["lora"] = [parse_cli(spec) for spec in loras]
    # the first call, known before the model is: its executable loads while the weights are read
    # (pixel families only, whose default n is 16; a text family ignores it)
    options: dict[str, Any] = {"prefetch": [{"n": n or 16, **kwargs}]} if backend == "jax" and not loras else {}
    with console.status("loading model…"):
        t0 = time.perf_counter()
        import preheat

        pipe = preheat.load(model, dtype=dtype, cache=cache, backend=backend, compile=compile_mode, variant=variant,
                            **options)
        load_s = time.perf_counter() - t0
    text = "prompt" in pipe.family.inputs
    n = n or (1 if text else 16)
    with console.status("compiling and sampling (first call)…"):
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
    startup = getattr(pipe, "startup", None)  # the JAX engine's phases (preheat.timings.Phases)
    if startup is not None:
        record["startup"] = startup.to_dict()
    weights_load = getattr(pipe, "load_report", None)  # the JAX engine's (preheat.models.weights.LoadReport)
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
