"""`preheat bench ...`: benchmarks, with warm-up, medians and min/max (speed is measured here, not
in tests). Each command checks its options and calls the benchmark in ``preheat.bench``."""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import click

from preheat.bench.compare import PATHS
from preheat.cli._support import one_line_errors
from preheat.cli.family_options import FamilyInputsCommand, size_flags
from preheat.cli.options import (DTYPES, NON_NEGATIVE, POSITIVE, POSITIVE_SECONDS, common_option, echo_result,
                                 output_options, renamed_option, size_options)

__all__ = ["bench_group"]


@click.group("bench")
def bench_group() -> None:
    """Benchmarks: numbers with warm-up, medians and min/max (speed is measured here, not in tests)."""


@bench_group.command("sampler")
@click.argument("model", required=False)
@common_option("n", default=(), multiple=True,
               help="Number of images of one call (the batch size); repeat for each one measured (default 1, 8, 32).")
@common_option("steps", default=10, help="Denoising steps.")
@common_option("sampler")
@click.option("--repeats", default=3, show_default=True, type=POSITIVE)
@size_options("Text-to-image models:")
@click.option("--profile", is_flag=True,
              help="Instead: where one denoiser call's time goes, per op class, JAX vs torch.compile (pixel "
                   "models; model batch 16: batch 8 guided, else 16; --n sets the images).")
@output_options()
@renamed_option("--batch", "n", "--n")
@one_line_errors
def sampler_command(model: str | None, n: tuple[int, ...], steps: int, sampler: str | None, repeats: int,
                    size: tuple[int, int] | None, profile: bool, json_out: Path | None, as_json: bool) -> None:
    """Loop overhead, images/s and achieved GFLOP/s (and, for text-to-image models, the share of
    text encoding and VAE decoding). MODEL: a folder, random:NAME (random weights: random:sd15,
    random:ddpm-cifar10-32, ...), or nothing for the built-in model."""
    from preheat.bench.common import write_json
    from preheat.bench.sampler import bench_sampler, markdown

    if profile:
        from preheat.bench.sampler import bench_profile

        with tempfile.TemporaryDirectory() as tmp:
            text, result = bench_profile(model, n[0] if n else None, Path(tmp))
        echo_result(result, text, as_json)
        write_json(json_out, result)
        return
    with tempfile.TemporaryDirectory() as tmp:
        result = bench_sampler(model, list(n) or [1, 8, 32], steps, sampler, repeats, Path(tmp), size)
    echo_result(result, markdown(result), as_json)
    write_json(json_out, result)


@bench_group.command("lora")
@click.argument("model", required=False, default="random:sd-small")
@common_option("n", default=8, help="Batch size (and number of LoRAs mixed).")
@common_option("steps", default=4, help="Denoising steps.")
@click.option("--rank", default=16, show_default=True, type=int, help="The LoRAs' rank.")
@click.option("--repeats", default=5, show_default=True, type=int, help="Rounds, each timing every condition once.")
@click.option("--dtype", default="float32", show_default=True)
@size_options()
@output_options()
@one_line_errors
def lora_command(model: str, n: int, steps: int, rank: int, repeats: int, dtype: str, size: tuple[int, int] | None,
                 json_out: Path | None, as_json: bool) -> None:
    """Images/s for a batch with a different LoRA per image vs the same LoRA vs no LoRA, and their
    ratios, in one run (issue 15; goal mixed >= 0.8x same). MODEL: a text-to-image folder or
    random:sd-small / random:sd15 / random:flux (random weights)."""
    from preheat.bench.common import write_json
    from preheat.bench.lora import bench_lora, markdown
    from preheat.errors import InvalidArgumentError

    if repeats < 1 or rank < 1:
        raise InvalidArgumentError("--rank and --repeats must be >= 1")
    with tempfile.TemporaryDirectory() as tmp:
        result = bench_lora(model, n, steps, rank, repeats, Path(tmp), dtype=dtype,
                            size=size)
    echo_result(result, markdown(result), as_json)
    write_json(json_out, result)


