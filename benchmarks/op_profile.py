"""Where one denoiser call's time goes, JAX vs torch.compile (was `preheat bench sampler --profile`).

    python -m benchmarks.op_profile [MODEL] [--n N] [--report F]     (MODEL: a pixel model; default built-in)

JAX: the compiled call's optimized HLO is parsed (every top-level instruction: its fused
computation's opcodes, FLOPs of its convolutions and dots, bytes of its operands and result) and
the call is traced with ``jax.profiler``; XLA:CPU's thunk executor names each thunk's trace event
after its instruction, so time, FLOPs and bytes meet per instruction, then per op class.

torch: diffusers' UNet2DModel under ``torch.compile`` (preheat's Inductor options), traced with
``torch.profiler`` with Inductor's per-kernel records on; self times per op name, classed by name
(Inductor names a fused kernel after the ops it fuses). FLOPs per class come from the same HLO
(the same math), so both sides are rated against the same work.

Each class gets its achieved GFLOP/s (compute classes) or GB/s (memory classes) against this
machine's matmul rate and copy bandwidth, measured in the same process. Times are thread-seconds
of the events (two thunks may run at once on two cores), so the per-class shares are of the sum.
"""

from __future__ import annotations

import glob
import math
import os
import re
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

import click

from preheat.bench.common import machine_line, write_json
from preheat.bench.random_models import materialize_model
from preheat.cli._support import one_line_errors
from preheat.cli.options import echo_result, output_options

__all__ = ["CLASSES", "hlo_instructions", "classify_hlo", "jax_breakdown", "torch_breakdown", "machine_rates",
           "markdown", "profile_model", "bench_profile"]

CLASSES = ("conv 3x3", "conv 1x1", "linear", "attention", "groupnorm+silu", "elementwise", "copies/layout",
           "other")
_COMPUTE = {"conv 3x3", "conv 1x1", "linear", "attention"}
_DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "f64": 8, "s32": 4, "u32": 4, "s64": 8, "u64": 8, "s8": 1, "u8": 1,
                "pred": 1, "s16": 2, "u16": 2}
_MOVES = {"copy", "transpose", "concatenate", "pad", "slice", "bitcast", "broadcast", "reshape", "parameter",
          "dynamic-slice", "dynamic-update-slice", "gather", "constant", "tuple", "get-tuple-element", "iota",
          "reverse", "copy-start", "copy-done"}
_INSTR = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.+?) ([a-z][\w\-]*)\((.*?)\)(, .*)?$")
_SHAPE = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")


def _dims(type_str: str) -> list[tuple[str, tuple[int, ...]]]:
    return [(dt, tuple(int(d) for d in dims.split(",") if d)) for dt, dims in _SHAPE.findall(type_str)]


def _bytes(type_str: str) -> int:
    return sum(_DTYPE_BYTES.get(dt, 4) * math.prod(shape) for dt, shape in _dims(type_str))


def hlo_instructions(text: str) -> tuple[dict[str, list[dict[str, Any]]], str]:
    """Computations of an HLO module's text -> their instructions (name, type, opcode, operands,
    attributes); and the entry computation's name."""
    comps: dict[str, list[dict[str, Any]]] = {}
    entry = ""
    current: list[dict[str, Any]] | None = None
    for line in text.splitlines():
        head = re.match(r"^(ENTRY )?%([\w.\-]+) .*\{\s*$", line)
        if head:
            current = comps.setdefault(head.group(2), [])
            if head.group(1):
                entry = head.group(2)
            continue
        if line.startswith("}"):
            current = None
            continue
        m = _INSTR.match(line)
        if m and current is not None:
            current.append({"name": m.group(1), "type": m.group(2), "op": m.group(3),
                            "operands": re.findall(r"%([\w.\-]+)", m.group(4)), "attrs": m.group(5) or ""})
    return comps, entry


