"""Single files of SD3 / SD3.5 (Stability's MMDiT under ``model.diffusion_model.``) and ComfyUI
bundles (the transformer with its VAE and text encoders, ``text_encoders.{clip_l,clip_g,t5xxl}.*``),
issue 28 item 1. The files are written from tiny random folders by inverting preheat's own tables
(``tests/_support/single_files.py``); diffusers' ``from_single_file`` reading them back to the
folder's weights or image is what proves them real.

A bundle is read with the configs of a *second* folder of the same architecture and other random
weights: the image is the first folder's, so every bundled component replaced the config folder's.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import preheat
from preheat.errors import ModelFormatError
from tests._support import flow_fixtures
from tests._support.numerics import assert_pixels_close, mean_abs_px
from tests._support.single_files import bfl_file, bundle, diffusers_bfl_at_tiny_widths, mmdit_file

PROMPT = "a lighthouse at dusk"


def _save(tensors: dict[str, np.ndarray], path) -> None:
    from safetensors.numpy import save_file

    save_file(tensors, str(path))


def _identity_clip_l_projection(folder) -> None:
    """SD3 pools CLIP-L's output unprojected (the original files carry no projection for it, and
    diffusers reads them with an identity ``text_projection``): the folder's own is made the
    identity too, so that the folder's image is the image the file can hold."""
    from safetensors.numpy import load_file, save_file

    path = folder / "text_encoder" / "model.safetensors"
    tensors = load_file(str(path))
    width = tensors["text_projection.weight"].shape[0]
    tensors["text_projection.weight"] = np.eye(width, dtype=np.float32)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _sd35(folder) -> None:
    """The folder's transformer made SD3.5-medium-like: RMS q/k norms, a second attention in block 0."""
    import torch
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(5)
    cfg = {k: v for k, v in json.loads((folder / "transformer" / "config.json").read_text()).items()
           if not k.startswith("_")}
    model = SD3Transformer2DModel(**{**cfg, "qk_norm": "rms_norm", "dual_attention_layers": (0,)})
    flow_fixtures._perturb(model)
    model.save_pretrained(folder / "transformer")


def _other_weights(folder, to):
    """A copy of ``folder`` (configs, tokenizers) whose every weight is moved by noise."""
    import shutil

    from safetensors.numpy import load_file, save_file

    shutil.copytree(folder, to)
    rng = np.random.default_rng(11)
    for path in to.glob("*/*.safetensors"):
        tensors = {k: (v + 0.05 * rng.standard_normal(v.shape)).astype(v.dtype) for k, v in load_file(str(path)).items()}
        save_file(tensors, str(path), metadata={"format": "pt"})
    return to


def _scheduler(folder):
    from preheat.backends.torch.sampling import make_scheduler

    return make_scheduler("flow_euler", json.loads((folder / "scheduler" / "scheduler_config.json").read_text()))


@pytest.fixture(scope="module")
def sd3(tmp_path_factory):
    """{name: folder}: "a" (the file's weights), "b" (a's configs, other weights), "sd35"."""
    base = tmp_path_factory.mktemp("sd3")
    out = {name: flow_fixtures.save_tiny_flow_model(base / name, "sd3", seed=seed) for name, seed in (("a", 0), ("sd35", 2))}
    for folder in out.values():
        _identity_clip_l_projection(folder)
    _sd35(out["sd35"])
    out["b"] = _other_weights(out["a"], base / "b")
    return out


def _noise() -> np.ndarray:
    return np.random.default_rng(3).standard_normal((1, 4, 16, 16)).astype(np.float32)


def _ours(path, config, guidance: float) -> np.ndarray:
    pipe = preheat.load(path, config=config, cache="off")
    return pipe.generate(PROMPT, noise=_noise(), steps=3, sampler="flow_euler", guidance=guidance, width=32, height=32)


def _converted(home):
    (out,) = (home / "models" / "single").iterdir()
    return out


def _plain(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k.removeprefix("text_model."): v for k, v in tensors.items()}  # CLIP saved either way


def _assert_from(converted, folder, *components: str) -> None:
    """The converted folder's ``components`` are written from the file and hold ``folder``'s tensors
    (the config folder's other weights are nowhere in them)."""
    from safetensors.numpy import load_file

    for component in components:
        name = f"{component}/{'model' if component.startswith('text_encoder') else 'diffusion_pytorch_model'}.safetensors"
        assert not (converted / name).is_symlink(), name
        got, want = (_plain(load_file(str(f / name))) for f in (converted, folder))
        if "encoder.embed_tokens.weight" in got:  # T5's tied embedding, kept under both names as the file has it
            assert np.array_equal(got.pop("encoder.embed_tokens.weight"), want["shared.weight"])
        assert sorted(got) == sorted(want) and all(np.array_equal(got[k], want[k]) for k in want), name