@bench_group.command("controlnet")
@click.argument("model", required=False, default="random:sd-small")
@common_option("n", default=4, help="Batch size.")
@common_option("steps", default=4, help="Denoising steps.")
@click.option("--repeats", default=5, show_default=True, type=POSITIVE, help="Rounds, each timing every condition once.")
@click.option("--dtype", default="float32", show_default=True)
@size_options()
@output_options()
@one_line_errors
def controlnet_command(model: str, n: int, steps: int, repeats: int, dtype: str, size: tuple[int, int] | None,
                       json_out: Path | None, as_json: bool) -> None:
    """Images/s of a call with a ControlNet beside the UNet vs without one, and with the ControlNet's
    window at half the steps, in one run. MODEL: an SD 1.x/2.x or SDXL folder, or random:sd-small /
    random:sd15 / random:sdxl (random weights); the ControlNet is a random one made from its UNet."""
    from preheat.bench.common import write_json
    from preheat.bench.controlnet import bench_controlnet, markdown

    with tempfile.TemporaryDirectory() as tmp:
        result = bench_controlnet(model, n, steps, repeats, Path(tmp), dtype=dtype, size=size)
    echo_result(result, markdown(result), as_json)
    write_json(json_out, result)


@bench_group.command("refiner")
@click.argument("model", required=False, default="random:sdxl-tiny")
@common_option("n", default=2, help="Batch size.")
@common_option("steps", default=10, help="Denoising steps.")
@click.option("--repeats", default=5, show_default=True, type=POSITIVE, help="Rounds, each timing every condition once.")
@click.option("--dtype", default="float32", show_default=True)
@size_options()
@output_options()
@one_line_errors
def refiner_command(model: str, n: int, steps: int, repeats: int, dtype: str, size: tuple[int, int] | None,
                    json_out: Path | None, as_json: bool) -> None:
    """Images/s of an SDXL call that a refiner finishes (the ensemble of experts, denoising_end 0.8) vs
    the base alone, and with the refiner held but not run, in one run. MODEL: an SDXL base folder, or
    random:sdxl-tiny / random:sdxl (random weights); the refiner is a random one of its UNet's widths."""
    from preheat.bench.common import write_json
    from preheat.bench.refiner import bench_refiner, markdown

    with tempfile.TemporaryDirectory() as tmp:
        result = bench_refiner(model, n, steps, repeats, Path(tmp), dtype=dtype, size=size)
    echo_result(result, markdown(result), as_json)
    write_json(json_out, result)


@bench_group.command("coldstart", cls=FamilyInputsCommand, options_metavar="[MODEL] [OPTIONS]")
@common_option("n", default=8, help="Batch size.")
@common_option("steps")
@click.option("--repeats", default=3, show_default=True, type=POSITIVE, help="Fresh processes per cache state.")
@click.option("--cache-url", help="Also measure a fresh local root pulling from this shared store.")
@click.option("--backend", type=click.Choice(["jax", "torch"]), default="jax", show_default=True,
              help="torch: eager vs --compile cold vs warm, each child with an empty Inductor cache folder.")
@click.option("--compile", "compile_mode", type=click.Choice(["regional", "inductor", "aot"]), multiple=True,
              help="--backend torch: the compile mode measured (repeatable; default regional).")
@output_options()
@click.option("--png-out", type=click.Path(dir_okay=False, path_type=Path))
def coldstart_command(n: int, steps: int | None, repeats: int, cache_url: str | None, backend: str,
                      compile_mode: tuple[str, ...], json_out: Path | None, as_json: bool, png_out: Path | None) -> None:
    """Process start to first image, empty vs XLA-cache-only vs fully warm cache, in fresh processes.
    The model's own inputs are `preheat sample`'s flags (--prompt, --width, --image PATH, ...), given to
    every child; a required one not given runs at its declared example value."""
    from preheat.cli.family_options import parse_flags

    def run() -> None:
        model, flags = parse_flags(click.get_current_context().args)
        _coldstart(model, flags, n, steps, repeats, cache_url, backend, compile_mode, json_out, as_json, png_out)

    one_line_errors(run)()