def _flops(ins: dict[str, Any], types: dict[str, str]) -> tuple[float, str | None]:
    """FLOPs of a convolution or dot (2 per multiply-add), and the class it implies."""
    out = math.prod(_dims(ins["type"])[0][1])
    if ins["op"] == "convolution":
        kernel = _dims(types.get(ins["operands"][1], ""))
        labels = re.search(r"dim_labels=\w+_(\w+)->", ins["attrs"])
        if not kernel or not labels:
            return 0.0, "conv 3x3"
        kshape = kernel[0][1]
        o = labels.group(1).index("o")
        window = re.search(r"size=([\dx]+)", ins["attrs"])
        one = window is None or set(window.group(1).split("x")) == {"1"}
        return 2.0 * out * math.prod(kshape) / kshape[o], "conv 1x1" if one else "conv 3x3"
    lhs = _dims(types.get(ins["operands"][0], ""))
    contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins["attrs"])
    k = math.prod(lhs[0][1][int(d)] for d in contracting.group(1).split(",") if d) if lhs and contracting else 1
    batched = "lhs_batch_dims" in ins["attrs"]
    return 2.0 * out * k, "attention" if batched else "linear"


def classify_hlo(text: str) -> dict[str, dict[str, Any]]:
    """Every instruction that runs as a thunk (in the entry computation or a loop body, not inside
    a fusion) -> its class, FLOPs and bytes (operands + result)."""
    comps, entry = hlo_instructions(text)
    fused = {c for ins in (i for v in comps.values() for i in v)
             for c in re.findall(r"calls=%([\w.\-]+)", ins["attrs"])}
    scheduled = [name for name in comps if name not in fused]  # the entry and while/conditional bodies
    out: dict[str, dict[str, Any]] = {}
    for ins, entry_types in ((i, {j["name"]: j["type"] for j in comps[c]}) for c in scheduled for i in comps[c]):
        if ins["op"] in ("parameter", "constant", "bitcast", "tuple", "get-tuple-element", "while", "conditional",
                         "call"):
            continue
        called = re.findall(r"(?:calls|body|condition|to_apply)=%([\w.\-]+)", ins["attrs"])
        body = [j for c in called for j in comps.get(c, [])] or [ins]
        types = {j["name"]: j["type"] for j in body}
        ops = {j["op"] for j in body}
        flops, cls = 0.0, None
        for j in body:
            if j["op"] in ("convolution", "dot"):
                f, c = _flops(j, types if j is not ins else entry_types)
                flops += f
                cls = c if cls is None or c.startswith("conv") else cls
        if cls is None:
            if "exponential" in ops and "reduce" in ops:
                cls = "attention"  # softmax
            elif "rsqrt" in ops or "reduce" in ops:
                cls = "groupnorm+silu"
            elif ops <= _MOVES:
                cls = "copies/layout"
            else:
                cls = "elementwise"
        moved = _bytes(ins["type"]) + sum(_bytes(entry_types.get(o, "")) for o in ins["operands"])
        out[ins["name"]] = {"class": cls, "flops": flops, "bytes": moved, "opcode": ins["op"],
                            "operands": ins["operands"]}
    for hit in out.values():  # GroupNorm's second pass (normalise, scale, act) eats the statistics
        if hit["class"] == "elementwise" and any(out.get(o, {}).get("class") == "groupnorm+silu"
                                                 for o in hit["operands"]):
            hit["class"] = "groupnorm+silu"
    for hit in out.values():
        del hit["operands"]
    return out


def _rate_table(times: dict[str, float], flops: dict[str, float], moved: dict[str, float], calls: int
                ) -> dict[str, dict[str, float]]:
    total = sum(times.values()) or float("nan")
    table = {}
    for cls in CLASSES:
        t = times.get(cls, 0.0) / calls
        if t == 0.0 and not flops.get(cls):
            continue
        row = {"ms": 1e3 * t, "share": times.get(cls, 0.0) / total, "gflop": flops.get(cls, 0.0) / 1e9,
               "gb": moved.get(cls, 0.0) / 1e9}
        row["gflops"] = row["gflop"] / t if t else float("nan")
        row["gbps"] = row["gb"] / t if t and row["gb"] else float("nan")
        table[cls] = row
    return table


