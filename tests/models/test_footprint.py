"""The weights' device bytes from safetensors headers alone, and the load's refusal before a read."""

from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import save_file

from preheat.errors import ModelError, ModelNotFoundError
from preheat.models import footprint
from preheat.models.footprint import check_fits, fitting, weight_footprint
from tests._support.script_modules import load_script
from tests._support.tpu_fixtures import vm_host_cpu, weights_folder


@pytest.fixture
def folder(tmp_path):
    return weights_folder(tmp_path / "model")


def test_each_component_at_its_dtype(folder):
    fp = weight_footprint(folder, "float32")
    assert fp.parts == {"unet": 480256, "text_encoder": 256616, "vae": 36864} and fp.total == 773736
    bf16 = weight_footprint(folder, "bfloat16")
    assert bf16.parts == {"unet": 242176, "text_encoder": 128616, "vae": 36864}  # fp8 stays fp8, ints, the VAE f32
    assert weight_footprint(folder, "bfloat16", weights_dtype="float8_e4m3fn").parts["unet"] == 139776
    off = weight_footprint(folder, "bfloat16", offload_encoders=True)
    assert off.total == 279040 and off.offloaded == {"text_encoder": 128616}
    assert off.options() == "--dtype bfloat16 --encoders-on offload"
    assert weight_footprint(folder, "bfloat16", encoders_on="offload") == off  # the CLI's spelling of the keyword


def test_a_bare_model_folder_is_the_denoiser(folder):
    assert weight_footprint(folder / "unet", "float16").total == 242176


def test_a_missing_variant_is_the_loaders_one_line_error(folder):
    with pytest.raises(ModelNotFoundError, match="variant 'fp16'"):
        weight_footprint(folder, "bfloat16", variant="fp16")


class _Device:
    def __init__(self, limit):
        self.limit = limit

    def memory_stats(self):
        return None if self.limit is None else {"bytes_limit": self.limit}


def test_check_fits_refuses_in_one_line_and_is_quiet_when_it_cannot_tell(folder):
    kw = dict(dtype="float32", variant=None, weights_dtype=None, offload_encoders=False)
    with pytest.raises(ModelError) as err:
        check_fits(folder, devices=[_Device(600_000)], **kw)
    assert str(err.value) == (f"{folder}: its weights take 0.7 MiB at --dtype float32, 0.2 MiB more than the 0.6 MiB "
                              "the device holds; --dtype bfloat16 would take 0.4 MiB")
    check_fits(folder, devices=[_Device(800_000)], **kw)  # fits
    check_fits(folder, devices=[_Device(None)], **kw)  # the CPU: no memory stats
    check_fits(folder, devices=[_Device(600_000)], fsdp=2, **kw)  # half each
    check_fits(folder / "tokenizer", devices=[_Device(10)], **kw)  # no weights: the loader says so itself


def test_load_refuses_before_reading_a_weight(monkeypatch):
    """preheat.load on a device too small for the built-in model: one line, and no weight read."""
    import preheat
    from preheat.models import safetensors_files

    monkeypatch.setattr(footprint, "_device_limit", lambda device: 1024)
    monkeypatch.setattr(safetensors_files.TensorInfo, "read", lambda *a, **k: pytest.fail("a weight was read"))
    with pytest.raises(ModelError, match=r"more than the 0.0 MiB the device holds"):
        preheat.load(None, cache="off")


def test_linear_weights_layers_store_norm_modules_linears_low_too(tmp_path):
    (tmp_path / "t").mkdir()
    save_file({"norm1.linear.weight": np.zeros((64, 64), np.float32)},
              str(tmp_path / "t" / "diffusion_pytorch_model.safetensors"))
    kw = dict(weights_dtype="float8_e4m3fn")
    assert weight_footprint(tmp_path / "t", "bfloat16", **kw).total == 2 * 4096  # AdaLN's Linear: kept in dtype
    assert weight_footprint(tmp_path / "t", "bfloat16", weights_layers="linear", **kw).total == 4096


