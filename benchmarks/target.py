"""Deviceless GPU compile time per stage (``preheat warm --target``),
with the same programs' CPU compile time and both executables' bytes beside it.

Rows: the built-in model's sampling program; a tiny SD 1.x folder's three programs (text
encoder, denoising loop, VAE decoder), through the real pipeline and its compilers; and one
call of the full-size SD 1.5 and SDXL UNets on abstract weights (shapes only: nothing is
allocated or read), lowered once and compiled for both. Two ratio columns give the target's
compile seconds and bytes as multiples of the CPU's; the last names the UNets' cuDNN calls that
the deviceless compile could not finish (``cache.entries.UNRUNNABLE``: "none" is the goal).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import click

from preheat.bench.common import write_json
from preheat.bench.random_models import SDXL_UNET
from preheat.cli._support import one_line_errors
from preheat.cli.options import echo_result, output_options

__all__ = ["bench_target", "markdown", "with_ratios"]



def _pipeline_rows(name: str, model: str | None, dtype: str, target: Any) -> list[dict[str, Any]]:
    """Each stage of one call (batch 1, guidance off), compiled for the target and for this CPU."""
    import preheat
    from preheat.cache.compile import JaxCompiler, TargetCompiler, compile_described

    out: dict[str, dict[str, Any]] = {}
    for side in ("target", "cpu"):
        with tempfile.TemporaryDirectory() as tmp:
            pipe = preheat.load(model, dtype=dtype, cache="off")
            pipe.compiler = (TargetCompiler(target, root=Path(tmp), remote=None) if side == "target"
                             else JaxCompiler(root=Path(tmp), remote=None))
            from preheat.families.inputs import example_inputs

            # compiled, none run (a target's executables are for another machine), one at a time: each
            # stage's own compile time (a prompt where required)
            stages = pipe.describe(1, steps=1, seed=0, **example_inputs(pipe.family.input_specs(pipe)))
            compile_described(pipe.compiler, [stages], pipe.program, at_once=1)
            for event in pipe.compiler.events:
                exe = Path(tmp) / "compile" / "jax" / event["key"] / "executable.bin"
                row = out.setdefault(event["stage"], {"model": name, "stage": event["stage"], "dtype": dtype})
                row[f"{side}_trace_lower_s"] = event["trace_lower_s"]
                row[f"{side}_compile_s"] = event["compile_or_load_s"]
                row[f"{side}_bytes"] = exe.stat().st_size if exe.is_file() else None
    return list(out.values())


def _unet_row(name: str, config: dict[str, Any], batch: int, latent: int, dtype: Any, target: Any) -> dict[str, Any]:
    """One UNet call (CFG's doubled batch) on abstract weights, for the target and for this CPU."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.experimental.serialize_executable import serialize

    from preheat.cache.compile import on_device
    from preheat.cache.entries import unrunnable_cudnn_calls
    from preheat.cache.targets import target_device
    from preheat.platforms import compiling_for
    from preheat.models.unet2d_condition import UNet2DConditionConfig, build_abstract

    cfg = UNet2DConditionConfig.from_dict(config)
    graph, state = build_abstract(cfg)
    state = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, dtype), state)
    sds = jax.ShapeDtypeStruct
    x, t = sds((batch, latent, latent, 4), dtype), sds((batch,), jnp.float32)
    ctx = sds((batch, 77, cfg.cross_attention_dim), dtype)
    added = ({"text_embeds": sds((batch, 1280), dtype), "time_ids": sds((batch, 6), jnp.float32)}
             if cfg.addition_embed_type == "text_time" else None)

    def call(state: Any, x: Any, t: Any, ctx: Any, added: Any) -> Any:  # (B, H, W, 4) -> (B, H, W, 4)
        return nnx.merge(graph, state)(x, t, ctx, added)

    args = (state, x, t, ctx, added)
    row: dict[str, Any] = {"model": name, "stage": f"UNet call, batch {batch}, {latent}x{latent} latents",
                           "dtype": jnp.dtype(dtype).name}
    sides: dict[str, Callable[[], Any]] = {
        "target": lambda: jax.jit(call).lower(*on_device(args, target_device(target))),
        "cpu": lambda: jax.jit(call).lower(*args)}
    for side, lower in sides.items():
        start = time.perf_counter()
        with compiling_for(target.platform, target.capability) if side == "target" else _null():
            lowered = lower()
        traced = time.perf_counter()
        compiled = lowered.compile()
        row[f"{side}_trace_lower_s"], row[f"{side}_compile_s"] = traced - start, time.perf_counter() - traced
        row[f"{side}_bytes"] = len(serialize(compiled)[0])
        if side == "target":
            row["unrunnable"] = unrunnable_cudnn_calls(compiled) or "none"
    return row