def _coldstart(model: str | None, flags: dict[str, list[str]], n: int, steps: int | None, repeats: int,
               cache_url: str | None, backend: str, compile_mode: tuple[str, ...], json_out: Path | None,
               as_json: bool, png_out: Path | None) -> None:
    from preheat.bench.coldstart import bench_coldstart, bench_coldstart_torch, markdown, plot
    from preheat.bench.common import write_json
    from preheat.bench.compare import declared_values
    from preheat.bench.random_models import materialize_model, random_name, sized_inputs
    from preheat.errors import InvalidArgumentError

    if backend == "torch" and cache_url:
        raise InvalidArgumentError("--cache-url is measured for --backend jax only")
    args = tuple(item for flag, values in flags.items() for value in values for item in (flag, value))
    with tempfile.TemporaryDirectory() as tmp:
        folder = materialize_model(model, Path(tmp))
        declared_values(folder, flags)  # a flag the model does not take: one line before any child starts
        if not size_flags().given(flags):  # a tiny random model's defaults, said here
            args += declared_args(folder, sized_inputs(random_name(model), {}))
        args += required_example_args(folder, args, Path(tmp))
        if backend == "torch":
            result = bench_coldstart_torch(model, n, steps, repeats, Path(tmp), compile_mode or ("regional",), args)
        else:
            result = bench_coldstart(model, n, steps, repeats, Path(tmp), cache_url, args)
    echo_result(result, markdown(result), as_json)
    write_json(json_out, result)
    if png_out:
        plot(result, png_out)


def declared_args(folder: str | None, values: dict[str, Any]) -> tuple[str, ...]:
    """``preheat sample`` flags for ``values``, each under the flag its family's spec declares
    (``InputSpec.cli_flag``; the size's flags, and a name no spec declares, as --name-with-dashes)."""
    from preheat.families import declared_family

    family = declared_family(Path(folder)) if folder is not None and Path(folder).is_dir() else None
    flags = {s.name: s.cli_flag for s in family.specs} if family is not None else {}
    out: tuple[str, ...] = ()
    for name, value in values.items():
        out += (flags.get(name, "--" + name.replace("_", "-")), str(value))
    return out


def required_example_args(folder: str | None, args: tuple[str, ...], workdir: Path) -> tuple[str, ...]:
    """``preheat sample`` flags for the inputs the folder's family declares required and ``args``
    lacks, at their declared example values (a prompt: "a watercolor fox"; an image: a mid-grey
    placeholder of the call's size, written under ``workdir``). A store source is not pulled here:
    its required inputs are the caller's to give."""
    from preheat.families import declared_family
    from preheat.families.inputs import Image, example_inputs

    if folder is None or not Path(folder).is_dir():
        return ()
    family = declared_family(Path(folder))
    if family is None:
        return ()

    def given(flag: str) -> str | None:
        return args[args.index(flag) + 1] if flag in args[:-1] else None

    out: tuple[str, ...] = ()
    for spec in family.folder_specs(Path(folder)):  # a 9-channel inpainting folder's image and mask
        if not spec.required or given(spec.cli_flag) is not None:
            continue
        if isinstance(spec.type, Image):
            from PIL import Image as PILImage

            width, height = (int(given(flag) or 64) for flag in size_flags())
            path = workdir / f"example-{spec.name}.png"
            PILImage.fromarray(spec.type.placeholder(width, height)).save(path)
            value: object = path
        else:
            value = example_inputs((spec,))[spec.name]
        out += (spec.cli_flag, str(value))
    return out


@bench_group.command("target")
@click.option("--target", "target_name", default="h200", show_default=True, metavar="NAME|FILE",
              help="The GPU or TPU compiled for (as `preheat warm --target`).")
@click.option("--no-full-size", is_flag=True, help="Leave out the full-size SD 1.5 and SDXL UNets.")
@output_options()
@one_line_errors
def target_command(target_name: str, no_full_size: bool, json_out: Path | None, as_json: bool) -> None:
    """Deviceless GPU compile time per stage against the same programs' CPU compile, and bytes."""
    from preheat.bench.common import write_json
    from preheat.bench.target import bench_target, markdown

    with tempfile.TemporaryDirectory() as tmp:
        result = bench_target(target_name, Path(tmp), full_size=not no_full_size)
    echo_result(result, markdown(result), as_json)
    write_json(json_out, result)


@bench_group.command("torch-shapes")
@click.argument("models", nargs=-1)
@click.option("--resolutions", default="32,48,64", show_default=True,
              help="Square image sizes, comma-separated, in the order served (the first is stored alone for the "
                   "partial row).")
