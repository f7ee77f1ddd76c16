"""diffusers' LoRA hot-swap under ``preheat.torch.compile`` (issue 15, item 5): what recompiles,
and how long a switch takes (a LoRA read from its file vs one already held in memory: an LRU hit).

    PYTHONPATH=src:. python benchmarks/torch_hotswap.py OUT.json

Builds the tiny Flux test folder and peft LoRA files as the tests do, compiles the transformer's
blocks (regional) with LoRA A loaded after ``enable_lora_hotswap(target_rank=8)``, then swaps in:
B (same targets, rank 2), A again from memory, D (rank 16 > 8), C (one more target module). For
each: the switch time, Dynamo frames compiled by the next call, and the error diffusers / peft
raise, if any.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch._dynamo.utils import counters

import preheat.torch
from tests._support.flow_fixtures import reference_pipeline, save_tiny_flow_model
from tests._support.lora_files import peft_layers, save_lora

TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "proj_mlp", "ff.net.2"]


def main(out: Path) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="hotswap-"))
    folder = save_tiny_flow_model(tmp / "flux", kind="flux-dev")
    ref = reference_pipeline(folder)
    files = {
        "A": save_lora(ref, tmp / "A", "transformer", {"transformer": peft_layers(ref.transformer, TARGETS, 4, 4, 1)}),
        "B": save_lora(ref, tmp / "B", "transformer", {"transformer": peft_layers(ref.transformer, TARGETS, 2, 4, 2)}),
        "C": save_lora(ref, tmp / "C", "transformer", {"transformer": peft_layers(ref.transformer, [*TARGETS, "add_k_proj"],
                                                                               4, 4, 3)}),
        "D": save_lora(ref, tmp / "D", "transformer", {"transformer": peft_layers(ref.transformer, TARGETS, 16, 16, 4)}),
    }
    pipe = reference_pipeline(folder)

    def run() -> float:
        start = time.perf_counter()
        with torch.no_grad():
            pipe("a photo of a cat", height=32, width=32, num_inference_steps=2, output_type="np",
                 generator=torch.Generator("cpu").manual_seed(0))
        return time.perf_counter() - start

    pipe.enable_lora_hotswap(target_rank=8)
    t = time.perf_counter()
    pipe.load_lora_weights(files["A"], adapter_name="served")
    rows = {"load A (first LoRA)": {"switch_s": time.perf_counter() - t}}
    preheat.torch.compile(pipe, mode="regional", cache="local")
    counters.clear()
    rows["load A (first LoRA)"].update(call_s=run(), frames=counters["frames"].get("total", 0))
    run()
    rows["eager-speed call (compiled, warm)"] = {"call_s": run()}
    held = {name: pipe.lora_state_dict(path) for name, path in files.items() if name in ("A",)}

    def swap(label: str, source) -> None:
        counters.clear()
        t = time.perf_counter()
        try:
            pipe.load_lora_weights(source, adapter_name="served", hotswap=True)
        except Exception as exc:  # noqa: BLE001 - what diffusers / peft refuse is the measurement
            rows[label] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
            return
        switch = time.perf_counter() - t
        rows[label] = {"switch_s": switch, "call_s": run(), "frames": counters["frames"].get("total", 0)}

    swap("B: same targets, rank 2 (file)", files["B"])
    swap("A: same targets, rank 4 (held in memory: LRU hit)", held["A"])
    swap("D: rank 16 > target_rank 8 (file)", files["D"])
    swap("C: one more target module (file)", files["C"])  # last: a failed swap here removes the adapter
    rows["after C failed"] = {"adapters": list(pipe.get_list_adapters().get("transformer", []))}
    result = {"torch": torch.__version__, "rows": rows}
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
