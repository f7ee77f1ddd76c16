"""SDXL, SD3 and FLUX.1 Kontext through ``preheat.load(..., backend="torch", compile="regional")``,
in fresh processes: a cold start compiles the repeated blocks (SDXL: the UNet's BasicTransformerBlock,
declared by diffusers; SD3: the JointTransformerBlock, found; Kontext: diffusers' FluxKontextPipeline
with the Flux transformer's declared blocks, a reference image in every call) and stores them; a warm start
with a fresh Inductor folder (a new pod) compiles nothing and gives the same image."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("diffusers")

from tests._support.torch_models import run_child  # noqa: E402
from tests._support.flow_fixtures import save_tiny_flow_model  # noqa: E402
from tests._support.sd_fixtures import save_tiny_sd  # noqa: E402

# Inductor fuses ops and reorders float32 reductions, so over two steps and the VAE the compiled
# and eager images differ by rounding only: at most one level of 255 where a value sits on a
# rounding edge.
COMPILED_VS_EAGER_LEVELS = 1

_CHILD = r"""
import json, sys
import torch
from torch._dynamo.utils import counters
from tests._support.torch_models import count_cpp_builds
import preheat

folder, flags = sys.argv[1], sys.argv[2:]
call = dict(prompt="a photo of a cat", height=32, width=32, steps=2, seed=0)
if "kontext" in flags:  # an edit of a reference image, kept at its own size
    import numpy as np
    call.update(image=np.random.RandomState(0).randint(0, 256, (32, 32, 3), dtype=np.uint8), image_resize="none")
result = {}
if "eager" in flags:
    result["eager"] = preheat.load(folder, backend="torch").generate(**call).tolist()
builds = count_cpp_builds()
pipe = preheat.load(folder, backend="torch", compile="regional")
counters.clear()
result["image"] = pipe.generate(**call).tolist()
result["layer"] = pipe.last.cache_layer
result["events"] = pipe.compiler.events
result["cpp_builds"] = len(builds)
result["counters"] = {k: dict(v) for k, v in counters.items() if k in ("frames", "aot_autograd", "inductor")}
with torch._dynamo.config.patch(error_on_recompile=True):  # the served signature again: no recompile
    result["served"] = pipe.generate(**{**call, "prompt": "another prompt", "seed": 1}).tolist()
print("RESULT " + json.dumps(result, default=str))
"""


def _child(model: Path, home: Path, inductor_dir: Path, *flags: str) -> dict:
    return run_child(_CHILD, model, home, inductor_dir, *flags)


@pytest.fixture(scope="module", params=["sdxl", "sd3", "flux-kontext"])
def cold(request, tmp_path_factory):
    """Per family: its tiny folder, and process 1 on an empty cache (eager, then regional)."""
    base = tmp_path_factory.mktemp(request.param)
    if request.param == "sdxl":
        folder = save_tiny_sd(base / "model", kind="sdxl")
    elif request.param == "sd3":
        folder = save_tiny_flow_model(base / "model", kind="sd3", t5=False)
    else:
        folder = save_tiny_flow_model(base / "model", kind="flux-kontext")
    return request.param, folder, base, _child(folder, base / "home", base / "inductor", *_flags(request.param, "eager"))


def _flags(kind: str, *flags: str) -> tuple[str, ...]:
    return (*flags, "kontext") if kind == "flux-kontext" else flags


@pytest.mark.slow
def test_cold_then_warm_in_a_fresh_process_compiles_nothing(cold, tmp_path):
    kind, folder, base, first = cold
    regions = {"sdxl": ["BasicTransformerBlock"], "sd3": ["JointTransformerBlock"],
               "flux-kontext": ["FluxTransformerBlock", "FluxSingleTransformerBlock"]}[kind]
    assert first["layer"] == "none" and first["events"][0]["store"] == "written"
    assert first["counters"]["inductor"].get("fxgraph_cache_miss", 0) > 0  # the counters do see compiles
    entries = [p for p in (base / "home" / "compile" / "torch").iterdir() if not p.name.startswith(".")]
    (entry,) = entries
    fields = json.loads((entry / "manifest.json").read_text())["fields"]
    assert fields["compile_options"]["scope"] == "regional" and fields["compile_options"]["regions"] == regions
    image = np.array(first["image"], np.int32)
    assert np.abs(image - np.array(first["eager"], np.int32)).max() <= COMPILED_VS_EAGER_LEVELS

    home = tmp_path / "home"
    shutil.copytree(base / "home", home)
    warm = _child(folder, home, tmp_path / "inductor", *_flags(kind))  # a new process, an empty Inductor folder
    assert warm["layer"] == "mega" and warm["events"][0]["key"] == first["events"][0]["key"]
    counts = warm["counters"]
    assert counts["inductor"].get("fxgraph_cache_miss", 0) == 0, counts
    assert counts["aot_autograd"].get("autograd_cache_miss", 0) == 0, counts
    assert warm["cpp_builds"] == 0
    np.testing.assert_array_equal(np.array(warm["image"], np.int32), image)  # same program, same numbers
    assert np.array(warm["served"]).shape == image.shape
