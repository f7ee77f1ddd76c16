"""GGUF transformer files on the torch backend, read as diffusers users read them:
``FluxTransformer2DModel.from_single_file(file, quantization_config=GGUFQuantizationConfig(...),
config=folder)`` for the denoiser, the config folder for the rest (``preheat.file_configs.gguf_source``).

The files are tiny random FLUX.1-dev transformers in city96's layout, written by ``gguf``'s own
writer and quantiser (``tests/_support/gguf_files.py``). The reference is diffusers' own GGUF load of
the same file in the folder's pipeline, with the same latents: the same code on the same tensors,
so the same pixels exactly. Against the JAX engine (which keeps Q8_0 as int8 + scales and expands
them in its own program) the bound is the team's cross-framework one, mean |Δ| <= 1 level.

diffusers' BFL conversion cuts a single block's ``linear1`` at FLUX.1's full widths, so every
diffusers load here runs inside ``diffusers_bfl_at_tiny_widths`` (the tiny widths for that one cut).
"""

from __future__ import annotations

import numpy as np
import pytest

import preheat
from preheat.errors import UnsupportedConfigError
from tests._support import flow_fixtures
from tests._support.bfl_files import to_bfl
from tests._support.gguf_files import write_gguf
from tests._support.numerics import px_diff
from tests._support.single_files import diffusers_bfl_at_tiny_widths
from tests._support.compare_children import ChildStarted, stop_at_children

gguf = pytest.importorskip("gguf")

