"""Weights kept compact on the device (issue 28 items 2 and 3): scaled fp8 and GGUF Q8_0 against
the same weights at full precision.

A tiny random FLUX.1-dev folder (the test suite's ``save_tiny_flow_model``), its transformer
written in BFL's layout as a ComfyUI-style scaled fp8 file (``amax / 448`` per-tensor scales), as
the same weights dequantised to float32 (loaded in float32 and in bfloat16), and (``--gguf``) as
a Q8_0 GGUF file; each loaded with ``config=`` the folder. Prints the denoiser's device bytes and
images/s of each (timed round-robin, so drifting load hits all alike), then the device bytes of
the full-size FLUX.1-dev transformer each way (abstract build, nothing allocated). The numbers
behind docs/benchmarks.md, "Scaled fp8 kept on the device" and "GGUF Q8_0 kept on the device".

    PYTHONPATH=src:. python benchmarks/quantised.py [--rounds 5] [--n 4] [--steps 4] [--size 64] [--gguf]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

FP8_MAX = 448.0


def _files(base: Path, with_gguf: bool) -> tuple[Path, dict[str, tuple[Path, dict[str, str]]]]:
    import ml_dtypes
    from safetensors.numpy import load_file, save_file

    from tests._support.bfl_files import to_bfl
    from tests._support.flow_fixtures import save_tiny_flow_model

    folder = save_tiny_flow_model(base / "flux-dev", "flux-dev")
    bfl = to_bfl(load_file(str(folder / "transformer" / "diffusion_pytorch_model.safetensors")))
    scaled, plain = {"scaled_fp8": np.zeros((0,), ml_dtypes.float8_e4m3fn)}, {}
    for key, value in bfl.items():
        if value.ndim != 2 or not key.endswith(".weight"):
            scaled[key] = plain[key] = value
            continue
        scale = np.float32(np.abs(value).max() / FP8_MAX)
        scaled[key] = (value / scale).astype(ml_dtypes.float8_e4m3fn)
        scaled[key[:-len("weight")] + "scale_weight"] = np.array(scale, np.float32)
        plain[key] = scaled[key].astype(np.float32) * scale
    files = {}
    for name, tensors in (("scaled fp8, kept on the device", scaled), ("dequantised on the host (float32)", plain)):
        files[name] = (base / f"{len(files)}.safetensors", {})
        save_file(tensors, str(files[name][0]))
    files["dequantised on the host (bfloat16)"] = (files["dequantised on the host (float32)"][0], {"dtype": "bfloat16"})
    if with_gguf:  # city96's layout: 2-D weights in Q8_0 where their rows are blocks of 32, F16 else, 1-D F32
        import gguf

        q8 = gguf.GGMLQuantizationType.Q8_0
        writer = gguf.GGUFWriter(str(base / "q8.gguf"), arch="flux")
        for key, value in bfl.items():
            value = np.asarray(value, np.float32)
            if value.ndim == 2 and value.shape[-1] % 32 == 0:
                writer.add_tensor(key, gguf.quants.quantize(value, q8), raw_dtype=q8)
            else:
                writer.add_tensor(key, value.astype(np.float16) if value.ndim >= 2 else value)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        files["GGUF Q8_0, kept on the device"] = (base / "q8.gguf", {})
    return folder, files


def _full_size() -> None:
    import jax.numpy as jnp
    from flax import nnx

    from preheat.models.flux import FluxTransformerConfig, build_abstract
    from preheat.models.published import CONFIGS
    from preheat.models.storage import layerwise, placed_bytes

    config = FluxTransformerConfig.from_dict(  # the published config preheat ships for single files
        json.loads((CONFIGS / "FLUX.1-dev" / "transformer" / "config.json").read_text()), "FLUX.1-dev")
    _, abstract = build_abstract(config)
    bf16 = placed_bytes(abstract, jnp.bfloat16)
    fp8 = placed_bytes(abstract, jnp.bfloat16, "float8_e4m3fn", ("pos_embed", "norm"), weights_layers="linear")
    low = layerwise(("pos_embed", "norm"), type("O", (), {"weights_layers": "linear"})())
    scales = sum(1 for path, _ in nnx.to_flat_state(abstract)
                 if str(path[-1]) == "kernel" and low(".".join(map(str, path[:-1])) + ".weight"))
    print(f"full-size FLUX.1-dev transformer: bf16 {bf16 / 1e9:.2f} GB; every Linear in fp8 with its scale "
          f"{(fp8 + 4 * scales) / 1e9:.2f} GB ({(fp8 + 4 * scales) / bf16:.3f}x; {scales} scales, {4 * scales} B)")
    linear = sum(int(np.prod(v.shape)) for path, v in nnx.to_flat_state(abstract)
                 if str(path[-1]) == "kernel" and low(".".join(map(str, path[:-1])) + ".weight"))
    rest = bf16 - 2 * linear
    q8_0 = linear * 34 // 32 + rest  # Q8_0: 34 bytes per 32 values; the rest (biases, norms, img_in's odd rows) bf16
    print(f"full-size FLUX.1-dev transformer: every Linear in Q8_0 (34 B per 32), the rest bf16: "
          f"{q8_0 / 1e9:.2f} GB ({q8_0 / bf16:.3f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--gguf", action="store_true", help="a GGUF Q8_0 file too (needs the gguf package)")
    args = parser.parse_args()
    import os

    import preheat
    from preheat.models.storage import device_bytes

    with tempfile.TemporaryDirectory() as tmp:
        os.environ["PREHEAT_HOME"] = str(Path(tmp) / "home")
        folder, files = _files(Path(tmp), args.gguf)
        pipes = {name: preheat.load(f, config=folder, cache="off", **load) for name, (f, load) in files.items()}
        call = dict(prompt="a watercolor fox", n=args.n, steps=args.steps, sampler="flow_euler", guidance=3.5,
                    width=args.size, height=args.size, seed=0)
        images = {name: pipe.generate(**call) for name, pipe in pipes.items()}  # compiles
        times: dict[str, list[float]] = {name: [] for name in pipes}
        for _ in range(args.rounds):
            for name, pipe in pipes.items():
                t0 = time.perf_counter()
                pipe.generate(**call)
                times[name].append(time.perf_counter() - t0)
        ref = images["dequantised on the host (float32)"].astype(np.int32)
        print(f"{args.n} images {args.size}x{args.size}, {args.steps} steps, {args.rounds} rounds; mean |Δpx| against "
              f"the float32 load: " + ", ".join(f"{name} {np.abs(im.astype(np.int32) - ref).mean():.4f}"
                                                for name, im in images.items()))
        for name, pipe in pipes.items():
            med = statistics.median(times[name])
            print(f"  {name}: denoiser {device_bytes(pipe.params)} B on the device, "
                  f"{args.n / med:.2f} images/s (median {med * 1e3:.0f} ms, min {min(times[name]) * 1e3:.0f} ms)")
    _full_size()


if __name__ == "__main__":
    main()