def _diffusers_clip_g(path, config):
    """CLIP-G, read from the file by diffusers' own conversion of ``text_encoders.clip_g.``.

    ``from_single_file`` tells SD3's CLIP-L and CLIP-G apart by their widths alone; the tiny
    folder's are both 32 wide, so it would read CLIP-L twice. Its conversion is called directly
    instead, on the same file."""
    from diffusers.loaders.single_file_utils import convert_ldm_clip_checkpoint
    from safetensors.torch import load_file
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    model = CLIPTextModelWithProjection(CLIPTextConfig.from_pretrained(config / "text_encoder_2"))
    converted = convert_ldm_clip_checkpoint(load_file(str(path)), "text_encoders.clip_g.transformer.")
    missing, unexpected = model.load_state_dict(converted, strict=False)
    assert not unexpected and all(k.endswith("position_ids") for k in missing), (missing, unexpected)
    return model.eval()


def test_sd3_bundle_replaces_every_component_of_the_config_folder(sd3, tmp_path, monkeypatch, record_property):
    import torch
    from diffusers import StableDiffusion3Pipeline

    path = tmp_path / "sd3-bundle.safetensors"
    _save(bundle(sd3["a"], "mmdit"), path)
    call = dict(num_inference_steps=3, guidance_scale=5.0)
    theirs = flow_fixtures.reference_pixels(flow_fixtures.reference_pipeline(sd3["a"]), PROMPT, _noise(), **call)

    # diffusers reads the bundle, under the other folder's configs, to the first folder's image
    ref = StableDiffusion3Pipeline.from_single_file(str(path), config=str(sd3["b"]), torch_dtype=torch.float32,
                                                    text_encoder_2=_diffusers_clip_g(path, sd3["b"]))
    ref.scheduler = _scheduler(sd3["b"])
    assert ref.text_encoder_3.training  # diffusers 0.42 leaves the T5 it reads from a single file in training
    ref.text_encoder_3.eval()  # mode: its dropout (rate 0.1, as in SD3's own T5 config) would be on
    ref.set_progress_bar_config(disable=True)
    assert_pixels_close(flow_fixtures.reference_pixels(ref, PROMPT, _noise(), **call), theirs)

    monkeypatch.setenv("PREHEAT_HOME", str(tmp_path / "home"))
    ours = _ours(path, sd3["b"], 5.0)
    record_property("mean_abs_px", mean_abs_px(ours, theirs))
    assert_pixels_close(ours, theirs)
    _assert_from(_converted(tmp_path / "home"), sd3["a"], "transformer", "vae", "text_encoder", "text_encoder_2",
                 "text_encoder_3")


def test_sd35_transformer_file_keeps_the_folder_s_other_components(sd3, tmp_path, monkeypatch, record_property):
    """An SD3.5 transformer alone, in the bare MMDiT names (q/k norms, ``x_block.attn2``): diffusers'
    ``SD3Transformer2DModel.from_single_file`` reads it to the folder's weights; preheat's image is
    diffusers' from the folder, with the folder's VAE and text encoders linked."""
    import torch
    from diffusers import SD3Transformer2DModel
    from safetensors.numpy import load_file

    folder = sd3["sd35"]
    path = tmp_path / "sd3.5-medium-tiny.safetensors"
    tensors = mmdit_file(folder, prefix="")
    assert any(".x_block.attn2.qkv." in k for k in tensors) and any(".attn.ln_q." in k for k in tensors)
    _save(tensors, path)
    want = load_file(str(folder / "transformer" / "diffusion_pytorch_model.safetensors"))
    theirs_from_file = SD3Transformer2DModel.from_single_file(str(path), config=str(folder), subfolder="transformer",
                                                              torch_dtype=torch.float32).state_dict()
    assert sorted(theirs_from_file) == sorted(want)
    assert all(np.array_equal(theirs_from_file[k].numpy(), want[k]) for k in want)

    monkeypatch.setenv("PREHEAT_HOME", str(tmp_path / "home"))
    call = dict(num_inference_steps=3, guidance_scale=4.0)
    theirs = flow_fixtures.reference_pixels(flow_fixtures.reference_pipeline(folder), PROMPT, _noise(), **call)
    ours = _ours(path, folder, 4.0)
    record_property("mean_abs_px", mean_abs_px(ours, theirs))
    assert_pixels_close(ours, theirs)
    converted = _converted(tmp_path / "home")
    for part in ("vae/diffusion_pytorch_model.safetensors", "text_encoder/model.safetensors",
                 "text_encoder_3/model.safetensors"):
        assert (converted / part).resolve() == (folder / part).resolve()


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    """{name: folder}: two tiny FLUX.1-dev folders, "a" (the file's weights) and "b" (the configs)."""
    base = tmp_path_factory.mktemp("flux")
    a = flow_fixtures.save_tiny_flow_model(base / "a", "flux-dev")
    return {"a": a, "b": _other_weights(a, base / "b")}