MEAN_TOL = 1.0  # mean |pixel difference| <= 1 level of 255, across frameworks
PROMPT, STEPS, GUIDANCE = "a watercolor fox", 3, 3.5
CALL = dict(steps=STEPS, sampler="flow_euler", guidance=GUIDANCE, width=32, height=32)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The tiny FLUX.1-dev folder and its transformer as Q8_0 and Q4_0 GGUF files."""
    from safetensors.numpy import load_file

    base = tmp_path_factory.mktemp("torch-gguf")
    folder = flow_fixtures.save_tiny_flow_model(base / "flux-dev", "flux-dev")
    bfl = to_bfl(load_file(str(folder / "transformer" / "diffusion_pytorch_model.safetensors")))
    out = {"folder": folder}
    for quant in ("Q8_0", "Q4_0"):
        out[quant] = base / f"flux1-tiny-{quant}.gguf"
        types = write_gguf(out[quant], bfl, gguf.GGMLQuantizationType[quant])
        assert list(types.values()).count(quant) > 10
    return out


def _noise() -> np.ndarray:
    return np.random.default_rng(3).standard_normal((1, 4, 16, 16)).astype(np.float32)


def _diffusers_gguf(folder, path) -> np.ndarray:
    """diffusers' image: its GGUF load of ``path`` in the folder's pipeline (float32 compute)."""
    import torch
    from diffusers import FluxTransformer2DModel, GGUFQuantizationConfig

    ref = flow_fixtures.reference_pipeline(folder, "flow_euler")
    ref.transformer = FluxTransformer2DModel.from_single_file(
        str(path), quantization_config=GGUFQuantizationConfig(compute_dtype=torch.float32),
        config=str(folder), subfolder="transformer", torch_dtype=torch.float32)
    return flow_fixtures.reference_pixels(ref, PROMPT, _noise(), num_inference_steps=STEPS, guidance_scale=GUIDANCE)


@pytest.mark.parametrize("quant", ["Q8_0", "Q4_0"])
def test_torch_backend_draws_diffusers_gguf_image(files, quant, tmp_path, monkeypatch, record_property):
    monkeypatch.setenv("PREHEAT_HOME", str(tmp_path / "home"))
    folder, path = files["folder"], files[quant]
    with diffusers_bfl_at_tiny_widths(folder, monkeypatch):
        theirs = _diffusers_gguf(folder, path)
        pipe = preheat.load(path, backend="torch", config=folder)
    ours = pipe.generate(PROMPT, noise=_noise(), **CALL)
    diff = px_diff(ours, theirs)
    record_property("mean_abs_px", float(diff.mean()))
    print(f"{quant}: torch backend vs diffusers' GGUF load: mean |Δpx| {diff.mean():.4f}, max {diff.max()}")
    assert np.array_equal(ours, theirs), (diff.mean(), diff.max())  # the same diffusers code on the same tensors
    assert ours.std() > 5  # an image, not a flat field
    weight = pipe.pipe.transformer.transformer_blocks[0].attn.to_q.weight
    assert getattr(weight, "quant_type", None) == gguf.GGMLQuantizationType[quant]  # kept quantised
    assert not (tmp_path / "home" / "models" / "single").exists()  # read from the file: nothing converted

    if quant == "Q8_0":  # the JAX engine reads Q8_0 (its own conversion, int8 + scales on the device)
        jax_image = preheat.load(path, config=folder, cache="off").generate(PROMPT, noise=_noise(), **CALL)
        cross = px_diff(jax_image, ours)
        record_property("jax_vs_torch_mean_abs_px", float(cross.mean()))
        print(f"{quant}: JAX vs torch backend on the GGUF file: mean |Δpx| {cross.mean():.4f}, max {cross.max()}")
        assert cross.mean() <= MEAN_TOL


def test_sample_serve_and_bench_compare_take_a_gguf_file_for_the_torch_backend(files, tmp_path, monkeypatch):
    """`sample --backend torch`, `serve --backend torch` and `bench compare FILE.gguf --config` read
    the file the same way: the torch paths' children get the file and its config folder (no
    conversion for them), the JAX path the converted folder, made once in the parent."""
    from click.testing import CliRunner
    from PIL import Image

    from preheat.bench import compare
    from preheat.cli import main
    from preheat.cli.bench import compare_command
    from preheat.server.config import CoreConfig, load_pipeline

    folder, path = files["folder"], files["Q8_0"]
    monkeypatch.setenv("PREHEAT_HOME", str(tmp_path / "home"))
    with diffusers_bfl_at_tiny_widths(folder, monkeypatch):
        want = preheat.load(path, backend="torch", config=folder).generate(PROMPT, seed=3, **CALL)
        out = tmp_path / "fox.png"
        result = CliRunner().invoke(main, ["sample", str(path), "--config", str(folder), "--backend", "torch",
                                           "--prompt", PROMPT, "--steps", str(STEPS), "--sampler", "flow_euler",
                                           "--guidance", str(GUIDANCE), "--seed", "3", "--width", "32",
                                           "--height", "32", "--out", str(out), "--quiet"])
        assert result.exit_code == 0, result.output
        got = np.asarray(Image.open(out).convert("RGB"))
        step = got.shape[0] // 32
        np.testing.assert_array_equal(got[::step, ::step], want[0])

        served = load_pipeline(CoreConfig(model=str(path), config=str(folder), backend="torch"))
        assert np.array_equal(served.generate(PROMPT, seed=3, **CALL), want)

        specs = stop_at_children(monkeypatch)
        r = CliRunner().invoke(compare_command, [str(path), "--config", str(folder), "--quick", "--paths",
                                                 "torch-eager", "--keep", str(tmp_path / "work"), "--prompt", PROMPT])
        assert isinstance(r.exception, ChildStarted), r.output
        assert specs.pop()["config"] == str(folder)
        assert not (tmp_path / "home" / "models" / "single").exists()  # torch paths alone: nothing converted
        for order in ("jax,torch-eager", "torch-eager,jax"):  # each run stops at its first child
            r = CliRunner().invoke(compare_command, [str(path), "--config", str(folder), "--quick", "--paths", order,
                                                     "--keep", str(tmp_path / "work"), "--prompt", PROMPT])
            assert isinstance(r.exception, ChildStarted), r.output
        (converted,) = (tmp_path / "home" / "models" / "single").iterdir()  # the JAX path's, made in the parent
        by_path = {s["path"]: s for s in specs}
        assert by_path["jax"]["model"] == str(converted) and "config" not in by_path["jax"]
        assert by_path["torch-eager"]["model"] == str(path) and by_path["torch-eager"]["config"] == str(folder)
        pipe = compare._load_pipe(by_path["torch-eager"])  # what the torch child loads
    assert np.array_equal(pipe.generate(PROMPT, seed=3, **CALL), want)


def test_a_gguf_type_diffusers_cannot_dequantise_is_one_line(files, tmp_path, monkeypatch):
    """A tensor in a GGML type diffusers' GGUF loader has no dequantiser for (Q8_1 here) is refused
    from the header, naming the tensor and the type, before anything is pulled or loaded; so is it
    by `bench compare` before any child starts."""
    from click.testing import CliRunner

    from preheat.cli.bench import compare_command

    monkeypatch.setenv("PREHEAT_HOME", str(tmp_path / "home"))
    q81 = gguf.GGMLQuantizationType.Q8_1
    block, size = gguf.GGML_QUANT_SIZES[q81]
    path = tmp_path / "flux1-tiny-Q8_1.gguf"
    writer = gguf.GGUFWriter(str(path), arch="flux")
    writer.add_tensor("double_blocks.0.img_attn.qkv.weight", np.zeros((96, 64 // block * size), np.uint8),
                      raw_dtype=q81)  # the bytes of a (96, 64) Q8_1 weight
    writer.add_tensor("img_in.bias", np.zeros(32, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedConfigError, match=r"flux1-tiny-Q8_1\.gguf: double_blocks\.0\.img_attn\.qkv\.weight "
                                                     r"is GGUF type Q8_1, which diffusers' GGUF loader .* cannot "
                                                     r"dequantise; it reads .*Q4_K") as err:
        preheat.load(path, backend="torch", config=files["folder"])
    assert "\n" not in str(err.value)
    r = CliRunner().invoke(compare_command, [str(path), "--config", str(files["folder"]), "--quick", "--paths",
                                             "jax,torch-eager", "--keep", str(tmp_path / "work")])
    assert r.exit_code != 0 and "is GGUF type Q8_1" in r.output and len(r.output.strip().splitlines()) == 1, r.output


# Inductor fuses ops and reorders float32 reductions: over the steps and the VAE the compiled and
# eager images differ by rounding only (measured on this file: mean 0.0075-0.0085 levels for inductor,
# 0.0000-0.0020 for regional; max 1), as tests/backends/test_torch_text_regional.py bounds it.
COMPILED_VS_EAGER_LEVELS = 1


@pytest.mark.slow  # each torch.compile of the tiny transformer: 35-90 s on a loaded 2-core CPU
@pytest.mark.parametrize("mode", ["inductor", "regional"])
def test_a_compiled_gguf_transformer_draws_the_eager_image(files, mode, tmp_path, monkeypatch, record_property):
    """``compile="inductor"`` and ``"regional"`` trace diffusers' GGUF Linear as it runs (each
    weight dequantised where it is used): the weights stay quantised and the image is the eager
    torch backend's on the same file, to a level of 255."""
    monkeypatch.setenv("PREHEAT_HOME", str(tmp_path / "home"))
    folder, path = files["folder"], files["Q8_0"]
    with diffusers_bfl_at_tiny_widths(folder, monkeypatch):
        eager = preheat.load(path, backend="torch", config=folder).generate(PROMPT, noise=_noise(), **CALL)
        pipe = preheat.load(path, backend="torch", config=folder, compile=mode)
        ours = pipe.generate(PROMPT, noise=_noise(), **CALL)
    diff = px_diff(ours, eager)
    record_property("mean_abs_px", float(diff.mean()))
    print(f"{mode}: compiled vs eager torch GGUF: mean |Δpx| {diff.mean():.4f}, max {diff.max()}")
    assert diff.max() <= COMPILED_VS_EAGER_LEVELS and ours.std() > 5
    assert pipe.last.compile_s > 0  # compiled in this call, not run eagerly
    weight = pipe.pipe.transformer.transformer_blocks[0].attn.to_q.weight
    assert getattr(weight, "quant_type", None) == gguf.GGMLQuantizationType.Q8_0  # still quantised