def _null() -> Any:
    import contextlib

    return contextlib.nullcontext()


def bench_target(target_name: str, workdir: Path, full_size: bool = True) -> dict[str, Any]:
    """Every row (see the module docstring) for ``target_name``."""
    import jax.numpy as jnp

    from preheat.bench.random_models import SD15_UNET
    from preheat.bench.random_models import save_random_sd1_tiny
    from preheat.cache.targets import compile_only_platforms, resolve_target

    compile_only_platforms()  # before the CPU rows start JAX: the plugin must register on a GPU-less builder
    target = resolve_target(target_name)
    rows = _pipeline_rows("built-in", None, "bfloat16", target)
    rows += _pipeline_rows("tiny SD 1.x", str(save_random_sd1_tiny(workdir / "sd1-tiny")), "bfloat16", target)
    if full_size:
        rows.append(_unet_row("SD 1.5 UNet (abstract)", SD15_UNET, 2, 64, jnp.bfloat16, target))
        rows.append(_unet_row("SDXL UNet (abstract)", SDXL_UNET, 2, 128, jnp.bfloat16, target))
    return {"target": target.name, "rows": [with_ratios(r) for r in rows]}


def with_ratios(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` with the target's compile seconds and bytes as multiples of the CPU's (None where
    a side has no number): what the table's two ratio columns show."""
    def ratio(target: Any, cpu: Any) -> Any:
        return None if target is None or not cpu else target / cpu

    return {**row, "compile_ratio": ratio(row["target_compile_s"], row["cpu_compile_s"]),
            "bytes_ratio": ratio(row["target_bytes"], row["cpu_bytes"])}


def markdown(result: dict[str, Any]) -> str:
    from preheat.bench.common import machine_line

    lines = [f"Deviceless compile for `{result['target']}` vs this CPU — {machine_line()}", "",
             "| model | stage | dtype | target trace+lower s | target compile s | target bytes | CPU trace+lower s "
             "| CPU compile s | CPU bytes | compile target/CPU | bytes target/CPU | cuDNN calls left unfinished |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        def b(v: Any) -> str:
            return "-" if v is None else f"{v / 1e6:.2f} MB"

        def x(v: Any) -> str:
            return "-" if v is None else f"{v:.2f}×"
        unfinished = r.get("unrunnable", "-")  # read only for the full-size UNets
        lines.append(f"| {r['model']} | {r['stage']} | {r['dtype']} | {r['target_trace_lower_s']:.2f} | "
                     f"{r['target_compile_s']:.2f} | {b(r['target_bytes'])} | {r['cpu_trace_lower_s']:.2f} | "
                     f"{r['cpu_compile_s']:.2f} | {b(r['cpu_bytes'])} | {x(r['compile_ratio'])} | "
                     f"{x(r['bytes_ratio'])} | {unfinished} |")
    return "\n".join(lines)


@click.command()
@click.option("--target", "target_name", default="h200", show_default=True, metavar="NAME|FILE",
              help="The GPU compiled for (as `preheat warm --target`).")
@click.option("--no-full-size", is_flag=True, help="Leave out the full-size SD 1.5 and SDXL UNets.")
@output_options()
@one_line_errors
def main(target_name: str, no_full_size: bool, json_out: Path | None, as_json: bool) -> None:
    """Deviceless GPU compile time per stage against the same programs' CPU compile, and bytes."""
    with tempfile.TemporaryDirectory() as tmp:
        result = bench_target(target_name, Path(tmp), full_size=not no_full_size)
    echo_result(result, markdown(result), as_json)
    write_json(json_out, result)


if __name__ == "__main__":
    main()
