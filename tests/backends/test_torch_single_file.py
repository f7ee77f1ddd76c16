"""The torch backend on single files (``load_torch_pipeline(file, config=...)``): the file is converted
once into the diffusers folder the JAX engine reads (``preheat.file_configs.converted_folder``), and
diffusers' ``from_pretrained`` loads that folder. The reference is diffusers' own pipeline on the
tiny folder the file was written from (``from_pretrained``), with the same latents, which draws the
same pixels exactly (the conversion renames and slices tensors, never rounds them). The files are
written by the tests' own inverse tables (``tests/_support``), which ``tests/models/test_single_file*``
prove real with diffusers' ``from_single_file``.
"""

from __future__ import annotations

import numpy as np
import pytest

import preheat
from preheat.errors import ModelFormatError, UnsupportedConfigError
from tests._support import flow_fixtures, sd_fixtures
from tests._support.bfl_files import to_bfl
from tests._support.ldm_files import to_original
from tests._support.numerics import px_diff
from tests._support.single_files import mmdit_file
from tests._support.compare_children import ChildStarted, stop_at_children

PROMPT = "a lighthouse at dusk"
# kind -> (fixture that writes the folder, its sampler, guidance)
CASES = {"sd1": ("ddim", 5.0), "sdxl": ("euler", 5.0), "flux-dev": ("flow_euler", 3.5), "sd3": ("flow_euler", 5.0)}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """{kind: (folder, single file)}: SD 1.x in the LDM layout, SDXL in the SGM layout, a FLUX.1-dev
    transformer in BFL's, an SD3 transformer in Stability's MMDiT names (the last two read the rest
    from the folder)."""
    from safetensors.numpy import load_file, save_file

    base = tmp_path_factory.mktemp("torch-single")
    out = {}
    folder = sd_fixtures.save_tiny_sd(base / "sd1", kind="sd1")
    out["sd1"] = (folder, base / "tiny-sd1-ldm.safetensors")
    save_file(to_original(folder, "sd1"), str(out["sd1"][1]))
    folder = sd_fixtures.save_tiny_sd(base / "sdxl", kind="sdxl")
    out["sdxl"] = (folder, base / "tiny-sdxl-sgm.safetensors")
    save_file(to_original(folder, "sdxl"), str(out["sdxl"][1]))
    folder = flow_fixtures.save_tiny_flow_model(base / "flux-dev", "flux-dev")
    out["flux-dev"] = (folder, base / "flux1-tiny.safetensors")
    save_file(to_bfl(load_file(str(folder / "transformer" / "diffusion_pytorch_model.safetensors"))),
              str(out["flux-dev"][1]))
    folder = flow_fixtures.save_tiny_flow_model(base / "sd3", "sd3")
    out["sd3"] = (folder, base / "sd3-tiny.safetensors")
    save_file(mmdit_file(folder), str(out["sd3"][1]))
    return out


def _noise() -> np.ndarray:
    return np.random.default_rng(3).standard_normal((1, 4, 16, 16)).astype(np.float32)


def _reference(kind: str, folder) -> np.ndarray:
    """diffusers' image from the folder the file was written from."""
    sampler, guidance = CASES[kind]
    fixtures = sd_fixtures if kind in ("sd1", "sdxl") else flow_fixtures
    call = dict(num_inference_steps=3, guidance_scale=guidance)
    if fixtures is sd_fixtures:
        call.update(height=32, width=32)
    return fixtures.reference_pixels(fixtures.reference_pipeline(folder, sampler), PROMPT, _noise(), **call)


@pytest.mark.parametrize("kind", sorted(CASES))
def test_torch_backend_draws_the_folder_s_image_from_its_single_file(files, kind, tmp_path, monkeypatch,
                                                                     record_property):
    folder, path = files[kind]
    sampler, guidance = CASES[kind]
    monkeypatch.setenv("PREHEAT_HOME", str(tmp_path / "home"))
    theirs = _reference(kind, folder)

    pipe = preheat.load(path, backend="torch", config=folder)
    ours = pipe.generate(PROMPT, noise=_noise(), steps=3, sampler=sampler, guidance=guidance, width=32, height=32)
    diff = px_diff(ours, theirs)
    record_property("mean_abs_px", float(diff.mean()))
    print(f"{kind}: torch backend on the single file vs diffusers on the folder: mean |Δpx| {diff.mean():.4f}, "
          f"max {diff.max()}")
    # exact: the same diffusers code on the same float32 tensors (renamed, sliced, never rounded)
    assert np.array_equal(ours, theirs), (diff.mean(), diff.max())
    assert ours.std() > 5  # an image, not a flat field

    # one conversion, whichever backend asks: the JAX engine reads the same folder
    (converted,) = (tmp_path / "home" / "models" / "single").iterdir()
    jax_pipe = preheat.load(path, config=folder, cache="off")
    assert list((tmp_path / "home" / "models" / "single").iterdir()) == [converted]
    assert jax_pipe.family.name == pipe.family.name