@click.option("--mode", type=click.Choice(["regional", "full"]), default="regional", show_default=True)
@common_option("steps", default=2, help="Denoising steps.")
@click.option("--repeats", default=5, show_default=True, type=int, help="Steady-state calls per resolution.")
@click.option("--threads", type=int, help="torch threads in the children (default: torch's own).")
@click.option("--timeout", default=1800.0, show_default=True, type=POSITIVE_SECONDS, help="Seconds per child process.")
@output_options()
@one_line_errors
def torch_shapes_command(models: tuple[str, ...], resolutions: str, mode: str, steps: int, repeats: int,
                         threads: int | None, timeout: float, json_out: Path | None, as_json: bool) -> None:
    """preheat.torch.compile per-resolution entries (dynamic=False) vs one symbolic-shape entry
    (dynamic=True, duck shapes off): compile seconds per resolution, steady state, warm starts,
    in fresh processes. MODELS: folders or random:flux-tiny / random:sd1-tiny (default both)."""
    from preheat.bench.common import write_json
    from preheat.bench.shapes import MODELS, bench_torch_shapes, markdown
    from preheat.errors import InvalidArgumentError

    try:
        sizes = tuple(int(s) for s in resolutions.split(",") if s.strip())
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) <= 0 or len(set(sizes)) != len(sizes):
        raise InvalidArgumentError(f"--resolutions {resolutions!r} must be distinct comma-separated positive ints")
    if repeats < 1 or (threads is not None and threads < 1):
        raise InvalidArgumentError("--repeats and --threads must be >= 1")
    from preheat.bench.random_models import PREFIX, RANDOM_MODELS, random_name
    from preheat.errors import ModelNotFoundError

    for model in models:
        if random_name(model) is None and not (Path(model).expanduser() / "model_index.json").is_file():
            raise ModelNotFoundError(f"{model} is neither a diffusers pipeline folder nor one of "
                                     f"{', '.join(PREFIX + n for n in RANDOM_MODELS)}")
    with tempfile.TemporaryDirectory(prefix="preheat-shapes-") as tmp:
        result = bench_torch_shapes(models or MODELS, sizes, mode, steps, repeats, Path(tmp), timeout,
                                    threads, log=lambda line: click.echo(line, err=True))
    echo_result(result, markdown(result), as_json)
    write_json(json_out, result)


def _parse_sizes(text: str) -> tuple[int, ...]:
    from preheat.errors import InvalidArgumentError

    try:
        sizes = tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise InvalidArgumentError(f"--batch-sizes {text!r} must be comma-separated positive ints") from None
    if not sizes or min(sizes) <= 0:
        raise InvalidArgumentError(f"--batch-sizes {text!r} must be comma-separated positive ints")
    return sizes


@bench_group.command("compare", cls=FamilyInputsCommand, options_metavar="[MODEL] [OPTIONS]")
@common_option("sampler", help="(default: the model's if deterministic, else ddim).")
@common_option("steps", help="Denoising steps (default: the model's; --quick: 4).")
@common_option("n", help="Images of each cold-start call, as `bench coldstart --n` (default 8; --quick: 1).")
@click.option("--batch-sizes", help="Steady-state batch sizes (default 1,8,32; --quick: 1,8).")
@common_option("seed")
@common_option("guidance", help="Classifier-free guidance scale (default: the model's).")
@click.option("--dtype", type=click.Choice(DTYPES), help="Every path's dtype (default: each backend's own, float32).")
@click.option("--repeats", type=int, help="Fresh processes per cache state (default 3; --quick: 1).")
@click.option("--steady-repeats", type=int, help="Timed calls per batch size (default 5; --quick: 2).")
@click.option("--paths", "paths_opt", default=",".join(PATHS), show_default=True, help="Which paths to run.")
@click.option("--xla-flags", "xla_flags", multiple=True, metavar="NAME=FLAGS",
              help="Also run JAX with these extra XLA_FLAGS, reported as jax[NAME]; repeatable.")
@click.option("--quick", is_flag=True, help="Batch 1 and 8, 4 steps, one process per cache state.")
@click.option("--timeout", default=1800.0, show_default=True, type=POSITIVE_SECONDS, help="Seconds per child process.")
@output_options()
@click.option("--png-out", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--keep", type=click.Path(file_okay=False, path_type=Path),
              help="Keep the work folder (cache roots, pixels) here instead of a temporary one.")
