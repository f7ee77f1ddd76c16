"""A FLUX.1 GGUF file (Q8_0) read both ways, at FLUX.1's full widths with few blocks:

    python benchmarks/gguf_torch.py [--double 1] [--single 1] [--work DIR]

A random ``FluxTransformer2DModel`` at FLUX.1-dev's widths (24 heads x 128, T5 width 4096, pooled
768, 64 packed latent channels) with ``--double`` / ``--single`` blocks (FLUX.1-dev has 19 and 38)
is written as a city96-style GGUF file (BFL's keys, 2-D weights Q8_0; ``tests/_support``'s own
writer). Then, each timed once in this process:

* ``header``: the bytes a ``pull --dry-run hf://.../file.gguf`` reads (the tensor data's offset);
* ``convert (JAX)``: ``preheat.models.single_file.materialize``, the JAX engine's conversion
  (int8 values beside float16 scales, written once under the cache root);
* ``load (torch)``: ``preheat.backends.torch.text.load_gguf_denoiser``, diffusers'
  ``from_single_file`` with ``GGUFQuantizationConfig`` (nothing written);
* ``changed_inputs``: the stat a gc makes of the conversion's source.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--double", type=int, default=1)
    parser.add_argument("--single", type=int, default=1)
    parser.add_argument("--work", type=Path, default=None)
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-gguf-"))

    import gguf
    import torch
    from diffusers import FluxTransformer2DModel

    from preheat.backends.torch.text import load_gguf_denoiser
    from preheat.file_configs import GGUFSource
    from preheat.files import changed_inputs
    from preheat.models.single_file import materialize
    from tests._support.bfl_files import to_bfl, transformer_config_folder
    from tests._support.gguf_files import write_gguf

    torch.manual_seed(0)
    model = FluxTransformer2DModel(num_layers=args.double, num_single_layers=args.single, guidance_embeds=True)
    configs = transformer_config_folder(work / "configs", model)
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    params = sum(v.size for v in state.values())
    del model
    file = work / "flux1-bench-Q8_0.gguf"
    t = time.perf_counter()
    write_gguf(file, to_bfl(state), gguf.GGMLQuantizationType.Q8_0)
    written = time.perf_counter() - t
    del state
    header = int(gguf.GGUFReader(str(file)).data_offset)
    out = {"double": args.double, "single": args.single, "params": params, "file_bytes": file.stat().st_size,
           "write_s": round(written, 2), "header_bytes": header, "tensors": len(gguf.GGUFReader(str(file)).tensors)}

    t = time.perf_counter()
    converted = materialize(file, configs, work / "home")
    out["convert_jax_s"] = round(time.perf_counter() - t, 2)
    out["converted_bytes"] = sum(p.stat().st_size for p in converted.rglob("*.safetensors"))

    t = time.perf_counter()
    denoiser = load_gguf_denoiser(GGUFSource(file, configs), "float32")
    out["load_torch_s"] = round(time.perf_counter() - t, 2)
    out["torch_param_bytes"] = sum(p.numel() * p.element_size() for p in denoiser.parameters())

    t = time.perf_counter()
    for _ in range(1000):
        changed_inputs(converted)
    out["changed_inputs_us"] = round((time.perf_counter() - t) * 1000, 1)  # per call: 1000 calls, in ms -> us
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
