"""One scaled-fp8 Linear layer on the local devices: the kernels it compiles to, and its time
against a bf16 GEMM of the same shape (the GPU check's ``fp8`` row, ``scripts/gpu_measure.py``).

The layer is the one a denoiser's apply runs (``storage.upcast`` with the step's tie, then
``layers.Linear``): fp8 values with one float32 scale per output channel (``Quantised``, whose
``per_output`` scale multiplies the GEMM's product), a bf16 bias, bf16 activations. The bf16
reference is the same layer with the dequantised weight stored in bf16.

On a GPU the compile autotunes, so the HLO read here is what serves: the question is whether XLA
keeps ONE kernel, a GEMM that reads the fp8 weight itself (the convert fused into its operand
read, scale and bias in its epilogue), as the deviceless H200 compile has it
(tests/models/test_storage.py), or whether autotuning picks cuBLAS, which cannot read fp8 with
bf16 activations, and the convert becomes a kernel of its own that writes a bf16 weight copy.

    kernels(hlo)                  the entry computation's kernels (fusions, custom calls, other ops)
    computation(hlo, name)        one computation's text (a fusion's body: what a kernel reads)
    written_bytes(kernel)         the bytes a kernel writes (its output's)
    one_gemm_on_fp8(ks, n)        whether ``ks`` is one GEMM kernel reading the (n, n) fp8 weight
    measure(n, tokens, ...)       both layers compiled here: kernels, verdict, ms per call, |Δ|
"""

from __future__ import annotations

import functools
import re
import time
from typing import Any, NamedTuple

from preheat.bench.common import round_robin_ms

__all__ = ["Kernel", "kernels", "computation", "written_bytes", "one_gemm_on_fp8", "measure"]

# Entry-computation ops that launch nothing: the rest is a kernel (a fusion, a library call, or an
# op XLA left on its own).
_NO_KERNEL = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "opt-barrier", "after-all",
              "partition-id", "replica-id"}


class Kernel(NamedTuple):
    """One kernel of a compiled program's entry computation."""

    op: str  # "fusion", "custom-call", or the opcode of an op left unfused
    output: str  # its result type, e.g. "bf16[4096,3072]{1,0}"
    name: str  # the called computation (a fusion) or the call target (a custom call)
    gemm: bool  # a matrix product: a fusion around a dot, or a cuBLAS/cuBLASLt call
    reads_fp8: str  # the fp8 operands it reads, e.g. "f8e4m3fn[3072,3072]" ("" for none)


def _split_type(rest: str) -> tuple[str, str]:
    """``rest`` = "TYPE opcode(...)": (TYPE, the text after it); a tuple type has spaces inside."""
    if not rest.startswith("("):
        head, _, tail = rest.partition(" ")
        return head, tail
    depth = 0
    for i, ch in enumerate(rest):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0:
            return rest[:i + 1], rest[i + 2:]
    return rest, ""


def _computations(hlo: str) -> dict[str, str]:
    """Each named computation's text, by name (``%name`` or ``name``, as the HLO prints it)."""
    out = {}
    for block in re.split(r"\n(?=%?[\w.\-]+ \()", hlo):
        name = block.split(" ", 1)[0].lstrip("%")
        out[name] = block
    return out


def computation(hlo: str, name: str) -> str:
    """The text of ``hlo``'s computation ``name`` (a kernel's fused computation: ``Kernel.name``),
    its first line the parameters with their types; "" if there is none of that name."""
    return _computations(hlo).get(name.lstrip("%"), "")


def kernels(hlo: str) -> list[Kernel]:
    """The kernels of ``hlo`` (a compiled program's ``as_text()``), in the entry computation's order."""
    entry = hlo[hlo.index("\nENTRY"):]
    entry = entry[:entry.find("\n}") + 1] if "\n}" in entry else entry
    comps = _computations(hlo)
    out = []
    for line in entry.splitlines()[1:]:
        m = re.match(r"\s*(?:ROOT )?%?[\w.\-]+ = ", line)
        if m is None:
            continue
        output, rest = _split_type(line[m.end():])
        op = rest.split("(", 1)[0]
        if op in _NO_KERNEL:
            continue
        operands = rest[len(op):]
        name, body = "", ""
        if op == "fusion":
            called = re.search(r"calls=%?([\w.\-]+)", rest)
            name = called.group(1) if called else ""
            body = comps.get(name, "")
        elif op == "custom-call":
            target = re.search(r'custom_call_target="([^"]+)"', rest)
            name = target.group(1) if target else ""
        gemm = (" dot(" in body) or op == "dot" or bool(op == "custom-call" and re.search(r"gemm|matmul", name))
        header = body.split("\n", 1)[0]  # a fused computation's parameters, with their types
        fp8 = sorted(set(re.findall(r"f8e\w+\[[\d,]*\]", operands.split("), ")[0] + " " + header)))
        out.append(Kernel(op, output, name, gemm, " ".join(fp8)))
    return out