@click.option("--config", metavar="FOLDER|hf://ORG/REPO|NAME",
              help="MODEL a single checkpoint file: as `preheat sample --config` (converted once, for every path).")
@click.option("--controlnet", metavar="FOLDER", help="A ControlNetModel folder beside the UNet, on every path "
              "(as `preheat sample --controlnet`; give --control-image).")
@click.option("--refiner", metavar="FOLDER", help="An SDXL refiner folder beside an SDXL base, on every path "
              "(as `preheat sample --refiner`).")
@renamed_option("--batch", "n", "--n", multiple=False)
def compare_command(sampler: str | None, steps: int | None, n: int | None,
                    batch_sizes: str | None, seed: int, guidance: float | None, dtype: str | None,
                    repeats: int | None,
                    steady_repeats: int | None, paths_opt: str, xla_flags: tuple[str, ...], quick: bool,
                    timeout: float, json_out: Path | None, as_json: bool, png_out: Path | None, keep: Path | None,
                    config: str | None, controlnet: str | None, refiner: str | None) -> None:
    """JAX vs torch eager vs torch.compile vs AOTInductor on MODEL (default: the built-in model;
    also random:NAME, a random-weight folder: random:sd1-tiny, random:flux-tiny, random:sd15, ...).
    The model's own inputs are `preheat sample`'s flags (--prompt, --width, --image PATH --strength S,
    --mask PATH, ...; see `preheat sample --help`): every path gets the same ones. A tiny random
    model runs at its tiny size (32x32) unless --width/--height say otherwise."""
    from preheat.cli.family_options import parse_flags

    def run() -> None:
        model, flags = parse_flags(click.get_current_context().args)
        _compare(model, sampler, steps, n, batch_sizes, seed, guidance, repeats, steady_repeats, paths_opt,
                 xla_flags, quick, timeout, json_out, png_out, keep, flags=flags, as_json=as_json, dtype=dtype,
                 config=config, companions={k: v for k, v in (("controlnet", controlnet), ("refiner", refiner)) if v})

    one_line_errors(run)()


def _compare(model: str | None, sampler: str | None, steps: int | None, batch: int | None, batch_sizes: str | None,
             seed: int, guidance: float | None, repeats: int | None, steady_repeats: int | None, paths_opt: str,
             xla_flags: tuple[str, ...], quick: bool, timeout: float, json_out: Path | None, png_out: Path | None,
             keep: Path | None, flags: dict[str, list[str]] | None = None, as_json: bool = False,
             dtype: str | None = None, config: str | None = None, companions: dict[str, str] | None = None) -> None:
    from preheat.bench.common import write_json
    from preheat.bench.compare import FULL, QUICK, bench_compare, markdown, plot
    from preheat.errors import InvalidArgumentError, SchedulerConfigError
    from preheat.samplers import SAMPLERS

    from preheat.bench.random_models import random_name
    from preheat.engine import BUILTIN_MODEL
    from preheat.errors import ModelNotFoundError
    from preheat.store import is_remote

    if model is None and not (BUILTIN_MODEL / "model_index.json").is_file():
        raise ModelNotFoundError(f"the built-in model is not installed ({BUILTIN_MODEL}); pass a model folder")
    if (model is not None and random_name(model) is None and not is_remote(model)
            and not Path(model).expanduser().exists()):
        raise ModelNotFoundError(f"model path {model} does not exist")
    preset = QUICK if quick else FULL
    paths = tuple(p.strip() for p in paths_opt.split(",") if p.strip())
    unknown = [p for p in paths if p not in PATHS]
    if unknown or not paths:
        raise InvalidArgumentError(f"--paths: unknown {', '.join(unknown) or '(none)'}; choose from {', '.join(PATHS)}")
    if sampler is not None and sampler not in SAMPLERS:
        raise SchedulerConfigError(f"unknown sampler {sampler!r}; supported: {', '.join(SAMPLERS)}")
    variants: dict[str, str] = {}
    for item in xla_flags:
        name, sep, flags = item.partition("=")
        if not sep or not name.strip() or not flags.strip():
            raise InvalidArgumentError(f"--xla-flags {item!r} must be NAME=FLAGS")
        variants[name.strip()] = flags.strip()
    sizes = _parse_sizes(batch_sizes) if batch_sizes else preset["batch_sizes"]
    batch = batch or preset["batch"]
    repeats = repeats or preset["repeats"]
    steady_repeats = steady_repeats or preset["steady_repeats"]
    for name, value in (("--n", batch), ("--repeats", repeats), ("--steady-repeats", steady_repeats),
                        ("--steps", steps if steps is not None else 1)):
        if value <= 0:
            raise InvalidArgumentError(f"{name} {value} must be a positive int")
    for out in (json_out, png_out):
        if out is not None and not out.parent.is_dir():
            raise InvalidArgumentError(f"{out.parent} does not exist")

    def log(line: str) -> None:
        click.echo(line, err=True)

    started = time.perf_counter()
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        context: Any = _Kept(keep)
    else:
        context = tempfile.TemporaryDirectory(prefix="preheat-compare-")
    with context as work:
        result = bench_compare(model, sampler=sampler, steps=steps or preset["steps"], batch=batch,
                               batch_sizes=sizes, seed=seed, guidance=guidance, repeats=repeats,
                               steady_repeats=steady_repeats, paths=paths, xla_variants=variants,
                               workdir=Path(work), timeout=timeout, log=log, flags=flags, dtype=dtype,
                               config=config, companions=companions)
    result["wall_s"] = time.perf_counter() - started
    result["settings"]["quick"] = quick
    echo_result(result, markdown(result), as_json)
    write_json(json_out, result)
    if png_out:
        plot(result, png_out)


