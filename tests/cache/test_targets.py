"""`preheat warm --target`: GPU programs compiled on this CPU-only machine (jax-cuda13-plugin's
deviceless compiles; no GPU, no driver), keyed as a pod with that GPU keys its own.

The independent reference for the key is XLA itself: a "pod" here is the compile-only device
of the same description, whose description the pod path asks XLA for
(``get_topology_for_devices(...).target_config``, re-emitted by XLA, not the file we shipped).
The attention choice is checked in the compiled HLO for the H200.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from click.testing import CliRunner

import preheat
from preheat import platforms
from preheat.cache import keys, targets
from preheat.platforms import _gpu
from preheat.cache.compile import JaxCompiler, TargetCompiler, on_device
from preheat.cache.keys import key_fields, key_of
from preheat.cache.entries import UNRUNNABLE, unrunnable, unrunnable_cudnn_calls
from preheat.cache.targets import resolve_target, target_device
from preheat.cli import main
from preheat.errors import TargetError
from tests._support.tiers import gpu_only

# every test here compiles for a GPU with the CUDA plugin, which only make test-slow installs (the
# test-gpu extra): the whole module runs there, where the plugin is
pytestmark = [pytest.mark.skipif(not any(k.startswith("jax-cuda") for k in platforms.cuda_versions()),
                                 reason="needs the test-gpu extra's jax-cuda13-plugin (make test-slow installs it)"),
              gpu_only]


def _manifests(root: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((root / "compile" / "jax").glob("*/manifest.json"))]


def _warm(*args: str) -> tuple[int, str]:
    """The exit code, and stdout (``--json``: the result alone) where it exits 0, else all it printed."""
    result = CliRunner().invoke(main, ["warm", *args])
    return result.exit_code, result.stdout if result.exit_code == 0 else result.output


def _root() -> Path:
    from preheat.cache.root import resolve_root

    return resolve_root().path


SIGNING_KEY = "target-test-" + "0123456789abcdef" * 2


@pytest.fixture(scope="module")
def h200_warm(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path, Path]:
    """``preheat warm --target h200`` of the built-in model in a fresh process, pushing to a folder
    store: (the process, its cache root, the store). A CPU builder as CI runs it: JAX_PLATFORMS
    unset, the CUDA plugin installed and no driver. One deviceless compile for the module: the
    fresh-process test checks the process, the pod test goes on from its root and store."""
    base = tmp_path_factory.mktemp("h200-warm")
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env.update(PREHEAT_HOME=str(base / "home"), PREHEAT_CACHE_URL=str(base / "fleet"),
               PREHEAT_CACHE_SIGNING_KEY=SIGNING_KEY)
    proc = subprocess.run([sys.executable, "-m", "preheat", "warm", "--target", "h200", "--max-batch-size", "1",
                           "--guidance", "off", "--dtype", "bfloat16", "--json"],
                          env=env, capture_output=True, text=True, timeout=600)
    return proc, base / "home", base / "fleet"


@gpu_only  # a deviceless CUDA compile (make test-slow)
def test_warm_target_h200_writes_gpu_entries_and_a_cpu_run_keeps_its_own(h200_warm, monkeypatch):
    proc, home, store = h200_warm  # the warm job's root, copied into this test's root
    assert proc.returncode == 0, proc.stderr[-2000:]
    shutil.copytree(home, _root(), dirs_exist_ok=True)
    monkeypatch.setenv("PREHEAT_CACHE_URL", str(store))
    monkeypatch.setenv("PREHEAT_CACHE_SIGNING_KEY", SIGNING_KEY)
    result = json.loads(proc.stdout)
    assert [row["cache_layer"] for row in result["signatures"]] == ["none"] and result["pushed"] is True
    assert "unrunnable" not in result["signatures"][0] and "cuDNN" not in proc.stderr
    gpu = _manifests(_root())
    assert len(gpu) == 1
    entry = gpu[0]
    assert entry["target"]["name"] == "h200" and entry["target"]["device"] == "NVIDIA H200 141GB HBM3e"
    assert entry["autotuned"] is False and UNRUNNABLE not in entry  # convolutions as GEMMs (conv.py)
    assert entry["fields"]["platform"] == "gpu" and entry["fields"]["gpu"]["compute_capability"] == [9, 0]
    assert "device_kind" not in entry["fields"]  # never the marketing name
    from preheat.cache.remote import open_store

    assert open_store(str(store)).has("jax", entry["key"])  # pushed to the fleet store, like any entry

    # the same root, a CPU process: it never picks the GPU entry, compiles its own, then hits it
    monkeypatch.delenv("PREHEAT_CACHE_URL")
    for expected in ("none", "aot"):
        pipe = preheat.load(None, dtype="bfloat16")
        pipe.generate(1, steps=1, seed=0)
        assert pipe.last.cache_layer == expected
    kinds = sorted(m["fields"]["platform"] for m in _manifests(_root()))
    assert kinds == ["cpu", "gpu"]

    # a warm in this process finds the warm job's entry (no compile), and `cache ls` names each entry's target
    code, out = _warm("--target", "h200", "--max-batch-size", "1", "--guidance", "off", "--dtype", "bfloat16")
    assert code == 0 and "1 aot" in out, out
    listing = CliRunner().invoke(main, ["cache", "ls"], env={"COLUMNS": "250"}).output
    assert "h200 (not autotuned)" in listing and "local" in listing, listing
    explained = CliRunner().invoke(main, ["cache", "explain", "--n", "1", "--target", "h200"]).output
    assert "target h200 (not autotuned)" in explained, explained  # the nearest (or hit) entry's target


@gpu_only  # a deviceless CUDA compile (make test-slow)
def test_an_entry_a_gpu_cannot_run_is_named_and_a_pod_quarantines_it_unloaded(monkeypatch):
    """With XLA's convolutions forced (``PREHEAT_CONV=conv``), a deviceless compile leaves their
    cuDNN algorithms unchosen, and the H200 rejected such an executable at its first run
    (CUDNN_STATUS_BAD_PARAM; docs/gpu.md). ``warm --target`` says so, ``cache ls`` shows it, and a
    pod that finds the entry under its key moves it aside from its manifest alone -- no 6-s
    deserialisation, no failed run -- and compiles its own."""
    from preheat.cache import serialized

    monkeypatch.setenv("PREHEAT_CONV", "conv")
    result = CliRunner().invoke(main, ["warm", "--target", "h200", "--max-batch-size", "1", "--guidance", "off",
                                       "--dtype", "bfloat16", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["signatures"][0]["unrunnable"]
    assert "\nwarning: 1 of 1 signature(s) make cuDNN calls that a compile without the GPU cannot finish" \
        in result.stderr, result.stderr
    (entry,) = _manifests(_root())
    assert "cuDNN convolution(s) with no algorithm chosen" in entry[UNRUNNABLE]
    listing = CliRunner().invoke(main, ["cache", "ls"], env={"COLUMNS": "250"}).output
    assert "h200 (not autotuned; will not run: " in listing, listing

    monkeypatch.setattr(serialized, "deserialize_and_load", lambda *a, **k: pytest.fail("the entry was loaded"))
    record: dict = {}
    assert JaxCompiler(root=_root(), mode="full", remote=None)._load(entry["key"], entry["fields"], 0, record) is None
    assert "cuDNN convolution(s) with no algorithm chosen" in record["quarantined"], record
    assert _manifests(_root()) == [] and len(list((_root() / "quarantine").iterdir())) == 1


@gpu_only  # a deviceless CUDA compile (make test-slow)
def test_cudnn_calls_a_deviceless_compile_cannot_finish_are_named():
    """A deviceless compile leaves a cuDNN convolution's algorithm unchosen and builds no graph for
    cuDNN's fused attention: both are named, and a GEMM program has neither. Round 11's manifests
    (a count of convolutions under the older field) still read as unrunnable."""
    device = target_device(resolve_target("h200"))
    x = on_device(jax.ShapeDtypeStruct((1, 16, 16, 32), jnp.bfloat16), device)
    w = on_device(jax.ShapeDtypeStruct((3, 3, 32, 32), jnp.bfloat16), device)
    conv = jax.jit(lambda x, w: jax.lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                                             dimension_numbers=("NHWC", "HWIO", "NHWC")))
    assert unrunnable_cudnn_calls(conv.lower(x, w).compile()) == "1 cuDNN convolution(s) with no algorithm chosen"
    m = on_device(jax.ShapeDtypeStruct((256, 256), jnp.bfloat16), device)
    assert unrunnable_cudnn_calls(jax.jit(jnp.dot).lower(m, m).compile()) is None
    if platforms.cudnn_available():  # the builder's cuDNN package: jax lowers cuDNN's attention only with one
        q = on_device(jax.ShapeDtypeStruct((1, 64, 2, 64), jnp.bfloat16), device)
        fused = jax.jit(lambda q: jax.nn.dot_product_attention(q, q, q, implementation="cudnn"))
        assert unrunnable_cudnn_calls(fused.lower(q).compile()) == \
            "1 cuDNN graph call(s) (fused attention or fusion) with no graph built"
    assert unrunnable({"cudnn_convolutions_unchosen": 3}) == "3 cuDNN convolution(s) with no algorithm chosen"
    assert unrunnable({UNRUNNABLE: "why"}) == "why" and unrunnable({}) is None


@pytest.mark.slow  # three stages compiled for the H200 (~60 s): make test has the built-in model's
def test_warm_target_on_a_tiny_sd1_folder_compiles_every_program_of_the_call(tmp_path):
    from tests._support.sd_fixtures import save_tiny_sd
    from tests._support.unet_condition_fixtures import save_tiny_unet_condition

    folder = save_tiny_sd(tmp_path / "sd1", kind="sd1")
    # a one-level UNet, one layer per block: every program of the call is there, each compile
    # (deviceless, for an H200; three denoising loops) the shorter
    save_tiny_unet_condition(folder / "unet", kind="sd1", layers_per_block=1, block_out_channels=(32,),
                             down_block_types=("CrossAttnDownBlock2D",), up_block_types=("CrossAttnUpBlock2D",))
    # bf16: the UNet's 16-wide heads are ones cuDNN's fused attention takes on a device
    code, out = _warm(str(folder), "--target", "h200", "--max-batch-size", "1", "--guidance", "off",
                      "--dtype", "bfloat16")
    assert code == 0, out
    stages = sorted(m["fields"]["signature"].get("stage", "denoise") for m in _manifests(_root()))
    # the text encoder, the VAE decoder and image encoder, and a denoising loop each for text-to-image,
    # img2img and mask blending (the image variants a base SD folder serves)
    assert stages == ["decode", "denoise", "denoise", "denoise", "encode", "encode_image"], stages
    assert all(m["target"]["name"] == "h200" and m["fields"]["platform"] == "gpu" for m in _manifests(_root()))
    # attention and convolutions alike: no cuDNN call the compile could not finish (a GPU would not run it)
    assert [m.get(UNRUNNABLE) for m in _manifests(_root())] == [None] * 6


@gpu_only  # a deviceless CUDA compile (make test-slow)
def test_warm_target_works_in_a_fresh_process_with_no_platform_chosen(h200_warm):
    """A CPU builder as CI runs it: JAX_PLATFORMS unset, the CUDA plugin installed and no driver.
    The plugin's driver check would keep it from registering, and the deviceless topology with it
    (``topology not implemented for cuda``); the command itself must not need the variable."""
    proc, home, _ = h200_warm
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [row["cache_layer"] for row in json.loads(proc.stdout)["signatures"]] == ["none"]
    entries = _manifests(home)
    assert [m["fields"]["platform"] for m in entries] == ["gpu"], entries


def _pod(monkeypatch, device) -> None:
    """This process as a pod whose one GPU is ``device``: what jax.devices() reports there."""
    monkeypatch.setattr(keys.jax, "devices", lambda *a, **k: [device])
    _gpu._DEVICE_FIELDS.clear()


def test_the_deviceless_key_is_the_key_a_pod_with_that_gpu_computes(monkeypatch):
    pipe = preheat.load(None, cache="off")
    sig, args = pipe.prepare(2, steps=1)
    h200, a100 = resolve_target("h200"), resolve_target("a100-80")
    built = key_of(key_fields(pipe.fingerprint, sig, args, target=h200))
    cpu = key_of(key_fields(pipe.fingerprint, sig, args))
    _pod(monkeypatch, target_device(h200))
    assert key_of(key_fields(pipe.fingerprint, sig, args)) == built  # the pod's first start finds it
    _pod(monkeypatch, target_device(a100))
    assert key_of(key_fields(pipe.fingerprint, sig, args)) != built  # another chip: another program
    assert cpu != built  # and a CPU never picks a GPU entry, nor a GPU a CPU's


def _edited(target, field: str, value: int):
    """``target``'s description with one ``gpu_device_info`` number replaced: another board of the
    chip, or the card itself where XLA's file says otherwise."""
    import re

    text, n = re.subn(rf"(\n\s*{field}:\s*)\d+", rf"\g<1>{value}", target.text, count=1)
    assert n == 1, field
    return targets.Target(name=f"{target.name}+{field}", text=text, gpu=platforms.gpu_fields(text))