def test_int8_weights_take_a_byte_and_a_scale_per_output_channel(folder):
    """The unet's inner proj_in (256x256) and conv (64x64x3x3) are stored low; its top-level proj_in,
    norm and F8_E4M3 weight are not changed by it."""
    fp8 = weight_footprint(folder, "bfloat16", weights_dtype="float8_e4m3fn")
    int8 = weight_footprint(folder, "bfloat16", weights_dtype="int8")
    assert int8.parts["unet"] == fp8.parts["unet"] + 4 * (256 + 64)
    assert int8.dtypes == {"unet": "int8 + bfloat16", "vae": "float32 (force_upcast)"}
    with pytest.raises(ModelError, match="weights_dtype 'int4'"):
        weight_footprint(folder, "bfloat16", weights_dtype="int4")


def test_offloaded_encoders_count_while_prompts_are_encoded(folder):
    off = weight_footprint(folder, "bfloat16", offload_encoders=True)
    assert off.peak == off.total + 128616 == weight_footprint(folder, "bfloat16").total
    assert off.fits(off.peak) and not off.fits(off.peak - 1)  # the encode stage must fit
    assert not off.fits(off.total + 1) and not weight_footprint(folder, "bfloat16").fits(off.peak)  # 75% at rest
    plan = off.plan(400_000, "one TPU chip")
    assert plan[0].split() == ["unet", "device", "bfloat16", "0.2", "MiB"]
    assert plan[1].split()[:5] == ["text_encoder", "host", "->", "device", "bfloat16"]
    assert plan[1].endswith("(streamed while prompts are encoded, 0.1 MiB at once)")  # no numbered blocks: all
    assert plan[-2].startswith("denoising: 0.3 MiB on one TPU chip of 0.4 MiB (70%): 0.1 MiB left")
    assert plan[-1] == "encoding: 0.4 MiB on one TPU chip (102%): 0.0 MiB more than it holds"
    with pytest.raises(ModelError, match="while prompts are encoded at --dtype bfloat16 --encoders-on offload"):
        check_fits(folder, dtype="bfloat16", variant=None, weights_dtype=None, offload_encoders=True,
                   devices=[_Device(400_000)])


def test_fitting_names_the_first_option_that_fits(folder):
    kw = dict(dtype="float32")
    assert fitting(folder, 600_000, **kw).options() == "--dtype bfloat16"
    assert fitting(folder, 420_000, **kw).options() == "--dtype bfloat16 --weights-dtype int8"
    assert fitting(folder, 420_000, prefer="float8_e4m3fn", **kw).options() == "--dtype bfloat16 --weights-dtype float8_e4m3fn"
    assert fitting(folder, 100_000, **kw) is None


def test_host_encoders_are_counted_in_float32_on_a_cpu_without_bf16_products(tmp_path, monkeypatch):
    """On a TPU v5e VM's AMD host the encoders are kept and run in float32 (``platforms.host_compute_dtype``):
    twice the host memory, the chip's share unchanged."""
    script = load_script("flux_memory_plan")
    script.write_flux_dev(tmp_path)
    vm_host_cpu(monkeypatch)
    f32 = weight_footprint(tmp_path, "bfloat16", weights_dtype="int8", weights_layers="linear", encoders_on="host")
    monkeypatch.setenv("PREHEAT_HOST_DTYPE", "as-loaded")
    bf16 = weight_footprint(tmp_path, "bfloat16", weights_dtype="int8", weights_layers="linear", encoders_on="host")
    assert f32.host == {name: 2 * n for name, n in bf16.host.items()} and f32.parts == bf16.parts
    assert {f32.dtypes[name] for name in f32.host} == {"float32"}
    assert f32.plan(script.HBM, "one v5e chip")[-1].startswith("host memory: 18.20 GiB of text encoders")