def _diffusers_flux_bundle(path, config, monkeypatch):
    """diffusers' ``FluxPipeline.from_single_file(path, config=folder)``, with its BFL conversion's
    ``linear1`` cut at the tiny widths (``single_files.diffusers_bfl_at_tiny_widths``)."""
    import torch
    from diffusers import FluxPipeline

    with diffusers_bfl_at_tiny_widths(config, monkeypatch):
        pipe = FluxPipeline.from_single_file(str(path), config=str(config), torch_dtype=torch.float32)
    pipe.scheduler = _scheduler(config)
    assert pipe.text_encoder_2.training  # as SD3's T5 above: diffusers 0.42 leaves it in training mode
    pipe.text_encoder_2.eval()
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_comfyui_flux_bundle_replaces_the_vae_and_text_encoders(flux, tmp_path, monkeypatch, record_property):
    """A ComfyUI FLUX.1 checkpoint (``flux1-dev-fp8``'s layout): ``model.diffusion_model.*`` in BFL's
    names, the VAE under ``vae.*`` (or ``first_stage_model.*``), CLIP-L and T5 under
    ``text_encoders.*``. diffusers reads the ``first_stage_model.`` form (its VAE conversion knows no
    ``vae.`` prefix) to folder a's image; both forms convert to folder a's tensors."""
    from preheat.models.single_file import materialize

    ldm_form, comfy_form = tmp_path / "flux-ldm-vae.safetensors", tmp_path / "flux1-dev-tiny.safetensors"
    _save(bundle(flux["a"], "bfl"), ldm_form)
    _save(bundle(flux["a"], "bfl", vae_top="vae."), comfy_form)
    call = dict(num_inference_steps=3, guidance_scale=3.5)
    theirs = flow_fixtures.reference_pixels(flow_fixtures.reference_pipeline(flux["a"]), PROMPT, _noise(), **call)
    from_file = flow_fixtures.reference_pixels(_diffusers_flux_bundle(ldm_form, flux["b"], monkeypatch), PROMPT,
                                               _noise(), **call)
    assert_pixels_close(from_file, theirs)

    monkeypatch.setenv("PREHEAT_HOME", str(tmp_path / "home"))
    ours = _ours(comfy_form, flux["b"], 3.5)
    record_property("mean_abs_px", mean_abs_px(ours, theirs))
    assert_pixels_close(ours, theirs)
    parts = ("transformer", "vae", "text_encoder", "text_encoder_2")
    _assert_from(_converted(tmp_path / "home"), flux["a"], *parts)
    _assert_from(materialize(ldm_form, flux["b"], tmp_path / "other"), flux["a"], *parts)