def test_compile_aot_of_a_gguf_file_is_one_line(files, tmp_path, monkeypatch):
    """``compile="aot"`` exports the blocks with torch.export, which takes each GGUF weight as a plain
    tensor of its packed bytes (the first call failed inside the export on a shape): refused at load,
    in one line naming why and what works, before anything is pulled; `bench compare --paths
    torch-aot` likewise, before any child starts."""
    from click.testing import CliRunner

    from preheat.cli.bench import compare_command

    monkeypatch.setenv("PREHEAT_HOME", str(tmp_path / "home"))
    with pytest.raises(UnsupportedConfigError, match=r"flux1-tiny-Q8_0\.gguf is a GGUF file: compile='aot' cannot "
                                                     r"export its quantised weights .*use compile='regional' or "
                                                     r"'inductor'") as err:
        preheat.load(files["Q8_0"], backend="torch", compile="aot")  # no config: nothing pulled either
    assert "\n" not in str(err.value)
    specs = stop_at_children(monkeypatch)
    r = CliRunner().invoke(compare_command, [str(files["Q8_0"]), "--config", str(files["folder"]), "--quick",
                                             "--paths", "jax,torch-aot", "--keep", str(tmp_path / "work")])
    assert r.exit_code != 0 and "compile='aot' cannot export" in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1 and specs == [], r.output


def test_preheat_torch_compile_aot_of_a_users_gguf_pipeline_is_one_line(files, tmp_path, monkeypatch):
    """A user who loads the transformer with diffusers' own ``from_single_file(...,
    quantization_config=GGUFQuantizationConfig(...))`` and calls ``preheat.torch.compile(pipe,
    mode="aot")`` gets the load's refusal (one line, the working modes named) at the call, not the
    export's shape error at the first image; nothing is installed, so another mode still takes it."""
    import torch
    from diffusers import FluxTransformer2DModel, GGUFQuantizationConfig

    import preheat.torch

    monkeypatch.setenv("PREHEAT_HOME", str(tmp_path / "home"))
    folder = files["folder"]
    with diffusers_bfl_at_tiny_widths(folder, monkeypatch):
        transformer = FluxTransformer2DModel.from_single_file(
            str(files["Q8_0"]), quantization_config=GGUFQuantizationConfig(compute_dtype=torch.float32),
            config=str(folder), subfolder="transformer", torch_dtype=torch.float32)
    pipe = flow_fixtures.reference_pipeline(folder, "flow_euler")
    pipe.transformer = transformer
    for target in (pipe, transformer):
        with pytest.raises(UnsupportedConfigError, match=r"^FluxTransformer2DModel holds GGUF-quantised weights "
                                                         r"\([\w.]+ is Q8_0\): mode='aot' cannot export its quantised "
                                                         r"weights .*; use mode='regional' or 'full'") as err:
            preheat.torch.compile(target, mode="aot")
        assert "\n" not in str(err.value)
    assert not hasattr(transformer, "_preheat_gate") and "forward" not in transformer.__dict__  # nothing installed
    assert preheat.torch.compile(pipe, mode="regional", cache="off") is pipe  # compiled lazily: no call here