def test_cli_sample_takes_a_single_file_with_backend_torch(files, tmp_path, monkeypatch):
    from click.testing import CliRunner
    from PIL import Image

    from preheat.cli import main

    folder, path = files["sd1"]
    monkeypatch.setenv("PREHEAT_HOME", str(tmp_path / "home"))
    want = preheat.load(path, backend="torch", config=folder).generate(PROMPT, steps=2, seed=3, width=32, height=32)
    out = tmp_path / "fox.png"
    result = CliRunner().invoke(main, ["sample", str(path), "--config", str(folder), "--backend", "torch",
                                       "--prompt", PROMPT, "--steps", "2", "--seed", "3", "--width", "32",
                                       "--height", "32", "--out", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    got = np.asarray(Image.open(out).convert("RGB"))
    step = got.shape[0] // 32
    np.testing.assert_array_equal(got[::step, ::step], want[0])


def test_serve_and_bench_compare_take_a_single_file_for_the_torch_backend(files, tmp_path, monkeypatch):
    """`serve --backend torch --config` loads the file's pipeline; `bench compare FILE --config` converts
    it once, in the parent, and every path's child loads that folder (no path converts on its own)."""
    from click.testing import CliRunner

    from preheat.bench import compare
    from preheat.cli.bench import compare_command
    from preheat.server.config import CoreConfig, load_pipeline

    folder, path = files["sd1"]
    monkeypatch.setenv("PREHEAT_HOME", str(tmp_path / "home"))
    want = _reference("sd1", folder)
    served = load_pipeline(CoreConfig(model=str(path), config=str(folder), backend="torch"))
    assert np.array_equal(served.generate(PROMPT, noise=_noise(), steps=3, sampler="ddim", guidance=5.0, width=32,
                                          height=32), want)

    specs = stop_at_children(monkeypatch)
    r = CliRunner().invoke(compare_command, [str(path), "--config", str(folder), "--quick", "--paths",
                                             "jax,torch-eager", "--keep", str(tmp_path / "work"), "--prompt", PROMPT])
    assert isinstance(r.exception, ChildStarted), r.output
    (converted,) = (tmp_path / "home" / "models" / "single").iterdir()  # the one conversion serve made too
    assert specs[-1]["model"] == str(converted)
    pipe = compare._load_pipe({**specs[-1], "path": "torch-eager"})  # what the torch child loads
    assert np.array_equal(pipe.generate(PROMPT, noise=_noise(), steps=3, sampler="ddim", guidance=5.0, width=32,
                                        height=32), want)


def test_scaled_fp8_and_torn_gguf_files_are_one_line_for_the_torch_backend(files, tmp_path, monkeypatch):
    """A scaled fp8 file converts to fp8 weights beside their scales, which diffusers' loader would
    take as the weights (diffusers has no loader for ComfyUI's scaled files): refused before
    anything is converted, naming the file and the way out. A torn GGUF file is one line too."""
    from safetensors.numpy import load_file, save_file

    folder, path = files["flux-dev"]
    monkeypatch.setenv("PREHEAT_HOME", str(tmp_path / "home"))
    tensors = load_file(str(path))
    weight = "double_blocks.0.img_attn.proj.weight"
    scale = np.float32(np.abs(tensors[weight]).max() / 448)
    tensors[weight] = (tensors[weight] / scale).astype(np.float32)  # stored as float32 here; the scale is the point
    tensors["double_blocks.0.img_attn.proj.scale_weight"] = np.array(scale, np.float32)
    tensors["scaled_fp8"] = np.zeros((0,), np.float32)
    scaled = tmp_path / "flux1-scaled.safetensors"
    save_file(tensors, str(scaled))
    with pytest.raises(UnsupportedConfigError, match=r"flux1-scaled\.safetensors is a scaled fp8 file \(1 weights "
                                                     r"beside their scale_weight\); the torch backend reads .*jax") as err:
        preheat.load(scaled, backend="torch", config=folder)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "home" / "models" / "single").exists()  # nothing converted
    from click.testing import CliRunner

    from preheat.cli.bench import compare_command

    r = CliRunner().invoke(compare_command, [str(scaled), "--config", str(folder), "--quick", "--paths", "jax,torch-eager",
                                             "--keep", str(tmp_path / "work")])
    assert r.exit_code != 0 and "is a scaled fp8 file" in r.output and len(r.output.strip().splitlines()) == 1, r.output

    gguf = tmp_path / "flux1-tiny-Q8_0.gguf"
    gguf.write_bytes(b"GGUF" + bytes(64))  # a torn GGUF (tests/backends/test_torch_gguf.py reads real ones)
    with pytest.raises(ModelFormatError, match=r"cannot read .*flux1-tiny-Q8_0\.gguf as GGUF") as err:
        preheat.load(gguf, backend="torch", config=folder)
    assert "\n" not in str(err.value)