class _Kept:
    def __init__(self, path: Path):
        self.path = path

    def __enter__(self) -> str:
        return str(self.path)

    def __exit__(self, *exc: Any) -> None:
        return None


@bench_group.command("serve")
@click.argument("model", required=False)
@click.option("--requests", "n_requests", default=256, show_default=True, type=int, help="Requests to send in all.")
@click.option("--concurrency", default=32, show_default=True, type=int, help="Concurrent clients.")
@click.option("--max-batch-size", default=8, show_default=True, type=int)
@click.option("--batch-wait-ms", default=10.0, show_default=True, type=NON_NEGATIVE)
@common_option("steps", help="Denoising steps per request, sent as num_inference_steps (default: the model's).")
@click.option("--timeout-s", default=600.0, show_default=True, type=float, help="Give up after this long in all.")
@click.option("--offline-s", default=8.0, show_default=True, type=float,
              help="Seconds to time the offline baseline (before and after the load).")
@click.option("--stream", is_flag=True,
              help="Then a second load of the same size on the same server, each client POSTing /predictions "
                   "with Accept: text/event-stream and reading the events to the end; reports streamed / JSON "
                   "served images/s.")
@output_options(default_report="bench-serve.json")
@one_line_errors
def bench_serve_command(model: Optional[str], n_requests: int, concurrency: int, max_batch_size: int,
                        batch_wait_ms: float, steps: Optional[int], timeout_s: float, offline_s: float,
                        stream: bool, json_out: Path, as_json: bool) -> None:
    """Load-test `preheat serve` on 127.0.0.1: throughput vs offline batching, latency, exactly-once
    (with --stream, streamed clients too: their served images/s over the JSON clients')."""
    from preheat.errors import InvalidArgumentError
    from preheat.bench.serve import markdown, run_bench

    if n_requests < 1 or concurrency < 1 or max_batch_size < 1 or timeout_s <= 0 or offline_s <= 0:
        raise InvalidArgumentError("--requests, --concurrency, --max-batch-size, --timeout-s and --offline-s must be positive")
    result = run_bench(model, n_requests=n_requests, concurrency=concurrency, max_batch_size=max_batch_size,
                       batch_wait_ms=batch_wait_ms, steps=steps, timeout_s=timeout_s, offline_s=offline_s,
                       json_out=json_out, stream=stream,
                       log=lambda line: click.echo(line, err=True))
    echo_result(result, markdown(result), as_json)
    click.echo(f"wrote {json_out}", err=True)
    if not result["exactly_once"] or result["server_exit_code"] != 0 or (stream and not result["stream_exactly_once"]):
        sys.exit(1)
