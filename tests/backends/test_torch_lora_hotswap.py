"""LoRA hot-swap on the torch side (issue 15, item 5): diffusers' ``load_lora_weights`` with
``enable_lora_hotswap`` under ``preheat.torch.compile`` (regional). A second LoRA with the same
targets (and a rank no higher than ``target_rank``) is copied into the compiled blocks' LoRA
tensors: no new Dynamo frame, and the image is diffusers' eager image with that LoRA.
(Recompile behaviour and switch times: docs/benchmarks.md, "Issue 14, round 2".)"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")
pytest.importorskip("peft")

import preheat.torch  # noqa: E402
from tests._support.flow_fixtures import reference_pipeline, save_tiny_flow_model  # noqa: E402
from tests._support.lora_files import peft_layers, save_lora  # noqa: E402  (the LoRA files of issue 15's tests)

# Inside the repeated blocks only: what regional compilation traces.
TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "proj_mlp", "ff.net.2"]
TARGET_RANK = 8
# Compiled vs eager, float images in [0, 1]: Inductor's fusions and reordered float32 reductions,
# plus the hot-swap's tensor (not Python float) LoRA scale; a few 1e-6 in practice.
COMPILED_VS_EAGER_ATOL = 1e-4


@pytest.fixture(scope="module")
def loras(tmp_path_factory):
    base = tmp_path_factory.mktemp("hotswap")
    folder = save_tiny_flow_model(base / "flux", kind="flux-dev")
    ref = reference_pipeline(folder)
    a = save_lora(ref, base / "A", "transformer", {"transformer": peft_layers(ref.transformer, TARGETS, 4, 4, seed=1)})
    b = save_lora(ref, base / "B", "transformer", {"transformer": peft_layers(ref.transformer, TARGETS, 2, 4, seed=2)})
    return folder, a, b


def _run(pipe) -> np.ndarray:
    with torch.no_grad():
        return pipe("a photo of a cat", height=32, width=32, num_inference_steps=2, output_type="np",
                    generator=torch.Generator("cpu").manual_seed(0)).images


@pytest.mark.slow
def test_hotswapping_a_lora_with_the_same_targets_compiles_no_new_frame(loras, tmp_path, monkeypatch):
    from torch._dynamo.utils import counters

    folder, a, b = loras
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    eager = reference_pipeline(folder)
    eager.load_lora_weights(b)
    expected = _run(eager)

    pipe = reference_pipeline(folder)
    pipe.enable_lora_hotswap(target_rank=TARGET_RANK)  # before the first LoRA and before compiling
    pipe.load_lora_weights(a, adapter_name="served")
    preheat.torch.compile(pipe, mode="regional")
    with_a = _run(pipe)  # compiles the blocks (LoRA A inside)
    counters.clear()
    pipe.load_lora_weights(b, adapter_name="served", hotswap=True)  # rank 2 < 8: padded, same graph
    with torch._dynamo.config.patch(error_on_recompile=True):
        with_b = _run(pipe)
    assert counters["frames"].get("total", 0) == 0, dict(counters["frames"])
    np.testing.assert_allclose(with_b, expected, atol=COMPILED_VS_EAGER_ATOL, rtol=0)
    assert np.abs(with_b - with_a).max() > 1e-3  # the swap did change the image