def test_bad_sd3_and_bundle_files_are_one_line(sd3, flux, tmp_path, monkeypatch):
    monkeypatch.setenv("PREHEAT_HOME", str(tmp_path / "home"))
    tensors = mmdit_file(sd3["a"])

    def variant(name: str, base: dict[str, np.ndarray], **changed: np.ndarray):
        out = tmp_path / f"{name}.safetensors"
        _save({**base, **changed}, out)
        return out

    def refused(path, config, pattern: str) -> None:
        with pytest.raises(ModelFormatError, match=pattern) as err:
            preheat.load(path, config=config, cache="off")
        assert "\n" not in str(err.value)

    # a fused q/k/v cut by the config's widths (4 heads x 8: 3 x 32 rows), named
    short = variant("short", tensors, **{"model.diffusion_model.joint_blocks.0.x_block.attn.qkv.weight":
                                         np.zeros((93, 32), np.float32)})
    refused(short, sd3["a"], r"\(mmdit layout\): model\.diffusion_model\.joint_blocks\.0\.x_block\.attn\.qkv\.weight "
                             r"has 93 rows; the blocks of .* transformer config make 96")
    # another shape: the loader's check, naming the tensor
    wide = variant("wide", tensors, **{"model.diffusion_model.context_embedder.weight": np.zeros((32, 8), np.float32)})
    refused(wide, sd3["a"], r"does not fit the configs of .*context_embedder\.weight has shape \(32, 8\)")
    # SD3.5's q/k norms and second attention under an SD3 config: tensors no block of it has
    refused(variant("sd35", mmdit_file(sd3["sd35"])), sd3["a"],
            r"\(mmdit layout\) has \d+ tensors that do not fit the blocks .* e\.g\. .*(ln_q|ln_k|attn2)")
    # a text encoder FLUX.1 does not have, bundled with a Flux transformer
    clip_g = {k: v for k, v in bundle(sd3["a"], "mmdit").items() if k.startswith("text_encoders.clip_g.")}
    refused(variant("flux-clip-g", bundle(flux["a"], "bfl", vae_top="vae."), **clip_g), flux["a"],
            r"\(bfl layout\) has \d+ tensors that do not fit .* text_encoders\.clip_g\.")
    # an SD3 file with a Flux folder's configs, and with configs that describe no transformer at all
    refused(variant("sd3-under-flux", tensors), flux["a"], r"\(mmdit layout\) has \d+ tensors that do not fit the blocks")
    odd = _other_weights(sd3["a"], tmp_path / "odd-config")
    (odd / "transformer" / "config.json").write_text(json.dumps({"_class_name": "SD3Transformer2DModel"}))
    refused(variant("sd3-odd", tensors), odd, r"configs of .*odd-config do not fit a file of the mmdit layout "
                                              r"\(transformer/config\.json has no 'num_layers'\)")


FP8 = "float8_e4m3fn"