def jax_breakdown(fn: Callable[..., Any], args: tuple, calls: int = 5) -> dict[str, Any]:
    """Per-class time, GFLOP and GB of one call of ``jax.jit(fn)(*args)`` on this backend."""
    import jax
    from jax.profiler import ProfileData

    compiled = jax.jit(fn).lower(*args).compile()
    info = classify_hlo(compiled.as_text())
    compiled(*args).block_until_ready()
    folder = tempfile.mkdtemp(prefix="preheat-profile-")
    with jax.profiler.trace(folder):
        start = time.perf_counter()
        for _ in range(calls):
            compiled(*args).block_until_ready()
        wall = (time.perf_counter() - start) / calls
    data = ProfileData.from_file(glob.glob(f"{folder}/**/*.xplane.pb", recursive=True)[0])
    times: dict[str, float] = defaultdict(float)
    for plane in data.planes:
        for line in plane.lines:
            for event in line.events:
                hit = info.get(event.name)
                if hit is not None:
                    times[hit["class"]] += event.duration_ns * 1e-9
    flops: dict[str, float] = defaultdict(float)
    moved: dict[str, float] = defaultdict(float)
    for hit in info.values():
        flops[hit["class"]] += hit["flops"]
        moved[hit["class"]] += hit["bytes"]
    return {"wall_ms": 1e3 * wall, "traced_ms": 1e3 * sum(times.values()) / calls,
            "flops": sum(flops.values()), "classes": _rate_table(times, flops, moved, calls),
            "class_flops": dict(flops), "thunks": len(info)}


def _torch_class(name: str, shapes: Any) -> str:
    n = name.lower()
    if "conv" in n and ("aten::" in n or "mkldnn" in n or "onednn" in n):
        if n in ("aten::convolution", "aten::_convolution", "aten::conv2d"):
            return "other"  # dispatch layers above the kernel: their self time is overhead
        kernel = shapes[1] if shapes and len(shapes) > 1 and len(shapes[1]) == 4 else None
        return "conv 1x1" if kernel is not None and kernel[2:] == [1, 1] else "conv 3x3"
    if any(k in n for k in ("softmax", "bmm", "scaled_dot_product", "flash_attention", "_efficient_attention")):
        return "attention"
    if any(k in n for k in ("addmm", "aten::mm", "linear", "mkl_linear", "_mkl")):
        return "linear"
    if "cpp_fused" in n:
        if "exp" in n and ("amax" in n or "max" in n or "sum" in n):
            return "attention"
        if "group_norm" in n or "var_mean" in n or "native_layer_norm" in n:
            return "groupnorm+silu"
        parts = set(re.sub(r"^.*cpp_fused_|_\d+$", "", n).split("_")) - {""}
        if parts <= {"cat", "clone", "copy", "view", "permute", "transpose", "constant", "pad", "index", "slice",
                     "as", "strided", "unsqueeze", "stack", "repeat", "expand"}:
            return "copies/layout"
        return "elementwise"
    if any(k in n for k in ("copy_", "aten::cat", "aten::clone", "contiguous", "aten::empty_strided")):
        return "copies/layout"
    if "group_norm" in n:
        return "groupnorm+silu"
    if n.startswith("aten::") and any(k in n for k in ("add", "mul", "silu", "div", "sub", "sigmoid")):
        return "elementwise"
    return "other"


def torch_breakdown(unet_dir: str, x: Any, t: Any, labels: Any, class_flops: dict[str, float], calls: int = 5
                    ) -> dict[str, Any]:
    """The same denoiser call on diffusers' UNet2DModel under torch.compile (fp32, CPU)."""
    import torch
    from diffusers import UNet2DModel

    from preheat.backends.torch.compile_cache import INDUCTOR_OPTIONS

    torch._inductor.config.cpp.enable_kernel_profile = True  # a record per Inductor kernel
    model = UNet2DModel.from_pretrained(unet_dir).eval()
    forward = torch.compile(model, **INDUCTOR_OPTIONS)
    xt, tt = torch.as_tensor(x), torch.as_tensor(t)
    yt = None if labels is None else torch.as_tensor(labels)

    def call() -> Any:
        with torch.inference_mode():
            return forward(xt, tt, class_labels=yt).sample

    call()
    call()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        start = time.perf_counter()
        for _ in range(calls):
            call()
        wall = (time.perf_counter() - start) / calls
    times: dict[str, float] = defaultdict(float)
    for row in prof.key_averages(group_by_input_shape=True):
        times[_torch_class(row.key, row.input_shapes)] += row.self_cpu_time_total * 1e-6
    table = _rate_table(times, class_flops, {}, calls)
    return {"wall_ms": 1e3 * wall, "traced_ms": 1e3 * sum(times.values()) / calls, "classes": table,
            "threads": torch.get_num_threads(), "call": call}


