"""GGUF FLUX.1 transformers (issue 28 item 3; the packed types after), as city96's FLUX GGUFs lay
them out: BFL's transformer keys, 2-D weights quantised (Q8_0, or the types deployers ship for
16-24 GB cards: Q4_0, Q4_1, Q5_0, Q5_1, Q2_K..Q6_K, IQ4_NL, IQ4_XS), the rest F32/F16.

A tiny random FLUX.1-dev folder's transformer is written as such a file by the test (``gguf``'s
own writer and quantiser; the K and IQ4 types' blocks by ``tests/_support/gguf_files``); preheat's image
from ``preheat.load(file, config=folder)`` is diffusers' image with
``FluxTransformer2DModel.from_single_file(file, GGUFQuantizationConfig(compute_dtype=float32))``
in the folder's pipeline. The Q8_0 weights stay int8 + float16 on the device
(``quantised.Quantised``), the packed ones their blocks (``quantised.Packed``), and any other
quantisation type is one line.

The packed types' K and IQ4_XS blocks are 256 wide, more than the tiny folder's 32-wide transformer has, so
they use a second transformer (2 heads x 128: in-widths 256, 1024, 1280) in the same folder: one
file mixing every type (one load, one program) runs here; a file per type is ``slow``."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import preheat
from preheat.errors import CheckpointMismatchError, InvalidArgumentError, ModelFormatError
from tests._support import flow_fixtures
from tests._support.bfl_files import to_bfl
from tests._support.gguf_files import write_gguf
from tests._support.numerics import mean_abs_px, px_diff
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
    out = {"folder": folder, "q8": base / "flux-dev-Q8_0.gguf"}
    out["types"] = write_gguf(out["q8"], bfl, gguf.GGMLQuantizationType.Q8_0)
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
    diff = px_diff(ours, theirs)
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
    diff = px_diff(low.generate(PROMPT, **call), pipe.generate(PROMPT, **call))
    print(f"GGUF Q8_0 with weights_dtype=float8_e4m3fn vs without: mean |Δpx| {diff.mean():.4f}")
    assert diff.mean() <= MEAN_TOL


PACKED = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")
FUSED = {"double_blocks.0.img_attn.qkv.weight": ("transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_k",
                                                 "transformer_blocks.0.attn.to_v"),
         "double_blocks.0.txt_attn.qkv.weight": ("transformer_blocks.0.attn.add_q_proj",
                                                 "transformer_blocks.0.attn.add_k_proj",
                                                 "transformer_blocks.0.attn.add_v_proj"),
         "single_blocks.0.linear1.weight": ("single_transformer_blocks.0.attn.to_q",
                                            "single_transformer_blocks.0.attn.to_k",
                                            "single_transformer_blocks.0.attn.to_v",
                                            "single_transformer_blocks.0.proj_mlp")}  # BFL's fused weights: layers


@pytest.fixture(scope="module")
def wide(files, tmp_path_factory):
    """The tiny folder with a wider transformer (2 heads x 128: every block's in-widths 256, 1024
    or 1280, whole K blocks) and its BFL tensors; ``mixed``: one file whose quantised weights cycle
    through every packed type and Q8_0 (as a Q4_K_M file mixes Q4_K and Q6_K), the fused ones
    (``FUSED``, cut into layers at conversion) first: IQ4_NL, IQ4_XS, Q4_0."""
    import shutil

    import torch
    from diffusers import FluxTransformer2DModel
    from safetensors.numpy import load_file

    base = tmp_path_factory.mktemp("gguf-wide")
    folder = base / "flux-dev-wide"
    shutil.copytree(files["folder"], folder, symlinks=True)
    torch.manual_seed(1)
    transformer = FluxTransformer2DModel(patch_size=1, num_layers=1, num_single_layers=1, attention_head_dim=128,
                                         in_channels=16, num_attention_heads=2, joint_attention_dim=32,
                                         pooled_projection_dim=32, axes_dims_rope=[16, 56, 56], guidance_embeds=True)
    flow_fixtures._perturb(transformer)
    shutil.rmtree(folder / "transformer")
    transformer.save_pretrained(folder / "transformer")
    bfl = to_bfl(load_file(str(folder / "transformer" / "diffusion_pytorch_model.safetensors")))
    cycle = [*PACKED[-2:], *PACKED[:-2], "Q8_0"]
    weights = [k for k, v in bfl.items() if v.ndim == 2 and k.endswith(".weight") and v.shape[1] % 256 == 0]
    weights = [*FUSED, *(k for k in weights if k not in FUSED)]
    pick = {k: gguf.GGMLQuantizationType[cycle[i % len(cycle)]] for i, k in enumerate(weights)}
    mixed = base / "flux-dev-wide-mixed.gguf"
    types = write_gguf(mixed, bfl, pick.get)
    assert set(types.values()) >= {*PACKED, "Q8_0"}
    assert [types[k] for k in FUSED] == ["IQ4_NL", "IQ4_XS", "Q4_0"]
    return {"folder": folder, "bfl": bfl, "mixed": mixed, "types": types, "base": base}


def _diffusers_image(folder, path, monkeypatch) -> np.ndarray:
    """diffusers' image: its GGUF load of ``path`` in ``folder``'s pipeline, float32 compute."""
    import torch
    from diffusers import FluxTransformer2DModel, GGUFQuantizationConfig

    ref = flow_fixtures.reference_pipeline(folder, "flow_euler")
    with diffusers_bfl_at_tiny_widths(folder, monkeypatch):
        ref.transformer = FluxTransformer2DModel.from_single_file(
            str(path), quantization_config=GGUFQuantizationConfig(compute_dtype=torch.float32),
            config=str(folder), subfolder="transformer", torch_dtype=torch.float32)
    return flow_fixtures.reference_pixels(ref, PROMPT, _noise(), num_inference_steps=STEPS, guidance_scale=GUIDANCE)


def _against_diffusers(path, folder, monkeypatch, record_property, what: str, pipe: Any = None) -> Any:
    pipe = pipe or preheat.load(path, config=folder, cache="off")
    ours = pipe.generate(PROMPT, noise=_noise(), steps=STEPS, sampler="flow_euler", guidance=GUIDANCE, width=32,
                         height=32)
    theirs = _diffusers_image(folder, path, monkeypatch)
    diff = px_diff(ours, theirs)
    record_property("mean_abs_px", float(diff.mean()))
    print(f"GGUF {what} vs diffusers' GGUF quantizer: mean |Δpx| {diff.mean():.4f}, max {diff.max()}")
    assert diff.mean() <= MEAN_TOL and ours.std() > 5
    return pipe


def _kept(pipe) -> dict[str, Any]:
    from flax import nnx

    from preheat.models.quantised import is_quantised

    leaves = {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(pipe.params)}
    return {k: v for k, v in leaves.items() if is_quantised(v)}


@pytest.fixture(scope="module")
def mixed(wide, tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PREHEAT_HOME", str(tmp_path_factory.mktemp("home")))
        return preheat.load(wide["mixed"], config=wide["folder"], cache="off")


def test_a_file_mixing_every_packed_type_draws_diffusers_gguf_image(wide, mixed, monkeypatch, record_property):
    """One file, one program: every packed type (and Q8_0) in its layers, each kept as stored; the
    fused weights (IQ4_NL, IQ4_XS, Q4_0) cut into their layers as whole rows of blocks, each layer's
    weight exactly its rows of gguf's dequantisation of the fused one."""
    from preheat.models.quantised import Packed, Quantised

    pipe = _against_diffusers(wide["mixed"], wide["folder"], monkeypatch, record_property, "mixed types", mixed)
    kept = _kept(pipe)
    kinds = sorted({q.kind for q in kept.values() if isinstance(q, Packed)})
    assert kinds == sorted(PACKED) and any(isinstance(q, Quantised) for q in kept.values())
    reader = {t.name: t for t in gguf.GGUFReader(str(wide["mixed"])).tensors}
    for name, layers in FUSED.items():
        whole = gguf.quants.dequantize(reader[name].data, reader[name].tensor_type)  # (3 * 256 [+ 1024], in)
        at = 0
        for layer in layers:
            q = kept[f"{layer}.kernel"]
            assert isinstance(q, Packed) and q.kind == wide["types"][name], layer
            rows = np.asarray(q.expand(np.float32)).T  # (out, in)
            np.testing.assert_array_equal(rows, whole[at:at + rows.shape[0]], err_msg=layer)
            at += rows.shape[0]
        assert at == whole.shape[0]