def _fp8(tensors: dict[str, np.ndarray], scaled: bool, prefix: str) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(``tensors`` with every 2-D ``.weight`` under ``prefix`` stored F8_E4M3, those weights dequantised
    in float32). Plain: the weight as it rounds (flux1-dev-fp8's transformer and T5). Scaled: divided by
    a float32 per-tensor scale ``amax / 448`` stored beside it as ``scale_weight``, with the file's
    ``scaled_fp8`` marker (ComfyUI's scaled files)."""
    import ml_dtypes

    from preheat.models import scaled_fp8

    out, dequantised = dict(tensors), {}
    for key, value in tensors.items():
        if value.ndim != 2 or not key.endswith(".weight") or not key.startswith(prefix):
            continue
        scale = np.float32(np.abs(value).max() / 448.0) if scaled else np.float32(1.0)
        out[key] = (value / scale).astype(ml_dtypes.float8_e4m3fn)
        dequantised[key] = out[key].astype(np.float32) * scale
        if scaled:
            out[key[:-len("weight")] + "scale_weight"] = np.array(scale, np.float32)
    if scaled:
        out[scaled_fp8.MARKER] = np.zeros((0,), ml_dtypes.float8_e4m3fn)
    assert dequantised, prefix
    return out, dequantised


def _device_leaves(params) -> dict[str, object]:
    from flax import nnx

    return {".".join(map(str, path)): var.get_value() for path, var in nnx.to_flat_state(params)}


@pytest.mark.parametrize("layout", ["bfl", "mmdit"])
def test_fused_qkv_pieces_of_an_fp8_file_stay_fp8(layout, sd3, flux, tmp_path, monkeypatch):
    """FLUX.1's (BFL) and SD3's (MMDiT) files fuse q, k and v into one weight, which the load cuts
    into diffusers' ``to_q``/``to_k``/``to_v`` (``add_*_proj``; a FLUX single block's ``linear1`` too).
    In an fp8 file, plain or scaled, every piece is placed as the file stores its rows: the same fp8
    bytes (beside the fused weight's scale), not widened on the host, with ``weights_dtype`` or
    without; without it the transformer's device bytes are the bytes read."""
    from preheat.models.quantised import Quantised

    monkeypatch.setenv("PREHEAT_HOME", str(tmp_path / "home"))
    folder = flux["a"] if layout == "bfl" else sd3["a"]
    tensors = bfl_file(folder) if layout == "bfl" else mmdit_file(folder)  # the transformer, in its original names
    fused = ("model.diffusion_model.double_blocks.0.img_attn.qkv.weight" if layout == "bfl"
             else "model.diffusion_model.joint_blocks.0.x_block.attn.qkv.weight")
    for scaled in (False, True):
        stored, _ = _fp8(tensors, scaled, "model.diffusion_model.")
        path = tmp_path / f"{layout}-{'scaled' if scaled else 'plain'}.safetensors"
        _save(stored, path)
        rows = stored[fused].view(np.uint8)  # (3 * inner, in): q, k, v stacked
        n = rows.shape[0] // 3
        for weights_dtype in (None, FP8):
            pipe = preheat.load(path, config=folder, cache="off", weights_dtype=weights_dtype)
            leaves = _device_leaves(pipe.params)
            pieces = {k: v for k, v in leaves.items()
                      if k.endswith((".to_q.kernel", ".to_k.kernel", ".to_v.kernel", "_q_proj.kernel",
                                     "_k_proj.kernel", "_v_proj.kernel"))}
            assert len(pieces) >= 6, sorted(leaves)
            for key, value in pieces.items():
                assert isinstance(value, Quantised) == scaled, key
                assert (value.values if scaled else value).dtype == np.dtype(FP8), (key, value.dtype)
            for j, name in enumerate(("to_q", "to_k", "to_v")):
                value = leaves[f"transformer_blocks.0.attn.{name}.kernel"]
                np.testing.assert_array_equal(np.asarray(value.values if scaled else value).T.view(np.uint8),
                                              rows[j * n:(j + 1) * n], err_msg=name)
            if weights_dtype is None:
                part = pipe.load_report.parts[-2]
                assert "transformer" in part.source and part.bytes_read == part.placed_bytes, part


def test_a_bundle_s_fp8_text_encoders_are_dequantised_on_load(flux, tmp_path, monkeypatch):
    """A FLUX.1 fp8 bundle whose text encoders are fp8 too, as published files ship T5: the
    transformer and CLIP-L plain fp8, T5 scaled fp8 (per tensor, its tied embedding under both names,
    each with a scale). The encoders' programs do not upcast, so their weights are dequantised on the
    host as they are placed (float32 arrays, never ``Quantised``): each encoder's output is
    transformers' on the dequantised weights, and not the unrounded weights' output."""
    import torch
    from transformers import CLIPTextModel, T5EncoderModel

    monkeypatch.setenv("PREHEAT_HOME", str(tmp_path / "home"))
    clip_at, t5_at = "text_encoders.clip_l.transformer.", "text_encoders.t5xxl.transformer."
    stored, _ = _fp8(bundle(flux["a"], "bfl", vae_top="vae."), False, "model.diffusion_model.")
    stored, clip_weights = _fp8(stored, False, clip_at)
    stored, t5_weights = _fp8(stored, True, t5_at)
    assert {"shared.weight", "encoder.embed_tokens.weight"} <= {k[len(t5_at):] for k in t5_weights}
    path = tmp_path / "flux1-dev-fp8-tiny.safetensors"
    _save(stored, path)
    pipe = preheat.load(path, config=flux["b"], cache="off", weights_dtype=FP8)
    clip, t5 = pipe.components.text_encoders
    for encoder in (clip, t5):
        assert all(type(v).__module__.startswith("jax") and v.dtype == np.float32
                   for v in _device_leaves(encoder.params).values())
    ids = np.random.default_rng(0).integers(1, 99, (2, 12)).astype(np.int64)
    for ours, cls, component, prefix, weights in ((clip, CLIPTextModel, "text_encoder", clip_at, clip_weights),
                                                  (t5, T5EncoderModel, "text_encoder_2", t5_at, t5_weights)):
        ref = cls.from_pretrained(flux["a"] / component, torch_dtype=torch.float32).eval()
        with torch.no_grad():
            unrounded = ref(torch.from_numpy(ids)).last_hidden_state.numpy()
            names = ref.state_dict().keys()  # CLIP's without ``text_model.`` in this transformers
            state = {(k if k in names else k.removeprefix("text_model.")): torch.from_numpy(v)
                     for k, v in ((k[len(prefix):], v) for k, v in weights.items())}
            missing, unexpected = ref.load_state_dict(state, strict=False)
            assert not unexpected and len(state) > 5, unexpected
            theirs = ref(torch.from_numpy(ids)).last_hidden_state.numpy()
        got = np.asarray(ours(ids).last_hidden_state if cls is CLIPTextModel else ours(ids))
        print(f"{component} fp8: max |Δ| {np.abs(got - theirs).max():.2e}, vs unrounded {np.abs(got - unrounded).max():.2e}")
        np.testing.assert_allclose(got, theirs, rtol=1e-4, atol=1e-4, err_msg=component)
        assert np.abs(got - unrounded).max() > 100 * max(np.abs(got - theirs).max(), 1e-6), component