def machine_rates(n: int = 2048, mb: int = 256, repeats: int = 5) -> dict[str, float]:
    """This machine now: f32 matmul GFLOP/s (XLA and torch) and copy GB/s (read + write)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    from preheat.bench.common import timed

    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    mm = jax.jit(lambda x: x @ x)
    jax_mm = min(timed(lambda: mm(a).block_until_ready(), repeats))
    ta = torch.randn(n, n)
    torch_mm = min(timed(lambda: ta @ ta, repeats))
    src = np.ones(mb * 2**20 // 4, np.float32)
    dst = np.empty_like(src)
    copy = min(timed(lambda: np.copyto(dst, src), repeats))
    return {"matmul_gflops": 2 * n**3 / jax_mm / 1e9, "torch_matmul_gflops": 2 * n**3 / torch_mm / 1e9,
            "copy_gbps": 2 * src.nbytes / copy / 1e9}


def profile_model(pipe: Any, unet_dir: str, batch: int, calls: int = 5, ratio_repeats: int = 7) -> dict[str, Any]:
    """One denoiser call at ``batch`` images (2x for guided models), both sides, one process;
    then the two calls timed alternately (``ratio_repeats`` each) for their ratio."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    sig, args = pipe.prepare(batch, steps=2, seed=0)
    n = 2 * batch if sig.guided else batch
    cond = args.cond
    if sig.guided:
        cond = jax.tree.map(lambda c, u: jnp.concatenate([c, u]), args.cond, args.uncond)
    x = jax.random.normal(jax.random.key(0), (n, *sig.sample_shape), sig.dtype)
    t = jnp.full((n,), 500.0, jnp.float32)
    rates = machine_rates()
    load_before = os.getloadavg()[0]
    jx = jax_breakdown(pipe.apply, (pipe.params, x, t, cond), calls)
    labels = cond.get("class_labels") if isinstance(cond, dict) else None
    th = torch_breakdown(unet_dir, np.asarray(x).transpose(0, 3, 1, 2).copy(), np.asarray(t).astype(np.int64),
                         None if labels is None else np.asarray(labels).astype(np.int64), jx["class_flops"], calls)
    compiled = jax.jit(pipe.apply).lower(pipe.params, x, t, cond).compile()
    jax_times, torch_times = [], []
    for _ in range(ratio_repeats):  # alternate, so that drifting load hits both sides alike
        start = time.perf_counter()
        compiled(pipe.params, x, t, cond).block_until_ready()
        jax_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        th["call"]()
        torch_times.append(time.perf_counter() - start)
    del th["call"]
    jax_ms, torch_ms = 1e3 * float(np.median(jax_times)), 1e3 * float(np.median(torch_times))
    return {"batch": batch, "model_batch": n, "sample_shape": list(sig.sample_shape), "rates": rates,
            "jax": jx, "torch": th, "jax_ms": jax_ms, "torch_ms": torch_ms,
            "jax_over_torch_speed": torch_ms / jax_ms, "gflop_per_call": jx["flops"] / 1e9,
            "jax_gflops": jx["flops"] / jax_ms / 1e6, "torch_gflops": jx["flops"] / torch_ms / 1e6,
            "load_average": [load_before, os.getloadavg()[0]]}