@pytest.fixture(scope="module")
def mixed_fp8(wide, tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PREHEAT_HOME", str(tmp_path_factory.mktemp("home")))
        return preheat.load(wide["mixed"], config=wide["folder"], cache="off", weights_dtype="float8_e4m3fn")


def test_fp8_storage_of_a_packed_file_keeps_every_packed_weight_packed(wide, mixed, mixed_fp8):
    """weights_dtype=float8_e4m3fn: each packed weight stays its blocks, whether fp8 storage names
    its layer or keeps it at full precision (the AdaLN modulation): fp8 would be larger than any
    packed type, and the blocks are placed as they are, never dequantised on the host. The file's
    F16 weights in fp8's set are cast to fp8 as any full-precision weight is."""
    from preheat.models.quantised import Packed

    low = mixed_fp8
    packed = {k: q.kind for k, q in _kept(low).items() if isinstance(q, Packed)}
    assert packed == {k: q.kind for k, q in _kept(mixed).items() if isinstance(q, Packed)}
    assert "norm_out.linear.kernel" in packed  # a modulation layer fp8 storage keeps at full precision
    from flax import nnx

    leaves = {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(low.params)}
    assert leaves["x_embedder.kernel"].dtype == np.dtype("float8_e4m3fn")  # img_in: F16 in the file


MOVED = 0.5  # mean |Δpx| the fp8 image must move from the plain one (measured 1.22): the test can tell


def test_fp8_storage_of_a_packed_file_draws_the_image_of_its_plain_weights_rounded_to_fp8(wide, mixed, mixed_fp8,
                                                                                          tmp_path, monkeypatch):
    """weights_dtype=float8_e4m3fn on the mixed file casts its plain (F16) weights in fp8's set to
    fp8 and nothing else. The reference is the same file written again with exactly those weights
    rounded to fp8 by torch (from the file's F16 values: one rounding, as the load's cast) and kept
    F16, its packed and Q8_0 weights the same blocks, loaded without weights_dtype. Which weights:
    the ones diffusers' ``enable_layerwise_casting`` stores in fp8 on this transformer (weights only;
    biases, norms, the AdaLN modulation and the top-level projections stay wide). Exact: every fp8
    value is an F16 value, so both programs read the same numbers (an fp8 weight converted where it
    is used, an F16 one converted at load) and do the same float32 arithmetic on them; a bias or
    norm cast that plain fp8 keeps wide, or a set weight left wide, moves pixels (the fp8 image is
    1.22 levels from the plain one; a reference with ``txt_in`` left unrounded, 0.42, max 2)."""
    import torch
    from diffusers import FluxTransformer2DModel
    from safetensors.numpy import load_file

    folder, types = wide["folder"], wide["types"]
    model = FluxTransformer2DModel.from_pretrained(folder / "transformer", torch_dtype=torch.float32)
    model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
    theirs = {f"{n}.weight" for n, m in model.named_modules()
              if getattr(m, "weight", None) is not None and m.weight.dtype == torch.float8_e4m3fn}
    state = load_file(str(folder / "transformer" / "diffusion_pytorch_model.safetensors"))
    rounded = {k: torch.from_numpy(v.astype(np.float16)).to(torch.float8_e4m3fn).to(torch.float32).numpy()
               if k in theirs else v for k, v in state.items()}
    plain = [k for k, t in types.items() if t == "F16"]  # BFL names: the file's 2-D weights kept unquantised
    ref_tensors = {k: (to_bfl(rounded)[k] if k in plain else v) for k, v in wide["bfl"].items()}
    changed = [k for k in plain if not np.array_equal(np.float16(ref_tensors[k]), np.float16(wide["bfl"][k]))]
    assert sorted(changed) == sorted(plain) == ["img_in.weight", "txt_in.weight", "vector_in.in_layer.weight"]
    ref_path = tmp_path / "flux-dev-wide-mixed-fp8-rounded.gguf"
    kinds = {k: gguf.GGMLQuantizationType[t] for k, t in types.items() if t not in ("F16", "F32")}
    assert write_gguf(ref_path, ref_tensors, kinds.get) == types

    monkeypatch.setenv("PREHEAT_HOME", str(tmp_path / "home"))
    ref = preheat.load(ref_path, config=folder, cache="off")
    call = dict(noise=_noise(), steps=STEPS, sampler="flow_euler", guidance=GUIDANCE, width=32, height=32)
    ours, theirs_px, full = (p.generate(PROMPT, **call) for p in (mixed_fp8, ref, mixed))
    diff = px_diff(ours, theirs_px)
    moved = mean_abs_px(ours, full)
    print(f"GGUF mixed types, weights_dtype=fp8 vs its F16 weights rounded to fp8: mean |Δpx| {diff.mean():.4f}, "
          f"max {diff.max()}; vs the plain load: mean {moved:.4f}")
    assert ours.std() > 5 and moved >= MOVED
    np.testing.assert_array_equal(ours, theirs_px)


def test_fsdp_splits_the_packed_blocks_and_draws_the_unsharded_image(wide, mixed, tmp_path, monkeypatch):
    """``fsdp=2`` on two of the suite's fake CPU devices (``sharding.FSDP_MIN_SIZE`` lowered so that
    the tiny weights split at all): each packed weight's blocks are one array, split over ``fsdp``
    like any weight, and the partitioner gathers them where the layer unpacks them. The image is the
    one-device load's to float32 rounding order (the scaled fp8 files' bound, mean <= 0.01, max 1)."""
    from preheat import sharding
    from preheat.models.quantised import Packed

    monkeypatch.setenv("PREHEAT_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(sharding, "FSDP_MIN_SIZE", 2)
    pipe = preheat.load(wide["mixed"], config=wide["folder"], cache="off", devices=2, fsdp=2)
    packed = [q for q in _kept(pipe).values() if isinstance(q, Packed)]
    assert len(packed) > 10
    for q in packed:
        assert sharding.FSDP_AXIS in q.blocks.sharding.spec, q.blocks.sharding
        assert q.blocks.addressable_shards[0].data.size * 2 == q.blocks.size
    call = dict(noise=_noise(), steps=STEPS, sampler="flow_euler", guidance=GUIDANCE, width=32, height=32)
    ours, whole = pipe.generate(PROMPT, **call), mixed.generate(PROMPT, **call)
    diff = px_diff(ours, whole)
    print(f"fsdp=2 vs one device, mixed GGUF types: mean |Δpx| {diff.mean():.4f}, max {diff.max()}")
    assert ours.std() > 5 and diff.mean() <= 0.01 and diff.max() <= 1


@pytest.mark.slow
@pytest.mark.parametrize("kind", PACKED)
def test_a_packed_flux_transformer_draws_diffusers_gguf_image(wide, kind, monkeypatch, tmp_path, record_property):
    """A file of one type (its weights whose rows are whole blocks; the rest F16/F32)."""
    from preheat.models.quantised import Packed

    monkeypatch.setenv("PREHEAT_HOME", str(tmp_path / "home"))
    path = wide["base"] / f"flux-dev-wide-{kind}.gguf"
    types = write_gguf(path, wide["bfl"], gguf.GGMLQuantizationType[kind])
    assert list(types.values()).count(kind) >= 15
    pipe = _against_diffusers(path, wide["folder"], monkeypatch, record_property, kind)
    assert {q.kind for q in _kept(pipe).values()} == {kind} and all(isinstance(q, Packed) for q in _kept(pipe).values())


def test_a_q4_k_model_holds_its_packed_bytes_on_the_device(wide, tmp_path, monkeypatch, record_property):
    """The device holds a Q4_K weight's blocks as the file stores them (144 bytes per 256 values,
    4.5 bits), nothing widened: the denoiser's bytes are the file's Q4_K bytes plus its other
    tensors at the compute dtype (float32). The bytes of each weight are the file's own."""
    from preheat.models.quantised import Packed
    from preheat.models.storage import device_bytes

    monkeypatch.setenv("PREHEAT_HOME", str(tmp_path / "home"))
    path = wide["base"] / "flux-dev-wide-Q4_K-memory.gguf"
    types = write_gguf(path, wide["bfl"], gguf.GGMLQuantizationType.Q4_K)
    pipe = preheat.load(path, config=wide["folder"], cache="off")
    kept = _kept(pipe)
    # BFL's two fused qkv weights are three layers each, its single block's linear1 four (q, k, v, MLP in)
    assert len(kept) == list(types.values()).count("Q4_K") + 2 * 2 + 3
    reader = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    packed_in_file = sum(int(t.n_bytes) for t in reader.values() if t.tensor_type.name == "Q4_K")
    held = sum(q.nbytes for q in kept.values())
    assert all(isinstance(q, Packed) and q.blocks.dtype == np.uint8 for q in kept.values())
    assert held == packed_in_file  # exactly the packed bytes: 144 per 256 elements
    elements = sum(int(np.prod(q.shape)) for q in kept.values())
    assert held * 256 == elements * 144
    rest = {k: v for k, v in reader.items() if v.tensor_type.name != "Q4_K"}
    rest_elements = sum(int(np.prod(t.shape)) for t in rest.values())
    assert device_bytes(pipe.params) == held + 4 * rest_elements  # the rest: float32, the compute dtype
    q = kept["single_transformer_blocks.0.proj_out.kernel"]  # BFL's single_blocks.0.linear2, one to one
    raw = reader["single_blocks.0.linear2.weight"]
    np.testing.assert_array_equal(np.asarray(q.blocks).transpose(2, 0, 1).reshape(raw.data.shape), raw.data)
    record_property("device_bytes", device_bytes(pipe.params))
    print(f"Q4_K denoiser on the device: {device_bytes(pipe.params)} B ({held} B of Q4_K blocks for {elements} "
          f"weights, {elements * 4} B as float32)")


def _unsupported(path, kind: str = "IQ2_XS") -> None:
    """A GGUF file with one FLUX.1 weight in ``kind`` (random bytes of its size) and a bias."""
    qtype = gguf.GGMLQuantizationType[kind]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    writer = gguf.GGUFWriter(str(path), arch="flux")
    writer.add_tensor("double_blocks.0.img_attn.qkv.weight", np.zeros((96, 256 // block * size), np.uint8),
                      raw_dtype=qtype)
    writer.add_tensor("img_in.bias", np.zeros(32, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("kind", ["TQ2_0", "Q8_1", "IQ2_XS"])
def test_another_quantisation_type_is_one_line(files, kind, tmp_path, monkeypatch):
    from preheat.models.gguf_file import SUPPORTED

    monkeypatch.setenv("PREHEAT_HOME", str(tmp_path / "home"))
    path = tmp_path / f"flux1-tiny-{kind}.gguf"
    _unsupported(path, kind)
    with pytest.raises(ModelFormatError) as exc:
        preheat.load(path, config=files["folder"], cache="off")
    message = str(exc.value)
    assert "\n" not in message and f"double_blocks.0.img_attn.qkv.weight is GGUF type {kind}" in message
    assert message.endswith("preheat reads F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, "
                            "Q6_K, IQ4_NL, IQ4_XS")
    assert set(SUPPORTED) == {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K",
                              "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"}
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
    dequantisation, each packed type (``ggml.LAYOUTS``) as its rows of blocks that ``ggml.dequantise``
    expands to gguf's own dequantisation bit for bit, all in torch's axis order."""
    import jax

    from preheat.models.ggml import LAYOUTS
    from preheat.models.gguf_file import SUPPORTED, GGUFTensors, packed_name
    from preheat.models.quantised import Packed
    from tests._support.gguf_files import quantize

    rng = np.random.default_rng(0)
    tensors = {"a.weight": rng.standard_normal((3, 64)).astype(np.float32), "b.bias": rng.standard_normal(5)}
    path, kinds = tmp_path / "types.gguf", {"a.weight": "Q8_0", "b.bias": "F32", "c.weight": "F16", "d.weight": "BF16"}
    writer = gguf.GGUFWriter(str(path), arch="flux")
    q8, bf16 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.BF16
    writer.add_tensor("a.weight", gguf.quants.quantize(tensors["a.weight"], q8), raw_dtype=q8)
    writer.add_tensor("b.bias", tensors["b.bias"].astype(np.float32))
    writer.add_tensor("c.weight", tensors["a.weight"][:, :5].astype(np.float16))
    writer.add_tensor("d.weight", gguf.quants.quantize(tensors["a.weight"][:2], bf16), raw_dtype=bf16)
    for kind in LAYOUTS:  # 3 rows of 2 super-blocks (16 blocks of 32): a row's blocks in order
        kinds[f"{kind.lower()}.weight"] = kind
        weight = rng.standard_normal((3, 512)).astype(np.float32) * 0.05
        writer.add_tensor(f"{kind.lower()}.weight", quantize(weight, kind), raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert sorted(set(kinds.values())) == sorted(SUPPORTED)
    read = GGUFTensors(path)
    raw = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    assert {k: raw[k].tensor_type.name for k in kinds} == kinds
    for key, kind in kinds.items():
        want = gguf.quants.dequantize(raw[key].data, raw[key].tensor_type)
        if kind == "Q8_0":
            assert read[key].dtype == np.int8 and read["a.scale_weight"].dtype == np.float16
            got = read[key].astype(np.float32) * np.repeat(read["a.scale_weight"].astype(np.float32), 32, axis=1)
        elif kind in LAYOUTS:  # each row's blocks -> the kernel's layout (in / QK, BYTES, out), expanded compiled
            rows = read[packed_name(key, kind)]
            assert rows.dtype == np.uint8 and rows.shape == (3, 512 // LAYOUTS[kind].qk * LAYOUTS[kind].nbytes)
            blocks = rows.reshape(3, -1, LAYOUTS[kind].nbytes).transpose(1, 2, 0)
            got = np.asarray(jax.jit(lambda b, kind=kind: Packed(b, kind).expand(np.float32))(blocks)).T
            assert np.abs(want).max() > 0
            got, want = got.view(np.uint32), want.view(np.uint32)  # bit for bit
        else:
            got = read[key].astype(np.float32)
        assert got.shape == want.shape == tuple(reversed(raw[key].shape.tolist()))
        np.testing.assert_array_equal(got, want, err_msg=key)


def test_a_packed_weight_reads_as_its_rows_of_blocks_under_its_kind(tmp_path):
    """A Q4_K weight ``e.weight`` is read as ``e.weight_Q4_K``: each row's blocks, the file's bytes
    (the name says the kind, from the header alone); its shape for model inference is the weight's."""
    from preheat.models.gguf_file import GGUFTensors, packed_weights
    from tests._support.gguf_files import quantize

    weight = np.random.default_rng(0).standard_normal((3, 512)).astype(np.float32)
    path = tmp_path / "packed.gguf"
    writer = gguf.GGUFWriter(str(path), arch="flux")
    writer.add_tensor("e.weight", quantize(weight, "Q4_K"), raw_dtype=gguf.GGMLQuantizationType.Q4_K)
    writer.add_tensor("e.bias", np.zeros(3, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    read = GGUFTensors(path)
    assert sorted(read) == ["e.bias", "e.weight_Q4_K"] and "e.weight" not in read
    assert packed_weights(read) == {"e.weight": ("e.weight_Q4_K", "Q4_K")}
    (raw,) = [t for t in gguf.GGUFReader(str(path)).tensors if t.name == "e.weight"]
    assert read["e.weight_Q4_K"].shape == (3, 2 * 144) and read["e.weight_Q4_K"].dtype == np.uint8
    np.testing.assert_array_equal(read["e.weight_Q4_K"], raw.data)
    assert read.shapes() == {"e.weight": (3, 512), "e.bias": (3,)}


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
    _unsupported(tmp_path / "iq2.gguf")
    repo = {"README.md": b"# tiny", "flux1-dev-Q8_0.gguf": body,
            "iq2/flux1-dev-IQ2_XS.gguf": (tmp_path / "iq2.gguf").read_bytes()}
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
        with pytest.raises(ModelFormatError, match="is GGUF type IQ2_XS"):  # a file in a folder of the repository
            preheat.load("hf://example/tiny-flux-gguf/iq2/flux1-dev-IQ2_XS.gguf", config=files["folder"], cache="off")
        with pytest.raises(InvalidArgumentError, match="is a GGUF file .*pass config="):
            preheat.load("hf://example/tiny-flux-gguf/flux1-dev-Q8_0.gguf", cache="off")
    finally:
        hub.stop()