def test_flux_dev_on_one_v5e_chip_fits_with_its_encoders_offloaded_or_on_the_host(tmp_path, monkeypatch):
    """scripts/flux_memory_plan.py's folder (the published configs' real headers, no data): docs/tpu.md's
    plan. The int8 transformer with every Linear in 8 bits rests in 72% of the chip; T5-XXL offloaded
    beside it streams a block at a time (its embedding and two blocks on the chip at once), so it fits
    while prompts are encoded, and that is the option ``fitting`` and the load's refusal name. With
    the encoders kept and run on the host (``encoders_on="host"``) nothing moves in at all.
    The host's encoders at the load's dtype here (a CPU with bf16 products; the next test: without)."""
    monkeypatch.setenv("PREHEAT_HOST_DTYPE", "as-loaded")
    script = load_script("flux_memory_plan")
    params = script.write_flux_dev(tmp_path)
    assert {k: round(v / 1e6) for k, v in params.items()} == {
        "transformer": 11901, "text_encoder_2": 4762, "text_encoder": 123, "vae": 84}  # the published sizes
    kw = dict(weights_layers="linear", offload_encoders=True)
    int8 = weight_footprint(tmp_path, "bfloat16", weights_dtype="int8", **kw)
    fp8 = weight_footprint(tmp_path, "bfloat16", weights_dtype="float8_e4m3fn", **kw)
    assert 0 < int8.parts["transformer"] - fp8.parts["transformer"] < 16 << 20  # the per-channel scales
    assert int8.fits(script.HBM) and 0.71 < int8.total / script.HBM < 0.73
    block = 4096 * 4096 * 2 * 4 + 3 * 4096 * 10240 * 2  # a T5-XXL block in bfloat16
    embedding = 32128 * 4096 * 2
    assert 0 < int8.streamed["text_encoder_2"] - embedding - 2 * block < 2**20  # + the norms, the position bias
    assert int8.offloaded["text_encoder_2"] > 8.8 * 2**30 and 1.0 < (int8.peak - int8.total) / 2**30 < 1.1
    assert fitting(tmp_path, script.HBM, dtype="bfloat16").options() == int8.options() == (
        "--dtype bfloat16 --weights-dtype int8 --weights-layers linear --encoders-on offload")
    # the whole encoders moved in (scan off: no stack to stream) would not fit: the plan's lower bound is the stream
    assert int8.total + sum(int8.offloaded.values()) - script.HBM > 4.7 * 2**30
    host = weight_footprint(tmp_path, "bfloat16", weights_dtype="int8", weights_layers="linear", encoders_on="host")
    assert set(host.host) == {"text_encoder", "text_encoder_2"} and not host.offloaded
    assert host.fits(script.HBM) and host.peak == host.total == int8.total < int8.peak  # nothing moves in to encode
    assert 9.5e9 < sum(host.host.values()) < 9.8e9  # T5-XXL and CLIP-L in bfloat16, in host memory
    plan = host.plan(script.HBM, "one v5e chip")
    assert [line.split()[:2] for line in plan if "host" in line.split()[1:2]] == [["text_encoder_2", "host"],
                                                                                   ["text_encoder", "host"]]
    assert plan[-1].startswith("host memory: 9.10 GiB of text encoders") and "once per call" in plan[-1]
    with pytest.raises(ModelError, match=r"take 23\.53 GiB at --dtype bfloat16 --weights-dtype int8, 7\.78 GiB more "
                                         r".*--weights-layers linear --encoders-on offload would take 12\.47 GiB"):
        check_fits(tmp_path, dtype="bfloat16", variant=None, weights_dtype="int8", offload_encoders=False,
                   devices=[_Device(script.HBM)])
    for where in ("offload", "host"):  # the load accepts either
        check_fits(tmp_path, dtype="bfloat16", variant=None, weights_dtype="int8", weights_layers="linear",
                   offload_encoders=False, encoders_on=where, devices=[_Device(script.HBM)])