def test_a_card_whose_l2_differs_from_xla_s_file_still_finds_the_entries(monkeypatch):
    """The lent H200 reports another L2 size than XLA's h200 file (docs/gpu.md, first run: the
    carried entries missed on ``gpu.l2_cache_size``). The L2 size steers heuristics only, so it is
    not in the key; a limit that decides whether a kernel can launch still is."""
    pipe = preheat.load(None, cache="off")
    sig, args = pipe.prepare(2, steps=1)
    h200 = resolve_target("h200")
    built = key_of(key_fields(pipe.fingerprint, sig, args, target=h200))
    l2 = int(platforms.parse_description(h200.text)["gpu_device_info"][0]["l2_cache_size"][0])
    _pod(monkeypatch, target_device(_edited(h200, "l2_cache_size", l2 + 10 * 2**20)))
    assert key_of(key_fields(pipe.fingerprint, sig, args)) == built
    _pod(monkeypatch, target_device(_edited(h200, "shared_memory_per_block_optin", 101376)))  # an A10's limit
    assert key_of(key_fields(pipe.fingerprint, sig, args)) != built


def test_a_saved_description_keys_like_the_published_one(tmp_path, monkeypatch):
    """`doctor --save-target` on a "pod" writes what XLA reports for its device; warm --target FILE
    then keys exactly as the shipped name does."""
    h200 = resolve_target("h200")
    _pod(monkeypatch, target_device(h200))
    path = tmp_path / "mygpu.txtpb"
    result = CliRunner().invoke(main, ["doctor", "--save-target", str(path)])
    assert result.exit_code == 0 and "compute capability 9.0" in result.output, result.output
    saved = resolve_target(str(path))
    assert saved.gpu == h200.gpu and saved.name == str(path)
    target_device(saved)  # XLA takes the saved text back


