"""``preheat.torch.compile`` on diffusers' own pipelines: regional compilation, with its artifacts
restored from and stored to preheat's cache, in fresh processes (as after a pod restart)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

import preheat  # noqa: E402
import preheat.torch  # noqa: E402
from preheat.backends.torch.compiled import signature  # noqa: E402
from preheat.errors import InvalidArgumentError  # noqa: E402
from tests._support.numerics import px_diff
from tests._support.torch_models import run_child  # noqa: E402
from tests._support.flow_fixtures import save_tiny_flow_model  # noqa: E402

# Inductor fuses ops and reorders float32 reductions; over two Flux steps and the VAE, compiled and
# eager images (floats in [0, 1]) differ by rounding only: a few 1e-6 here, bounded at 1e-4.
COMPILED_VS_EAGER_ATOL = 1e-4


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    return save_tiny_flow_model(tmp_path_factory.mktemp("flux") / "flux", kind="flux-dev")


# ------------------------------------------------------------------ without compiling


def test_regions_declared_by_the_model_are_used():
    from diffusers import FluxTransformer2DModel

    model = FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                                   attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                   pooled_projection_dim=16, axes_dims_rope=[2, 2, 4])
    assert preheat.torch.region_classes(model) == ["FluxTransformerBlock", "FluxSingleTransformerBlock"]


def test_regions_are_found_where_the_model_declares_none():
    """SD3 declares no _repeated_blocks: its ModuleList of JointTransformerBlock is found."""
    from diffusers import SD3Transformer2DModel

    model = SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8,
                                  num_attention_heads=2, caption_projection_dim=16, joint_attention_dim=16,
                                  pooled_projection_dim=16, out_channels=4, pos_embed_max_size=8)
    assert not getattr(model, "_repeated_blocks", None)
    assert preheat.torch.region_classes(model) == ["JointTransformerBlock"]


class _Inner(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.linear(x)


class _Outer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = torch.nn.ModuleList([_Inner(), _Inner()])

    def forward(self, x):
        for m in self.inner:
            x = m(x)
        return x


class _Net(torch.nn.Module):
    def __init__(self, blocks: int = 3):
        super().__init__()
        self.blocks = torch.nn.ModuleList([_Outer() for _ in range(blocks)])
        self.head = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.ReLU()])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def test_found_regions_are_the_outermost_repeated_class():
    assert preheat.torch.region_classes(_Net()) == ["_Outer"]  # _Inner repeats too, inside _Outer
    assert preheat.torch.region_classes(_Net(blocks=1)) == ["_Inner"]  # a list of one does not repeat


@pytest.mark.parametrize("kwargs, message", [
    (dict(mode="aot", dynamic=True), "static-shape packages"),
    (dict(mode="everything"), "not supported"),
    (dict(dynamic="yes"), "True or False"),
])
def test_bad_arguments_are_one_line_errors(kwargs, message):
    with pytest.raises(InvalidArgumentError, match=message):
        preheat.torch.compile(_Net(), **kwargs)


def test_what_cannot_be_compiled_is_refused():
    with pytest.raises(InvalidArgumentError, match="pass a diffusers pipeline or a torch.nn.Module"):
        preheat.torch.compile("a pipeline")
    with pytest.raises(InvalidArgumentError, match="no repeated blocks"):
        preheat.torch.compile(torch.nn.Linear(2, 2))


def test_recompiling_with_other_settings_is_refused():
    net = preheat.torch.compile(_Net(), cache="off")
    assert preheat.torch.compile(net, cache="off") is net  # same settings: nothing to do
    with pytest.raises(InvalidArgumentError, match="already compiled"):
        preheat.torch.compile(net, mode="full", cache="off")


def test_signature_keys_shapes_or_only_ranks():
    x = torch.zeros(2, 3, 1)
    assert signature(x) == {"shape": [2, 3, 1], "dtype": "float32", "device": "cpu"}
    assert signature(x, dynamic=True)["shape"] == ["s", "s", 1]  # Dynamo specialises sizes 0 and 1
    assert "stride" in signature(x.transpose(0, 1))
    assert signature({"t": x, "n": None, "scale": 3.5}) == {"t": signature(x), "n": None, "scale": 3.5}


def test_explain_says_which_torch_key_fields_differ(tmp_path):
    """cache="explain" compiles nothing (the call runs eagerly) and says, per key, whether an entry
    would serve it and, if not, which fields differ from the nearest entry."""
    from preheat.backends.torch.compile_cache import TorchCompiler
    from preheat.backends.torch.compiled import compile_with
    from preheat.cache.keys import key_of
    from preheat.cache.entries import publish_entry

    x = torch.randn(2, 4)

    def explained() -> dict:
        net, compiler = _Net().eval(), TorchCompiler(root=tmp_path, mode="explain")
        with torch.no_grad():
            eager = net(x)
            compile_with(net, "regional", False, compiler)
            torch.testing.assert_close(net(x), eager, rtol=0, atol=0)  # eager: the very same numbers
        (event,) = compiler.events
        return event

    first = explained()
    assert first["explain"] == "miss" and first["nearest"] is None
    fields = first["fields"]
    kind_dir = tmp_path / "compile" / "torch"
    other = json.loads(json.dumps(fields))
    other.update(torch="0.0.1", triton="9.9")
    other["shapes"]["args"][0]["shape"] = [3, 4]
    publish_entry(kind_dir, key_of(other), {"mega.bin": b"x"}, other)
    missed = explained()
    assert missed["explain"] == "miss" and missed["differs"] == ["shapes.args", "torch", "triton"]
    publish_entry(kind_dir, key_of(fields), {"mega.bin": b"x"}, fields)
    assert explained()["explain"] == "hit"


class _ConvBlock(torch.nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv = torch.nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x):
        return torch.nn.functional.silu(self.conv(x)) + x


class _ConvNet(torch.nn.Module):
    """Two repeated conv blocks: an image model in miniature, whose H and W are its resolution."""

    def __init__(self, channels: int = 4):
        super().__init__()
        self.blocks = torch.nn.ModuleList([_ConvBlock(channels), _ConvBlock(channels)])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def test_dynamic_serves_a_second_resolution_without_a_compile():
    """mode="regional", dynamic=True: the first resolution compiles the block graph once and stores
    one entry; a second resolution (and aspect ratio) runs under error_on_recompile, with no new
    entry. The first is 4x4 with 4 channels: with duck shapes on, H and W would share the channel
    count's symbol, be specialised to 4 by the conv weight, and the second size would recompile
    (the control below: plain torch.compile(dynamic=True) does)."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    net = _ConvNet().eval()
    small, other = torch.randn(1, 4, 4, 4), torch.randn(1, 4, 6, 10)
    with torch.no_grad():
        eager_small, eager_other = net(small), net(other)
        preheat.torch.compile(net, mode="regional", dynamic=True)
        torch._dynamo.reset()
        counters.clear()
        y_small = net(small)
        assert counters["frames"]["total"] == 1  # one graph for the block class, both instances
        with torch._dynamo.config.patch(error_on_recompile=True):
            y_other = net(other)
        assert counters["frames"]["total"] == 1
    (event,) = preheat.torch.events(net)
    assert event["layer"] == "none" and event["store"] == "written"
    (entry,) = _entries(Path(os.environ["PREHEAT_HOME"]))
    fields = json.loads((entry / "manifest.json").read_text())["fields"]
    assert fields["shapes"]["args"][0]["shape"] == [1, "s", "s", "s"]
    torch.testing.assert_close(y_small, eager_small, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(y_other, eager_other, atol=1e-5, rtol=1e-5)

    # A restart (Dynamo's caches emptied, a new instance) whose first size was never compiled:
    # the one entry serves it, and Inductor compiles no graph.
    torch._dynamo.reset()
    counters.clear()
    again = preheat.torch.compile(_ConvNet().eval(), mode="regional", dynamic=True)
    again.load_state_dict(net.state_dict())
    unseen = torch.randn(1, 4, 5, 7)
    with torch.no_grad():
        torch.testing.assert_close(again(unseen), eager_net(net, unseen), atol=1e-5, rtol=1e-5)
    (event,) = preheat.torch.events(again)
    assert event["layer"] == "mega" and counters["inductor"].get("fxgraph_cache_miss", 0) == 0

    control = _ConvBlock(4).eval()  # what duck shapes do to the same sizes
    compiled = torch.compile(control, dynamic=True, backend="eager")  # Dynamo's guards alone decide
    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad():
        compiled(small)
        compiled(other)
    assert counters["frames"]["total"] == 2


def eager_net(net: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``net``'s blocks run eagerly (their classes' own forward), whatever was compiled."""
    for block in net.blocks:
        x = type(block).forward(block, x)
    return x


def test_dynamic_and_static_are_different_keys_and_explain_says_why(tmp_path):
    """An entry compiled with dynamic=False does not serve dynamic=True (nor the reverse): the key
    holds the setting and duck shapes, and the input signature keeps sizes or only ranks."""
    from preheat.backends.torch.compile_cache import TorchCompiler
    from preheat.backends.torch.compiled import compile_with
    from preheat.cache.keys import key_of
    from preheat.cache.entries import publish_entry

    x = torch.randn(1, 4, 8, 8)

    def explained(dynamic: bool) -> dict:
        net, compiler = _ConvNet().eval(), TorchCompiler(root=tmp_path, mode="explain")
        with torch.no_grad():
            compile_with(net, "regional", dynamic, compiler)
            net(x)
        (event,) = compiler.events
        return event

    static = explained(False)
    options = static["fields"]["compile_options"]
    assert (options["dynamic"], options["duck_shape"]) == (False, True)
    publish_entry(tmp_path / "compile" / "torch", key_of(static["fields"]), {"mega.bin": b"x"}, static["fields"])
    dynamic = explained(True)
    assert dynamic["explain"] == "miss" and dynamic["key"] != static["key"]
    assert dynamic["differs"] == ["compile_options.duck_shape", "compile_options.dynamic", "shapes.args"]
    assert explained(False)["explain"] == "hit"


@pytest.mark.slow
def test_full_dynamic_compiles_one_entry_for_every_batch(tmp_path, monkeypatch):
    """mode="full", dynamic=True: batch 2 compiles and stores one entry whose signature keeps
    only ranks; batch 3 then runs under error_on_recompile with no new entry."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch.manual_seed(0)
    net = _Net().eval()
    x2, x3 = torch.randn(2, 4), torch.randn(3, 4)
    with torch.no_grad():
        eager2, eager3 = net(x2), net(x3)
        preheat.torch.compile(net, mode="full", dynamic=True)
        y2 = net(x2)
        with torch._dynamo.config.patch(error_on_recompile=True):
            y3 = net(x3)
    (event,) = preheat.torch.events(net)
    assert event["layer"] == "none" and event["store"] == "written"
    (entry,) = _entries(Path(os.environ["PREHEAT_HOME"]))
    fields = json.loads((entry / "manifest.json").read_text())["fields"]
    assert fields["shapes"]["args"][0]["shape"] == ["s", "s"] and fields["compile_options"]["duck_shape"] is False
    torch.testing.assert_close(y2, eager2, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(y3, eager3, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------ fresh processes

_CHILD = r"""
import json, sys
import numpy as np, torch
from torch._dynamo.utils import counters
from tests._support.torch_models import count_cpp_builds
import preheat.torch
from diffusers import DiffusionPipeline

folder, flags = sys.argv[1], sys.argv[2:]
mode = next((f.split("=", 1)[1] for f in flags if f.startswith("mode=")), "regional")
pipe = DiffusionPipeline.from_pretrained(folder)
pipe.set_progress_bar_config(disable=True)

def run(prompt="a photo of a cat"):
    with torch.no_grad():
        return pipe(prompt, height=32, width=32, num_inference_steps=2, output_type="np",
                    generator=torch.Generator("cpu").manual_seed(0)).images

result = {}
if "eager" in flags:
    result["eager"] = run().tolist()
builds = count_cpp_builds()
preheat.torch.compile(pipe, mode=mode)
counters.clear()
result["image"] = run().tolist()
result["events"] = preheat.torch.events(pipe)
result["cpp_builds"] = len(builds)
result["counters"] = {k: dict(v) for k, v in counters.items() if k in ("frames", "aot_autograd", "inductor")}
if "served" in flags:  # the served signature again (other prompt, same shapes): no recompile allowed
    with torch._dynamo.config.patch(error_on_recompile=True):
        result["served"] = run("another prompt").tolist()
print("RESULT " + json.dumps(result, default=str))
"""


def _child(model: Path, home: Path, inductor_dir: Path, *flags: str) -> dict:
    return run_child(_CHILD, model, home, inductor_dir, *flags)


def _entries(home: Path) -> list[Path]:
    kind = home / "compile" / "torch"
    return sorted(p for p in kind.iterdir() if p.is_dir() and not p.name.startswith(".")) if kind.is_dir() else []


@pytest.fixture(scope="module")
def cold(flux, tmp_path_factory):
    """Process 1, on an empty cache: an eager run, then regional compile, store and a compiled run."""
    base = tmp_path_factory.mktemp("cold")
    result = _child(flux, base / "home", base / "inductor", "eager")
    return base, result


def _copy_home(cold_base: Path, tmp_path: Path) -> Path:
    home = tmp_path / "home"
    shutil.copytree(cold_base / "home", home)
    return home


@pytest.mark.slow
def test_cold_start_compiles_the_blocks_stores_them_and_matches_eager(cold):
    base, result = cold
    (event,) = result["events"]
    assert event["layer"] == "none" and event["miss"] == "no entries yet" and event["store"] == "written"
    assert event["kernels"] > 0 and result["cpp_builds"] > 0
    assert result["counters"]["inductor"].get("fxgraph_cache_miss", 0) > 0  # the counters do see compiles
    np.testing.assert_allclose(np.array(result["image"], np.float32), np.array(result["eager"], np.float32),
                               atol=COMPILED_VS_EAGER_ATOL, rtol=0)
    (entry,) = _entries(base / "home")
    fields = json.loads((entry / "manifest.json").read_text())["fields"]
    assert fields["compile_options"]["scope"] == "regional" and fields["compile_options"]["dynamic"] is False
    assert fields["compile_options"]["regions"] == ["FluxTransformerBlock", "FluxSingleTransformerBlock"]
    assert fields["model"]["kind"].endswith("FluxTransformer2DModel")
    assert fields["shapes"]["kwargs"]["hidden_states"]["shape"] == [1, 64, 16]  # 32 px: 16x16 latent, 2x2 packed


@pytest.mark.slow
def test_warm_start_in_a_fresh_process_compiles_nothing(cold, flux, tmp_path):
    """A new process with an empty Inductor cache folder (a new pod): preheat's entry is loaded,
    no AOTAutograd or Inductor graph is compiled, no C++ is built (not even a precompiled header),
    and the served signature runs again under error_on_recompile."""
    base, first = cold
    home = _copy_home(base, tmp_path)
    warm = _child(flux, home, tmp_path / "inductor", "served")
    (event,) = warm["events"]
    assert event["layer"] == "mega" and event["key"] == first["events"][0]["key"] and "quarantined" not in event
    counts = warm["counters"]
    assert counts["inductor"].get("fxgraph_cache_miss", 0) == 0, counts
    assert counts["aot_autograd"].get("autograd_cache_miss", 0) == 0, counts
    assert counts["inductor"].get("fxgraph_cache_hit", 0) == first["counters"]["inductor"]["fxgraph_cache_miss"]
    assert warm["cpp_builds"] == 0
    image = np.array(first["image"], np.float32)
    np.testing.assert_array_equal(np.array(warm["image"], np.float32), image)  # same program, same numbers
    assert np.array(warm["served"]).shape == image.shape


@pytest.mark.slow
def test_truncated_entry_is_quarantined_and_recompiled(cold, flux, tmp_path):
    base, first = cold
    home = _copy_home(base, tmp_path)
    (entry,) = _entries(home)
    mega = entry / "mega.bin"
    mega.write_bytes(mega.read_bytes()[:100])
    # process 1's Inductor folder: the recompile reuses torch's own local caches (quicker)
    again = _child(flux, home, base / "inductor")
    (event,) = again["events"]
    assert event["layer"] == "none" and "mega.bin has 100 bytes" in event["quarantined"]
    assert event["store"] == "written"
    assert len(list((home / "quarantine").iterdir())) == 1
    np.testing.assert_array_equal(np.array(again["image"], np.float32), np.array(first["image"], np.float32))
    (entry,) = _entries(home)  # a new, valid entry under the same key
    assert entry.name == event["key"] == first["events"][0]["key"]


@pytest.mark.slow
def test_load_backend_torch_compile_regional(cold, flux, tmp_path, monkeypatch):
    """preheat.load(..., backend="torch", compile="regional"): the same entry serves diffusers'
    FluxPipeline behind preheat's call API; images agree with the eager torch backend."""
    base, _ = cold
    monkeypatch.setenv("PREHEAT_HOME", str(_copy_home(base, tmp_path)))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    call = dict(prompt="a photo of a cat", height=32, width=32, steps=2, seed=0)
    pipe = preheat.load(flux, backend="torch", compile="regional")
    pixels = pipe.generate(**call)
    assert pipe.last.cache_layer == "mega", pipe.compiler.events
    pipe.generate(**call)
    assert pipe.last.cache_layer == "memory"
    eager = preheat.load(flux, backend="torch").generate(**call)
    assert px_diff(pixels, eager).max() <= 1


@pytest.mark.slow
def test_cache_explain_backend_torch(cold, flux, tmp_path, monkeypatch):
    """`preheat cache explain --backend torch`: a hit where process 1 stored the blocks; a miss
    naming the input signature at another size."""
    from click.testing import CliRunner

    from preheat.cli.cache import explain_command

    base, first = cold
    home = _copy_home(base, tmp_path)
    before = _entries(home)
    monkeypatch.setenv("PREHEAT_HOME", str(home))
    args = [str(flux), "--backend", "torch", "--compile", "regional", "--prompt", "a photo of a cat", "--height", "32"]

    def explained(width: str) -> list[str]:
        result = CliRunner().invoke(explain_command, [*args, "--width", width])
        assert result.exit_code == 0, result.output
        return [line for line in result.stdout.splitlines() if line.startswith(("hit:", "miss:"))]  # stdout: no progress bars

    (line,) = explained("32")
    assert line.startswith(f"hit: entry {first['events'][0]['key'][:12]}"), line
    (line,) = explained("64")
    assert line.startswith("miss:") and "differs in: shapes.kwargs" in line, line
    assert _entries(home) == before and not (home / "quarantine").exists()  # explaining writes nothing


@pytest.fixture(scope="module")
def flux_tuned(tmp_path_factory):
    """Same architecture as ``flux``, other weights: a fine-tune."""
    return save_tiny_flow_model(tmp_path_factory.mktemp("flux-tuned") / "flux", kind="flux-dev", seed=1)


@pytest.mark.slow
def test_aot_blocks_cold_then_warm_then_a_fine_tune(flux, flux_tuned, tmp_path):
    """mode="aot": one weight-free AOTInductor package per block class, built and stored by process
    1; process 2 (empty Inductor folder) loads them and runs no Dynamo, no Inductor, no compiler;
    process 3 runs a fine-tune on the same packages, with its own weights."""
    home = tmp_path / "home"
    cold = _child(flux, home, tmp_path / "inductor-1", "eager", "mode=aot")
    assert [e["layer"] for e in cold["events"]] == ["none", "none"]  # one block of each class
    assert all(e["store"] == "written" for e in cold["events"]) and len(_entries(home)) == 2
    image = np.array(cold["image"], np.float32)
    np.testing.assert_allclose(image, np.array(cold["eager"], np.float32), atol=COMPILED_VS_EAGER_ATOL, rtol=0)

    warm = _child(flux, home, tmp_path / "inductor-2", "mode=aot")
    assert [e["layer"] for e in warm["events"]] == ["aot", "aot"]
    assert warm["cpp_builds"] == 0 and warm["counters"].get("frames", {}).get("total", 0) == 0
    np.testing.assert_array_equal(np.array(warm["image"], np.float32), image)

    tuned = _child(flux_tuned, home, tmp_path / "inductor-3", "eager", "mode=aot")
    assert [e["layer"] for e in tuned["events"]] == ["aot", "aot"] and len(_entries(home)) == 2
    tuned_image = np.array(tuned["image"], np.float32)
    np.testing.assert_allclose(tuned_image, np.array(tuned["eager"], np.float32), atol=COMPILED_VS_EAGER_ATOL, rtol=0)
    assert np.abs(tuned_image - image).max() > 0.01  # its own weights, not the first model's


@pytest.fixture(scope="module")
def kontext(tmp_path_factory):
    return save_tiny_flow_model(tmp_path_factory.mktemp("kontext") / "kontext", kind="flux-kontext")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["regional", "aot"])
def test_compile_on_a_kontext_pipeline_matches_eager_then_loads_its_entries(kontext, mode, tmp_path, monkeypatch):
    """preheat.torch.compile (``load(..., backend="torch", compile=MODE)``) on diffusers'
    FluxKontextPipeline: the reference's tokens ride beside the noise's, so the blocks see a
    sequence twice as long as Flux's. The compiled image agrees with eager torch; a second pipeline
    on the same root loads the stored blocks instead of compiling them."""
    from tests._support.flow_fixtures import picture

    monkeypatch.setenv("PREHEAT_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    call = dict(prompt="a red fox", image=picture(32, 32, seed=2), image_resize="none", steps=2, seed=0,
                guidance=3.0)
    compiled = preheat.load(kontext, backend="torch", compile=mode)
    pixels = compiled.generate(**call)
    first = list(compiled.compiler.events)
    assert first and all(e["layer"] == "none" and e["store"] == "written" for e in first), first
    eager = preheat.load(kontext, backend="torch").generate(**call)
    assert pixels.shape == eager.shape == (1, 32, 32, 3)
    assert px_diff(pixels, eager).max() <= 1
    again = preheat.load(kontext, backend="torch", compile=mode)
    np.testing.assert_array_equal(again.generate(**call), pixels)
    assert [e["layer"] for e in again.compiler.events] == [{"regional": "mega", "aot": "aot"}[mode]] * len(first)


def test_load_regional_is_refused_for_a_unet2d_model(tmp_path):
    from tests._support.torch_models import MICRO
    from tests._support.reference import save_tiny_pipeline

    with pytest.raises(InvalidArgumentError, match="text-to-image pipelines"):
        preheat.load(save_tiny_pipeline(tmp_path / "micro", config=MICRO), backend="torch", compile="regional")


def test_bench_coldstart_torch_gives_every_child_a_new_inductor_folder(monkeypatch, tmp_path):
    """The rows and what each child is told (the measurement itself is `preheat bench coldstart`)."""
    from preheat.bench import coldstart

    calls = []

    def fake_child(model, home, n, steps, cache, extra_env=None, args=()):
        calls.append(dict(home=Path(home).name, env=extra_env, args=args))
        compiled = "regional" in args
        warm = compiled and Path(home).name.startswith("warm-home") and len(calls) > 1
        return {"import_s": 1.0, "weights_s": 1.0, "warm_run_s": 1.0, "first_run_s": 1.0,
                "trace_lower_s": 1.0 if compiled else 0.0, "compile_or_load_s": 0.5 if warm else (9.0 if compiled else 0.0),
                "cache_layer": "mega" if warm else "none",
                "process_start_to_first_image_s": 5.0 if warm else (14.0 if compiled else 4.0)}

    monkeypatch.setattr(coldstart, "run_child", fake_child)
    result = coldstart.bench_coldstart_torch(str(tmp_path), 1, 2, 2, tmp_path)
    assert list(result["rows"]) == ["eager (no cache)", "regional cold", "regional warm"]
    assert len(calls) == 7  # the priming run, then three per repeat
    assert len({c["env"]["TORCHINDUCTOR_CACHE_DIR"] for c in calls}) == 7
    assert all(c["args"][-4:] == ("--backend", "torch", "--compile", "none" if c["home"].startswith("eager")
                                  else "regional") for c in calls)
    assert result["rows"]["regional warm"]["layers"] == ["mega"]
    assert result["goals"]["warm_vs_cold_start"] == pytest.approx(1 - 5 / 14)
    assert "Replicate" in coldstart.markdown(result)
    assert result["goals"]["warm_over_eager_floor"] == pytest.approx(5 / 3)  # eager floor: 1 + 1 + 1 s


def test_bench_coldstart_torch_measures_several_modes_against_one_eager_row(monkeypatch, tmp_path):
    from preheat.bench import coldstart

    calls = []

    def fake_child(model, home, n, steps, cache, extra_env=None, args=()):
        mode, name = args[-1], Path(home).name
        calls.append((name, mode))
        warm = name.startswith("warm-home") and (name, mode) in calls[:-1]
        start = {"none": 4.0, "regional": 5.0 if warm else 14.0, "aot": 4.5 if warm else 20.0}[mode]
        return {"import_s": 1.0, "weights_s": 1.0, "warm_run_s": 1.0, "first_run_s": 1.0, "trace_lower_s": 0.0,
                "compile_or_load_s": 0.0 if mode == "none" else (0.5 if warm else 9.0),
                "cache_layer": "none", "process_start_to_first_image_s": start}

    monkeypatch.setattr(coldstart, "run_child", fake_child)
    result = coldstart.bench_coldstart_torch(str(tmp_path), 1, 2, 1, tmp_path, ("regional", "aot"))
    assert list(result["rows"]) == ["eager (no cache)", "regional cold", "regional warm", "aot cold", "aot warm"]
    assert len(calls) == 2 + 5  # one priming run per mode, then five rows
    by_mode = result["goals_by_mode"]
    assert by_mode["aot"]["warm_vs_cold_start"] == pytest.approx(1 - 4.5 / 20)
    assert by_mode["aot"]["warm_over_eager_floor"] == pytest.approx(4.5 / 3)
    assert result["goals"] == by_mode["regional"]
    assert "aot: warm vs cold" in coldstart.markdown(result)
