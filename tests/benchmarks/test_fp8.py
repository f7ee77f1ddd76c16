"""``benchmarks/fp8.py``: the H200 check's fp8 row (docs/gpu.md), without a GPU.

The kernel reader is checked on real HLO that XLA compiles for its H200 description on this CPU
(deviceless): the scaled-fp8 Linear as XLA's default picks it (one Triton GEMM that reads the fp8
weight) and the same program with Triton GEMMs switched off (cuBLAS: a convert kernel writing a
bf16 weight copy, the library GEMM, a scale-and-bias kernel), so both answers the GPU run can
give are seen here. ``measure`` runs whole on this CPU at a small size.
"""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.fp8 import computation, kernels, measure, one_gemm_on_fp8, written_bytes
from preheat import platforms
from preheat.cache import targets
from tests._support.tiers import gpu_only

N, TOKENS = 3072, 4096  # FLUX.1's hidden width, 4096 image tokens


def _h200_layer_hlo(**compiler_options: object) -> str:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from preheat.cache.compile import on_device
    from preheat.platforms import compiling_for
    from preheat.models.layers import Linear
    from preheat.models.quantised import Quantised
    from preheat.models.storage import upcast
    from preheat.models.weights import build_abstract

    if not any(k.startswith("jax-cuda") for k in platforms.cuda_versions()):
        pytest.skip("needs the test-gpu extra's jax-cuda13-plugin (make test-slow installs it)")
    graphdef, abstract = build_abstract(lambda rngs: Linear(N, N, rngs=rngs))
    values = jax.ShapeDtypeStruct((N, N), jnp.float8_e4m3fn)
    abstract["kernel"].set_value(Quantised(values, jax.ShapeDtypeStruct((1, N), jnp.float32)))  # per channel
    abstract["bias"].set_value(jax.ShapeDtypeStruct((N,), jnp.bfloat16))
    x = jax.ShapeDtypeStruct((TOKENS, N), jnp.bfloat16)

    def layer(params, x):  # (tokens, in) -> (tokens, out), as a denoiser's apply runs it
        return nnx.merge(graphdef, upcast(params, jnp.bfloat16, tie=x))(x)

    device = targets.target_device(targets.resolve_target("h200"))
    with compiling_for("gpu", (9, 0)):
        return jax.jit(layer).lower(*on_device((abstract, x), device)).compile(compiler_options or None).as_text()


@gpu_only  # a deviceless CUDA compile for the H200 (make test-slow)
def test_the_h200_fp8_linear_reads_as_one_gemm_on_the_fp8_weight():
    ks = kernels(_h200_layer_hlo())
    assert len(ks) == 1 and ks[0].op == "fusion" and ks[0].gemm, ks
    assert ks[0].reads_fp8 == f"f8e4m3fn[{N},{N}]" and ks[0].output.startswith(f"bf16[{TOKENS},{N}]")
    assert one_gemm_on_fp8(ks, N)


@gpu_only  # a deviceless CUDA compile for the H200 (make test-slow)
def test_the_same_layer_on_cublas_reads_as_three_kernels_and_not_one_gemm():
    ks = kernels(_h200_layer_hlo(xla_gpu_enable_triton_gemm=False))
    assert [(k.op, k.gemm) for k in ks] == [("fusion", False), ("custom-call", True), ("fusion", False)], ks
    convert, gemm, epilogue = ks
    assert convert.reads_fp8 == f"f8e4m3fn[{N},{N}]" and convert.output.startswith(f"bf16[{N},{N}]")  # a weight copy
    assert gemm.name.startswith("__cublas") and gemm.reads_fp8 == ""  # the library reads the bf16 copy
    assert not one_gemm_on_fp8(ks, N)


@gpu_only  # a deviceless CUDA compile for the H200 (make test-slow)
def test_written_bytes_and_computation_read_each_kernel():
    """The cuBLAS program's three kernels: the convert writes the bf16 weight (2 bytes an element),
    the library call its bf16 product and a workspace (a tuple: both counted), the epilogue the
    bf16 output; ``computation`` is the convert's fused body, its parameter the fp8 weight."""
    hlo = _h200_layer_hlo(xla_gpu_enable_triton_gemm=False)
    convert, gemm, epilogue = kernels(hlo)
    assert written_bytes(convert) == 2 * N * N and written_bytes(epilogue) == 2 * TOKENS * N
    assert gemm.output.startswith("(") and written_bytes(gemm) > 2 * TOKENS * N  # the product and its workspace
    body = computation(hlo, convert.name)
    assert body.lstrip("%").startswith(convert.name + " ") and f"f8e4m3fn[{N},{N}]" in body.split("\n", 1)[0], body[:200]
    assert computation(hlo, "no-such-computation") == ""


def test_measure_runs_both_layers_here_and_the_fp8_one_matches_its_bf16_reference():
    n = 256
    result = measure(n=n, tokens=64, calls=3, rounds=3)
    assert result["platform"] == "cpu" and (result["n"], result["tokens"]) == (n, 64)
    fp8, bf16 = result["fp8"], result["bf16"]
    assert any(k["reads_fp8"] == f"f8e4m3fn[{n},{n}]" for k in fp8["kernels"])  # the fp8 weight is what it reads
    assert any(k["gemm"] for k in fp8["kernels"]) and any(k["gemm"] for k in bf16["kernels"])
    assert not any(k["reads_fp8"] for k in bf16["kernels"])
    assert fp8["ms_per_call"] > 0 and bf16["ms_per_call"] > 0
    assert result["fp8_over_bf16"] == pytest.approx(fp8["ms_per_call"] / bf16["ms_per_call"])
    # the same weights, the scale on the product instead of on the weight: bf16 rounding apart
    assert 0 < result["mean_abs_delta"] < 0.02 and np.isfinite(result["bf16_tflops"])
