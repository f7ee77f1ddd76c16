"""GGUF Q8_0 FLUX.1 transformers (issue 28 item 3), as city96's FLUX GGUFs lay them out: BFL's
transformer keys, 2-D weights in Q8_0 (blocks of 32 int8 with one float16 scale), the rest F32/F16.

A tiny random FLUX.1-dev folder's transformer is written as such a file by the test (``gguf``'s
own writer and Q8_0 quantiser); preheat's image from ``preheat.load(file, config=folder)`` is
diffusers' image with ``FluxTransformer2DModel.from_single_file(file, GGUFQuantizationConfig(
compute_dtype=float32))`` in the folder's pipeline. The Q8_0 weights stay int8 + float16 on the
device (``quantised.Quantised``), and any other quantisation type is one line."""

from __future__ import annotations

import numpy as np
import pytest

import preheat
from preheat.errors import CheckpointMismatchError, InvalidArgumentError, ModelFormatError
from tests._support import flow_fixtures
from tests._support.bfl_files import to_bfl
from tests._support.gguf_files import write_gguf
from tests._support.single_files import diffusers_bfl_at_tiny_widths

gguf = pytest.importorskip("gguf")

MEAN_TOL = 1.0  # mean |pixel difference| <= 1 level of 255
PROMPT, STEPS, GUIDANCE = "a watercolor fox", 3, 3.5


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from safetensors.numpy import load_file

    base = tmp_path_factory.mktemp("gguf")
    folder = flow_fixtures.save_tiny_flow_model(base / "flux-dev", "flux-dev")
    bfl = to_bfl(load_file(str(folder / "transformer" / "diffusion_pytorch_model.safetensors")))
    out = {"folder": folder, "q8": base / "flux-dev-Q8_0.gguf", "q4": base / "flux-dev-Q4_0.gguf"}
    out["types"] = write_gguf(out["q8"], bfl, gguf.GGMLQuantizationType.Q8_0)
    write_gguf(out["q4"], bfl, gguf.GGMLQuantizationType.Q4_0)
    return out