_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
          "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}


def written_bytes(kernel: Kernel) -> int:
    """The bytes ``kernel`` writes: its output's (every element of a tuple's: a cuDNN call's result
    and its scratch), from the HLO types. What a kernel writes is what the next one reads back."""
    total = 0
    for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", kernel.output):
        count = 1
        for d in filter(None, dims.split(",")):
            count *= int(d)
        total += _BYTES[dtype] * count
    return total


def one_gemm_on_fp8(ks: list[Kernel], n: int) -> bool:
    """Whether the program is one kernel, a GEMM that reads the (n, n) fp8 weight itself."""
    return len(ks) == 1 and ks[0].gemm and f"[{n},{n}]" in ks[0].reads_fp8


def measure(n: int = 3072, tokens: int = 4096, calls: int = 20, rounds: int = 20, seed: int = 0) -> dict[str, Any]:
    """The scaled-fp8 layer and its bf16 reference, compiled on the local devices (autotuned on a
    GPU): each one's kernels (one layer's program), the verdict, and the median ms per layer call
    (``calls`` layers chained in one program, ``y = layer(y)``, so that dispatch is not timed;
    ``rounds`` rounds, the two alternating). ``mean_abs_delta``: the fp8 layer's output against the
    bf16 one's, over the latter's mean magnitude (the same weights: the order of the scale only)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from preheat.models.layers import Linear
    from preheat.models.quantised import Quantised
    from preheat.models.storage import upcast
    from preheat.platforms import describe_device

    rng = np.random.default_rng(seed)
    graphdef, fp8 = nnx.split(Linear(n, n, rngs=nnx.Rngs(0)))
    _, bf16 = nnx.split(Linear(n, n, rngs=nnx.Rngs(0)))
    values = jnp.asarray(rng.standard_normal((n, n)), jnp.float8_e4m3fn)  # (in, out)
    scale = jnp.asarray(rng.uniform(0.5, 1.5, (1, n)) / np.sqrt(n), jnp.float32)  # per output: |y| stays ~|x|
    bias = jnp.asarray(rng.standard_normal((n,)) * 0.01, jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((tokens, n)), jnp.bfloat16)  # (tokens, in)
    fp8["kernel"].set_value(Quantised(values, scale))
    fp8["bias"].set_value(bias)
    bf16["kernel"].set_value(Quantised(values, scale).expand(jnp.bfloat16))  # the same weight, dequantised
    bf16["bias"].set_value(bias)

    def layer(params: Any, x: Any) -> Any:  # (tokens, n) -> (tokens, n), as a denoiser's apply runs it
        return nnx.merge(graphdef, upcast(params, jnp.bfloat16, tie=x))(x)

    def chained(params: Any, x: Any) -> Any:  # ``calls`` layers, each on the last one's output
        return jax.lax.fori_loop(0, calls, lambda _, y: layer(params, y), x)

    out: dict[str, Any] = {"n": n, "tokens": tokens, "calls_per_round": calls, "rounds": rounds,
                           **describe_device()}
    programs = {}
    for name, params in (("fp8", fp8), ("bf16", bf16)):
        start = time.perf_counter()
        one = jax.jit(layer).lower(params, x).compile()
        ks = kernels(one.as_text())
        programs[name] = (jax.jit(chained).lower(params, x).compile(), params)
        out[name] = {"compile_s": time.perf_counter() - start, "kernels": [k._asdict() for k in ks],
                     "one_gemm_on_fp8": one_gemm_on_fp8(ks, n), "result": one(params, x)}
    reference = np.asarray(out["bf16"].pop("result"), np.float32)
    got = np.asarray(out["fp8"].pop("result"), np.float32)
    out["mean_abs_delta"] = float(np.mean(np.abs(got - reference)) / max(np.mean(np.abs(reference)), 1e-30))
    medians = round_robin_ms({name: functools.partial(compiled, params, x) for name, (compiled, params) in programs.items()},
                             rounds, per_call=calls)
    for name in programs:
        out[name]["ms_per_call"] = medians[name]
    out["fp8_over_bf16"] = out["fp8"]["ms_per_call"] / out["bf16"]["ms_per_call"]
    flop = 2 * tokens * n * n
    out["bf16_tflops"] = flop / (out["bf16"]["ms_per_call"] * 1e-3) / 1e12
    return out