def test_doctor_save_target_without_a_gpu_is_one_line(tmp_path):
    result = CliRunner().invoke(main, ["doctor", "--save-target", str(tmp_path / "x.txtpb")])
    assert result.exit_code != 0 and not (tmp_path / "x.txtpb").exists()
    assert len(result.output.strip().splitlines()) == 1 and result.output.startswith("error:")


@pytest.mark.parametrize("spec, reason", [("h300", "unknown"), ("l40s", "unknown"), ("{bad}", "malformed"),
                                          ("plugin", "plugin")])
def test_target_errors_are_one_line(spec, reason, tmp_path, monkeypatch):
    if spec == "{bad}":
        spec = str(tmp_path / "bad.txtpb")
        Path(spec).write_text("gpu_device_info {\n  core_count: 132\n  cuda_compute_capability {\n    major: 9\n")
    if spec == "plugin":
        spec = "h200"
        monkeypatch.setattr(targets, "cuda_versions", lambda: {})
    with pytest.raises(TargetError) as err:
        target_device(resolve_target(spec))
    assert err.value.reason == reason and err.value.argument == "target"
    code, out = _warm("--target", spec, "--max-batch-size", "1")
    assert code == 2 and len(out.strip().splitlines()) == 1 and out.startswith("error:"), out
    assert not (_root() / "compile" / "jax").is_dir() or not _manifests(_root())