def markdown(result: dict[str, Any]) -> str:
    r = result
    rates = r["rates"]
    lines = [f"Denoiser call at batch {r['batch']} (model batch {r['model_batch']}, sample {r['sample_shape']}), "
             f"{r['gflop_per_call']:.2f} GFLOP. Machine now: matmul {rates['matmul_gflops']:.0f} GFLOP/s (XLA), "
             f"{rates['torch_matmul_gflops']:.0f} (torch); copy {rates['copy_gbps']:.1f} GB/s; load average "
             f"{r['load_average'][0]:.1f} → {r['load_average'][1]:.1f}.",
             "",
             f"Alternating calls: JAX {r['jax_ms']:.1f} ms, torch.compile {r['torch_ms']:.1f} ms per call "
             f"(JAX speed {r['jax_over_torch_speed']:.2f}× torch.compile); achieved {r['jax_gflops']:.0f} vs "
             f"{r['torch_gflops']:.0f} GFLOP/s ({100 * r['jax_gflops'] / rates['matmul_gflops']:.0f}% vs "
             f"{100 * r['torch_gflops'] / rates['matmul_gflops']:.0f}% of the XLA matmul rate).",
             "",
             "| op class | JAX ms | JAX share | JAX rate | torch.compile ms | torch share | torch rate |",
             "|---|---|---|---|---|---|---|"]

    def rate(row: dict[str, float] | None, cls: str) -> str:
        if not row:
            return "–"
        if cls in _COMPUTE and row["gflop"]:
            return f"{row['gflops']:.0f} GFLOP/s ({100 * row['gflops'] / rates['matmul_gflops']:.0f}% mm)"
        if row.get("gb"):
            return f"{row['gbps']:.1f} GB/s ({100 * row['gbps'] / rates['copy_gbps']:.0f}% copy)"
        return "–"

    for cls in CLASSES:
        j, t = r["jax"]["classes"].get(cls), r["torch"]["classes"].get(cls)
        if not j and not t:
            continue
        lines.append(f"| {cls} | {j['ms'] if j else 0:.2f} | {100 * j['share'] if j else 0:.0f}% | {rate(j, cls)} | "
                     f"{t['ms'] if t else 0:.2f} | {100 * t['share'] if t else 0:.0f}% | {rate(t, cls)} |")
    lines.append(f"| traced total (wall under the profiler) | {r['jax']['traced_ms']:.1f} ({r['jax']['wall_ms']:.1f}) | | | "
                 f"{r['torch']['traced_ms']:.1f} ({r['torch']['wall_ms']:.1f}) | | |")
    return "\n".join(lines)


def bench_profile(model: str | None, batch: int | None, workdir: Path) -> tuple[str, dict[str, Any]]:
    """The per-op-class breakdown of one denoiser call; pixel models.
    Default batch: a model batch of 16 (8 images under guidance)."""
    import preheat
    from preheat.engine import BUILTIN_MODEL
    from preheat.errors import InvalidArgumentError

    folder = Path(materialize_model(model, workdir) or BUILTIN_MODEL)
    unet_dir = folder / "unet" if (folder / "unet").is_dir() else folder
    pipe = preheat.load(str(folder), cache="off")
    if pipe.family.name != "pixel":
        raise InvalidArgumentError(f"op_profile measures pixel UNet models; {folder} is a {pipe.family.name} model")
    if batch is None:
        batch = 8 if pipe.prepare(1, steps=2, seed=0)[0].guided else 16
    result = profile_model(pipe, str(unet_dir), batch)
    result["model"] = model or "built-in:digits"
    result["machine"] = machine_line()
    text = f"**{result['model']}** — {result['machine']}\n\n" + markdown(result)
    return text, result


@click.command()
@click.argument("model", required=False)
@click.option("--n", type=int, help="Images of the call (default: a model batch of 16: 8 guided, else 16).")
@output_options()
@one_line_errors
def main(model: str | None, n: int | None, json_out: Path | None, as_json: bool) -> None:
    """Per op class: time, share and achieved rate of one denoiser call, JAX vs torch.compile."""
    with tempfile.TemporaryDirectory() as tmp:
        text, result = bench_profile(model, n, Path(tmp))
    echo_result(result, text, as_json)
    write_json(json_out, result)


if __name__ == "__main__":
    main()