@pytest.fixture(scope="module")
def pipe(files, tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PREHEAT_HOME", str(tmp_path_factory.mktemp("home")))  # the converted folder's root
        return preheat.load(files["q8"], config=files["folder"], cache="off")


def _noise() -> np.ndarray:
    return np.random.default_rng(3).standard_normal((1, 4, 16, 16)).astype(np.float32)


def test_a_q8_0_flux_transformer_draws_diffusers_gguf_image(files, pipe, monkeypatch, record_property):
    import torch
    from diffusers import FluxTransformer2DModel, GGUFQuantizationConfig

    assert list(files["types"].values()).count("Q8_0") > 10
    ref = flow_fixtures.reference_pipeline(files["folder"], "flow_euler")
    with diffusers_bfl_at_tiny_widths(files["folder"], monkeypatch):
        ref.transformer = FluxTransformer2DModel.from_single_file(
            str(files["q8"]), quantization_config=GGUFQuantizationConfig(compute_dtype=torch.float32),
            config=str(files["folder"]), subfolder="transformer", torch_dtype=torch.float32)
    theirs = flow_fixtures.reference_pixels(ref, PROMPT, _noise(), num_inference_steps=STEPS, guidance_scale=GUIDANCE)
    ours = pipe.generate(PROMPT, noise=_noise(), steps=STEPS, sampler="flow_euler", guidance=GUIDANCE,
                         width=32, height=32)
    diff = np.abs(ours.astype(np.int32) - theirs.astype(np.int32))
    record_property("mean_abs_px", float(diff.mean()))
    print(f"GGUF Q8_0 vs diffusers' GGUF quantizer: mean |Δpx| {diff.mean():.4f}, max {diff.max()}")
    assert diff.mean() <= MEAN_TOL and ours.std() > 5


def test_q8_0_weights_stay_int8_with_their_block_scales(files, pipe, record_property):
    """Each Q8_0 weight is its int8 values and float16 block scales on the device (transposed with
    the kernel): the denoiser's bytes are 1 per element plus 2 per 32, the rest as stored, cast."""
    from flax import nnx

    from preheat.models.gguf_file import GGUFTensors, split_q8_0
    from preheat.models.quantised import Quantised
    from preheat.models.storage import device_bytes

    leaves = {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(pipe.params)}
    kept = {k: v for k, v in leaves.items() if isinstance(v, Quantised)}
    assert len(kept) > 10
    for key, q in kept.items():
        assert q.values.dtype == np.int8 and q.scale.dtype == np.float16, key
        assert q.scale.shape == (q.shape[0] // 32, q.shape[1]), key  # (in / 32, out): blocks along in
    q = kept["transformer_blocks.0.ff.net.2.kernel"]  # BFL's double_blocks.0.img_mlp.2, one to one
    reader = gguf.GGUFReader(str(files["q8"]))
    raw = next(t for t in reader.tensors if t.name == "double_blocks.0.img_mlp.2.weight")
    values, scales = split_q8_0(raw.data, tuple(reversed(raw.shape.tolist())))
    np.testing.assert_array_equal(np.asarray(q.values).T, values)
    np.testing.assert_array_equal(np.asarray(q.scale).T, scales)
    # and the bytes the file holds are exactly gguf's own dequantisation of them
    np.testing.assert_array_equal(values.astype(np.float32) * np.repeat(scales.astype(np.float32), 32, axis=1),
                                  gguf.quants.dequantize(raw.data, raw.tensor_type))
    elements = sum(int(np.prod(q.shape)) for q in kept.values())
    rest = device_bytes(pipe.params) - sum(q.nbytes for q in kept.values())
    assert sum(q.nbytes for q in kept.values()) == elements + 2 * elements // 32
    record_property("device_bytes", device_bytes(pipe.params))
    print(f"denoiser on the device: {device_bytes(pipe.params)} B ({elements + 2 * elements // 32} B of Q8_0 "
          f"weights, {rest} B of float32 rest)")
    q8 = [k for k, t in files["types"].items() if t == "Q8_0"]  # the reader adds a scale per Q8_0 weight
    scales = [k[:-len("weight")] + "scale_weight" for k in q8]
    assert sorted(GGUFTensors(files["q8"])) == sorted([*files["types"], *scales])


def test_fp8_storage_of_a_q8_0_file_keeps_q8_0_and_dequantises_the_full_precision_layers(files, pipe, tmp_path,
                                                                                          monkeypatch):
    """weights_dtype=float8_e4m3fn: the Q8_0 layers of its set stay Q8_0 (a cast to fp8 would only
    lose precision), the Q8_0 layers it keeps at full precision (the AdaLN modulation) are
    dequantised on the host with the same float32 products; the file's one F16 weight in the set
    (``img_in``, 16 wide: no Q8_0 blocks) is cast to fp8 like any full-precision weight."""
    from flax import nnx

    from preheat.models.quantised import Quantised

    monkeypatch.setenv("PREHEAT_HOME", str(tmp_path / "home"))
    low = preheat.load(files["q8"], config=files["folder"], cache="off", weights_dtype="float8_e4m3fn")
    leaves = {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(low.params)}
    assert isinstance(leaves["transformer_blocks.0.attn.to_q.kernel"], Quantised)
    assert leaves["transformer_blocks.0.norm1.linear.kernel"].dtype == np.float32
    call = dict(noise=_noise(), steps=STEPS, sampler="flow_euler", guidance=GUIDANCE, width=32, height=32)
    assert leaves["x_embedder.kernel"].dtype == np.dtype("float8_e4m3fn")
    diff = np.abs(low.generate(PROMPT, **call).astype(np.int32) - pipe.generate(PROMPT, **call).astype(np.int32))
    print(f"GGUF Q8_0 with weights_dtype=float8_e4m3fn vs without: mean |Δpx| {diff.mean():.4f}")
    assert diff.mean() <= MEAN_TOL


def test_another_quantisation_type_is_one_line(files, tmp_path, monkeypatch):
    monkeypatch.setenv("PREHEAT_HOME", str(tmp_path / "home"))
    with pytest.raises(ModelFormatError) as exc:
        preheat.load(files["q4"], config=files["folder"], cache="off")
    message = str(exc.value)
    assert "\n" not in message and "is GGUF type Q4_0" in message and "F32, F16, BF16, Q8_0" in message
    assert not isinstance(exc.value, CheckpointMismatchError)


def test_a_file_that_is_not_gguf_is_one_line(files, tmp_path, monkeypatch):
    monkeypatch.setenv("PREHEAT_HOME", str(tmp_path / "home"))
    bad = tmp_path / "torn.gguf"
    bad.write_bytes(files["q8"].read_bytes()[:200])
    with pytest.raises(ModelFormatError, match="cannot read .*torn.gguf as GGUF") as exc:
        preheat.load(bad, config=files["folder"], cache="off")
    assert "\n" not in str(exc.value)


def test_a_gguf_file_without_config_is_one_line(files, tmp_path, monkeypatch):
    from preheat.errors import InvalidArgumentError

    monkeypatch.setenv("PREHEAT_HOME", str(tmp_path / "home"))
    with pytest.raises(InvalidArgumentError, match="is a GGUF file .*pass config=") as exc:
        preheat.load(files["q8"], cache="off")
    assert "\n" not in str(exc.value) and exc.value.argument == "config"


def test_without_the_gguf_extra_it_is_one_line(files, monkeypatch):
    import sys

    from preheat.errors import MissingExtraError
    from preheat.models.gguf_file import GGUFTensors

    monkeypatch.setitem(sys.modules, "gguf", None)  # as if the package were not installed
    with pytest.raises(MissingExtraError, match=r'GGUF file .* needs the gguf extra: pip install "\.\[gguf\]"'):
        GGUFTensors(files["q8"])



def test_a_remote_header_read_without_the_gguf_extra_stops_at_its_first_read(files, tmp_path, monkeypatch):
    """`pull --dry-run hf://.../file.gguf` grows its Range reads until the header is whole; without
    the gguf extra the header cannot be read, so the first read is the last (the file is then
    listed alone, as `pull` stores it) rather than a ModuleNotFoundError."""
    import sys

    from preheat.file_configs import _header_within

    head = tmp_path / "cut.gguf"
    data = files["q8"].read_bytes()
    head.write_bytes(data[:64] + bytes(len(data) - 64))  # the header cut after 64 bytes, zeros after
    assert not _header_within(head, 64)  # with the extra: more is needed
    monkeypatch.setitem(sys.modules, "gguf", None)  # as if the package were not installed
    assert _header_within(head, 64)

def test_every_supported_type_reads_as_gguf_dequantises_it(tmp_path):
    """F32, F16 and BF16 as they are, Q8_0 as values and scales whose product is gguf's own
    dequantisation, all in torch's axis order."""
    from preheat.models.gguf_file import GGUFTensors

    rng = np.random.default_rng(0)
    tensors = {"a.weight": rng.standard_normal((3, 64)).astype(np.float32), "b.bias": rng.standard_normal(5)}
    path, kinds = tmp_path / "types.gguf", {"a.weight": "Q8_0", "b.bias": "F32", "c.weight": "F16", "d.weight": "BF16"}
    writer = gguf.GGUFWriter(str(path), arch="flux")
    q8, bf16 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.BF16
    writer.add_tensor("a.weight", gguf.quants.quantize(tensors["a.weight"], q8), raw_dtype=q8)
    writer.add_tensor("b.bias", tensors["b.bias"].astype(np.float32))
    writer.add_tensor("c.weight", tensors["a.weight"][:, :5].astype(np.float16))
    writer.add_tensor("d.weight", gguf.quants.quantize(tensors["a.weight"][:2], bf16), raw_dtype=bf16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    read = GGUFTensors(path)
    raw = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    assert {k: raw[k].tensor_type.name for k in kinds} == kinds
    for key in kinds:
        want = gguf.quants.dequantize(raw[key].data, raw[key].tensor_type)
        if key == "a.weight":
            assert read[key].dtype == np.int8 and read["a.scale_weight"].dtype == np.float16
            got = read[key].astype(np.float32) * np.repeat(read["a.scale_weight"].astype(np.float32), 32, axis=1)
        else:
            got = read[key].astype(np.float32)
        assert got.shape == want.shape == tuple(reversed(raw[key].shape.tolist()))
        np.testing.assert_array_equal(got, want, err_msg=key)


def test_a_gguf_file_of_a_hub_repository_loads_by_its_hf_path(files, pipe, tmp_path, monkeypatch):
    """``hf://org/repo/path/file.gguf`` is one file of the repository, fetched through the store from
    the stand-in Hub (only that file's bytes), then read as the local file is: the same image.
    ``preheat pull --dry-run`` lists exactly it, reading its header alone (the tiny file is no
    published model: nothing else is listed)."""
    from click.testing import CliRunner

    from preheat import file_configs
    from preheat.cli.pull import pull_command
    from tests._support.hub_server import FakeHub, pointed_at

    monkeypatch.setenv("PREHEAT_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(file_configs, "_FIRST_READ", 256)  # the tiny file is under the first read's 1 MiB
    body = files["q8"].read_bytes()
    repo = {"README.md": b"# tiny", "flux1-dev-Q8_0.gguf": body, "q4/flux1-dev-Q4_0.gguf": files["q4"].read_bytes()}
    hub = FakeHub("example/tiny-flux-gguf", repo).start()
    try:
        pointed_at(monkeypatch, hub.base)
        out = CliRunner().invoke(pull_command, ["hf://example/tiny-flux-gguf/flux1-dev-Q8_0.gguf", "--dry-run"])
        assert out.exit_code == 0, out.output
        lines = out.output.splitlines()
        assert lines[0] == "hf://example/tiny-flux-gguf/flux1-dev-Q8_0.gguf is one file of hf://example/tiny-flux-gguf; " \
                           "a pull fetches:"
        assert lines[1].split() == [f"{len(body):,d}", "flux1-dev-Q8_0.gguf"] and "total: 1 files" in lines[2]
        assert len(lines) == 3  # no published model: nothing it lacks is listed
        assert set(hub.downloaded()) == {"flux1-dev-Q8_0.gguf"}  # its header read, not its tensors
        assert hub.downloaded()["flux1-dev-Q8_0.gguf"] < len(body) // 4
        hub.hits.clear()

        call = dict(noise=_noise(), steps=STEPS, sampler="flow_euler", guidance=GUIDANCE, width=32, height=32)
        remote = preheat.load("hf://example/tiny-flux-gguf/flux1-dev-Q8_0.gguf", config=files["folder"], cache="off")
        assert hub.downloaded() == {"flux1-dev-Q8_0.gguf": len(body)}  # that one file, not its neighbours
        np.testing.assert_array_equal(remote.generate(PROMPT, **call), pipe.generate(PROMPT, **call))
        with pytest.raises(ModelFormatError, match="is GGUF type Q4_0"):  # a file in a folder of the repository
            preheat.load("hf://example/tiny-flux-gguf/q4/flux1-dev-Q4_0.gguf", config=files["folder"], cache="off")
        with pytest.raises(InvalidArgumentError, match="is a GGUF file .*pass config="):
            preheat.load("hf://example/tiny-flux-gguf/flux1-dev-Q8_0.gguf", cache="off")
    finally:
        hub.stop()