def test_step_progress_cannot_be_compiled_for_a_target():
    """The step callback is lowered against the running GPU's runtime, which a deviceless compile lacks:
    --progress with --target is one line naming the flag, before anything compiles."""
    code, out = _warm("--target", "h200", "--max-batch-size", "1", "--progress")
    assert code == 2 and len(out.strip().splitlines()) == 1 and "--progress" in out and "--no-progress" in out, out
    assert not (_root() / "compile" / "jax").is_dir() or not _manifests(_root())


@pytest.mark.parametrize("text", ["", "gpu_device_info { core_count: 132 }", "name: \"x\" }",
                                  "gpu_device_info { cuda_compute_capability { major: nine } core_count: 1 }"])
def test_malformed_descriptions_fail_in_one_line(text, tmp_path):
    path = tmp_path / "t.txtpb"
    path.write_text(text)
    with pytest.raises(TargetError) as err:
        resolve_target(str(path))
    assert err.value.reason == "malformed" and "\n" not in str(err.value)


def _attention_hlo(head_dim: int, dtype: jnp.dtype, heads: int = 2, tokens: int = 64, context: int = 77) -> str:
    """The compiled H200 HLO of one cross-attention layer (transformer2d's, as SD UNets build it)."""
    from flax import nnx

    from preheat.platforms import compiling_for
    from preheat.models.transformer2d import CrossAttention

    layer = nnx.eval_shape(lambda: CrossAttention(heads * head_dim, 32, heads, head_dim, False, rngs=nnx.Rngs(0)))
    graph, state = nnx.split(layer)
    x = jax.ShapeDtypeStruct((2, tokens, heads * head_dim), dtype)
    ctx = jax.ShapeDtypeStruct((2, context, 32), dtype)
    state = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, dtype), state)

    def run(state, x, ctx):
        return nnx.merge(graph, state)(x, ctx)

    device = target_device(resolve_target("h200"))
    with compiling_for("gpu", (9, 0)):
        lowered = jax.jit(run).lower(*on_device((state, x, ctx), device))
    return lowered.compile().as_text()


@gpu_only  # a deviceless CUDA compile (make test-slow)
def test_attention_compiled_for_the_h200_without_it_takes_xla_s_path_for_every_head():
    """A deviceless compile builds no graph for cuDNN's fused attention (the GPU would not run it:
    ``cache.entries.UNRUNNABLE``), so every head, SDXL's 64-wide ones included, compiles to XLA's
    attention; the pod's own trace fuses (the next test)."""
    for head_dim, dtype in ((64, jnp.bfloat16), (80, jnp.bfloat16), (160, jnp.bfloat16), (64, jnp.float32)):
        assert "__cudnn$" not in _attention_hlo(head_dim, dtype), (head_dim, dtype)


@pytest.mark.skipif(not platforms.cudnn_available(), reason="needs a cuDNN package (nvidia-cudnn-cu13)")
def test_a_pod_s_own_trace_fuses_the_heads_cudnn_takes():
    """On the device (not deviceless), the choice reads the GPU's capability: cuDNN's fused
    attention for bf16/fp16 heads that are multiples of 8 up to 128, XLA's path for the rest."""
    gpu = platforms.get("gpu")

    def impl(dtype, head_dim, masked=False, capability=(9, 0)):
        layer = platforms.AttentionLayer(jnp.dtype(dtype).name, head_dim, 4096, 77, 10, masked)
        return gpu.attention(layer, capability).impl

    assert [impl(jnp.bfloat16, 64), impl(jnp.float16, 80), impl(jnp.bfloat16, 40)] == ["cudnn"] * 3
    assert [impl(jnp.bfloat16, 160), impl(jnp.float32, 64), impl(jnp.bfloat16, 60),
            impl(jnp.bfloat16, 64, masked=True)] == ["xla"] * 4
    assert impl(jnp.bfloat16, 64, capability=(7, 5)) == "xla"  # before Ampere: no fused path


def test_the_cpu_trace_is_unchanged():
    from preheat.models.attention import attention_for, dot_product_attention

    assert jax.devices()[0].platform == "cpu"
    assert attention_for(jnp.bfloat16, 64, 4096, 4096).impl is None  # jax's default: the CPU program as before
    q = jnp.asarray(np.random.default_rng(0).standard_normal((1, 8, 2, 16)), jnp.float32)
    np.testing.assert_array_equal(np.asarray(dot_product_attention(q, q, q)),
                                  np.asarray(jax.nn.dot_product_attention(q, q, q)))


def test_a_target_compiler_never_prefetches(tmp_path):
    compiler = TargetCompiler(resolve_target("h200"), root=tmp_path, remote=None)
    assert compiler.prefetch([({}, None, (), 1)]).items == []


def test_one_function_traced_for_the_cpu_and_the_target_gets_each_its_own_program():
    """The target is part of jit's caches: the CPU's trace is never reused for the GPU, nor the reverse
    (the convolution is XLA's on the CPU, one matrix product per tap for the deviceless target)."""
    from preheat.platforms import compiling_for
    from preheat.models.conv import conv2d

    x = jax.ShapeDtypeStruct((1, 8, 8, 4), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((3, 3, 4, 4), jnp.bfloat16)
    device = target_device(resolve_target("h200"))
    fn = jax.jit(lambda x, w: conv2d(x, w, 1, 1))
    assert "convolution" in fn.lower(x, w).as_text()  # the CPU first
    with compiling_for("gpu", (9, 0)):
        assert "convolution" not in fn.lower(*on_device((x, w), device)).as_text()
    assert "convolution" in fn.lower(x, w).as_text()  # and the CPU again
