"""``preheat warm --target v5e|v5e:2x2|v5p|v6e|v4``: TPU programs compiled on this CPU (libtpu's
compile-only topologies, no chip), stored under the key a TPU VM computes for itself.

The tests that compile need libtpu (the test extra's ``jax[tpu]``); the names' and errors' tests
do not. A TPU VM is the recorded one (``tests/_support/tpu_fixtures.py``).
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
import pytest
from click.testing import CliRunner

import preheat
from preheat import platforms
from preheat.cache import tpu_targets
from preheat.cache.keys import key_fields, key_of
from preheat.cache.targets import resolve_target, target_device
from preheat.cache.tpu_targets import resolve_tpu_target
from preheat.cli import main
from preheat.errors import TargetError
from tests._support.tpu_fixtures import V5E_VM, tpu_vm

needs_libtpu = pytest.mark.skipif(platforms.libtpu_version() is None, reason="needs the test extra's libtpu (jax[tpu])")


def _manifests(root: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((root / "compile" / "jax").glob("*/manifest.json"))]


def _root() -> Path:
    from preheat.cache.root import resolve_root

    return resolve_root().path


@pytest.mark.parametrize("spec, name, chips", [("v5e", "v5e:1x1", (1, 1, 1)), ("V5E:2x2", "v5e:2x2", (2, 2, 1)),
                                               ("v6e:2x4", "v6e:2x4", (2, 4, 1)), ("v5p", "v5p:2x2x1", (2, 2, 1)),
                                               ("v4", "v4:2x2x1", (2, 2, 1)), ("v5e:1x1x1", "v5e:1x1", (1, 1, 1))])
def test_tpu_names_are_libtpu_topologies_of_one_host(spec, name, chips):
    target = resolve_target(spec)
    assert (target.name, target.chips, target.platform, target.capability) == (name, chips, "tpu", None)
    assert target.topology_name == name


@pytest.mark.parametrize("spec, reason", [("v5e:ab", "malformed"), ("v5e:2x", "malformed"), ("v4:2x2", "malformed"),
                                          ("v5e:4x4", "unknown"), ("v5p:2x2x2", "unknown"), ("v7x", "unknown")])
def test_a_malformed_or_unknown_topology_is_one_line(spec, reason):
    with pytest.raises(TargetError) as err:
        resolve_target(spec)
    assert err.value.reason == reason and "\n" not in str(err.value)
    result = CliRunner().invoke(main, ["warm", "--target", spec, "--max-batch-size", "1"])
    assert result.exit_code != 0 and result.output.startswith("error:"), result.output
    assert len(result.output.strip().splitlines()) == 1, result.output


def test_no_libtpu_is_one_line_before_any_weights_are_read(monkeypatch):
    monkeypatch.setattr(tpu_targets, "libtpu_version", lambda: None)
    with pytest.raises(TargetError) as err:
        target_device(resolve_target("v5e"))
    assert err.value.reason == "plugin" and "pip install 'preheat[tpu]'" in str(err.value)
    for command in (["warm", "--target", "v5e"], ["cache", "explain", "--target", "v5e"]):
        result = CliRunner().invoke(main, command)
        assert result.exit_code != 0 and len(result.output.strip().splitlines()) == 1, result.output
        assert "libtpu" in result.output


@needs_libtpu
@pytest.mark.parametrize("spec, kind, devices, cores", [("v5e:2x2", "TPU v5 lite", 4, 1), ("v6e", "TPU v6 lite", 1, 1),
                                                       ("v5p", "TPU v5", 4, 2), ("v4", "TPU v4", 4, 2)])
def test_a_topology_has_the_devices_jax_shows_on_that_vm(spec, kind, devices, cores):
    """One device per chip, megacore chips (v4, v5p) as one device of two cores, as jax drives them."""
    target = resolve_target(spec)
    described = target.manifest()
    assert target.key_fields()["device_kind"] == kind == described["device"]
    assert (described["devices"], described["cores_per_device"]) == (devices, cores)


@needs_libtpu
def test_the_deviceless_key_is_the_key_a_tpu_vm_computes(monkeypatch):
    """The recorded v5e VM (one chip, its environment, jax's launch-barrier flag in LIBTPU_INIT_ARGS)
    computes the key a CPU builder computes for ``--target v5e``, with the libtpu this process has
    (the VM's own said the same build words as a builder's: the next test)."""
    monkeypatch.delenv("LIBTPU_INIT_ARGS", raising=False)  # a builder: jax's TPU start set nothing
    pipe = preheat.load(None, cache="off")
    sig, args = pipe.prepare(2, steps=1)
    v5e = resolve_target("v5e")
    built = key_of(key_fields(pipe.fingerprint, sig, args, target=v5e))
    cpu = key_of(key_fields(pipe.fingerprint, sig, args))
    here = str(target_device(v5e).client.platform_version)  # this libtpu's words, as the VM's would be
    tpu_vm(monkeypatch, V5E_VM, platform_version=here)
    vm = key_fields(pipe.fingerprint, sig, args)
    assert vm["platform"] == "tpu" and vm["device_kind"] == "TPU v5 lite" and vm["device_count"] == 1
    assert key_of(vm) == built  # the VM's first start finds what the builder wrote
    assert cpu != built  # and a CPU never picks a TPU entry, nor the reverse
    # a single-chip program is the same on a 4-chip host; another chip is another program
    assert key_of(key_fields(pipe.fingerprint, sig, args, target=resolve_target("v5e:2x2"))) == built
    assert key_of(key_fields(pipe.fingerprint, sig, args, target=resolve_target("v6e"))) != built
    monkeypatch.setenv("LIBTPU_INIT_ARGS", V5E_VM["env"]["LIBTPU_INIT_ARGS"] + " --xla_tpu_enable_latency_hiding_scheduler=false")
    assert key_of(key_fields(pipe.fingerprint, sig, args)) != built  # a flag libtpu reads is another program


@pytest.fixture(scope="module")
def v5e_warm(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """``preheat warm --target v5e`` of the built-in model in a fresh process, as a CPU builder runs
    it (JAX_PLATFORMS unset, libtpu installed, no chip): (the process, its cache root)."""
    base = tmp_path_factory.mktemp("v5e-warm")
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "PREHEAT_CACHE_URL", "LIBTPU_INIT_ARGS")}
    env.update(PREHEAT_HOME=str(base / "home"))
    proc = subprocess.run([sys.executable, "-m", "preheat", "warm", "--target", "v5e", "--max-batch-size", "1",
                           "--guidance", "off", "--dtype", "bfloat16", "--json"],
                          env=env, capture_output=True, text=True, timeout=600)
    return proc, base / "home"


@needs_libtpu
def test_warm_target_v5e_writes_tpu_entries_a_cpu_run_never_picks(v5e_warm, monkeypatch):
    proc, home = v5e_warm
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [row["cache_layer"] for row in json.loads(proc.stdout)["signatures"]] == ["none"]
    shutil.copytree(home, _root(), dirs_exist_ok=True)
    (entry,) = _manifests(_root())
    assert entry["target"] == {"name": "v5e:1x1", "platform": "tpu", "device": "TPU v5 lite", "chips": [1, 1, 1],
                               "devices": 1, "cores_per_device": 1, "libtpu": platforms.libtpu_version()}
    assert entry["fields"]["platform"] == "tpu" and entry["fields"]["device_kind"] == "TPU v5 lite"
    assert "host_cpu" not in entry["fields"]  # nothing of the builder's CPU

    # the same root, a CPU process, the warmed call (guidance 1: off): it never picks the TPU entry,
    # compiles its own, then hits it
    monkeypatch.delenv("LIBTPU_INIT_ARGS", raising=False)
    for expected in ("none", "aot"):
        pipe = preheat.load(None, dtype="bfloat16")
        pipe.generate(1, steps=1, seed=0, guidance=1.0)
        assert pipe.last.cache_layer == expected
    assert sorted(m["fields"]["platform"] for m in _manifests(_root())) == ["cpu", "tpu"]

    # nor the reverse: the VM's key is the TPU entry's, never the CPU one's
    sig, args = pipe.prepare(1, steps=1, guidance=1.0)
    cpu = key_of(key_fields(pipe.fingerprint, sig, args))
    here = str(target_device(resolve_target("v5e")).client.platform_version)
    tpu_vm(monkeypatch, V5E_VM, platform_version=here)
    vm = key_fields(pipe.fingerprint, sig, args)
    assert {k: v for k, v in vm.items() if v != entry["fields"].get(k)} == {}
    assert key_of(vm) == entry["key"] != cpu


@needs_libtpu
def test_cache_ls_and_explain_name_the_tpu_target(v5e_warm, monkeypatch):
    proc, home = v5e_warm
    assert proc.returncode == 0, proc.stderr[-2000:]
    shutil.copytree(home, _root(), dirs_exist_ok=True)
    monkeypatch.delenv("LIBTPU_INIT_ARGS", raising=False)
    listing = CliRunner().invoke(main, ["cache", "ls"], env={"COLUMNS": "250"}).output
    assert "v5e:1x1" in listing and "not autotuned" not in listing, listing  # nothing is autotuned on a TPU
    explained = CliRunner().invoke(main, ["cache", "explain", "--n", "1", "--steps", "1", "--dtype", "bfloat16",
                                          "--target", "v5e"]).output
    assert "target v5e:1x1" in explained, explained
    code = CliRunner().invoke(main, ["warm", "--target", "v5e", "--max-batch-size", "1", "--guidance", "off",
                                     "--dtype", "bfloat16"])
    assert code.exit_code == 0 and "1 aot" in code.output, code.output  # a second warm compiles nothing


@needs_libtpu
@pytest.mark.slow  # three denoising loops, the text encoder and the VAE compiled for a v5e (~60 s here)
def test_warm_target_v5e_on_a_tiny_sd1_folder_compiles_every_program_of_the_call(tmp_path):
    from tests._support.sd_fixtures import save_tiny_sd
    from tests._support.unet_condition_fixtures import save_tiny_unet_condition

    folder = save_tiny_sd(tmp_path / "sd1", kind="sd1")
    save_tiny_unet_condition(folder / "unet", kind="sd1", layers_per_block=1, block_out_channels=(32,),
                             down_block_types=("CrossAttnDownBlock2D",), up_block_types=("CrossAttnUpBlock2D",))
    result = CliRunner().invoke(main, ["warm", str(folder), "--target", "v5e", "--max-batch-size", "1", "--guidance",
                                       "off", "--dtype", "bfloat16"])
    assert result.exit_code == 0, result.output
    entries = _manifests(_root())
    stages = sorted(m["fields"]["signature"].get("stage", "denoise") for m in entries)
    assert stages == ["decode", "denoise", "denoise", "denoise", "encode", "encode_image"], stages
    assert all(m["target"]["name"] == "v5e:1x1" and m["fields"]["platform"] == "tpu" for m in entries)


def _compiled_attention(tokens: int, kv_tokens: int) -> tuple[str, object]:
    """A self- or cross-attention layer (bf16, 2 heads of 64) compiled for a v5e here, and the
    platform's choice for it."""
    from preheat.cache.compile import on_device
    from preheat.models.attention import attention_for, dot_product_attention

    device = target_device(resolve_target("v5e"))
    q = jax.ShapeDtypeStruct((1, tokens, 2, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, kv_tokens, 2, 64), jnp.bfloat16)
    with platforms.compiling_for("tpu"):
        choice = attention_for(jnp.bfloat16, 64, tokens, kv_tokens, 2)
        lowered = jax.jit(lambda q, k, v: dot_product_attention(q, k, v)).lower(*on_device((q, kv, kv), device))
    return lowered.compile().as_text(), choice


@needs_libtpu
@pytest.mark.parametrize("tokens, kv_tokens", [(4096, 4096), (1024, 77)])
def test_a_deviceless_v5e_program_holds_the_attention_kernel_the_platform_chose(tokens, kv_tokens):
    """SDXL's 4096-token self-attention: the Pallas flash kernel (a Mosaic ``tpu_custom_call`` in the
    compiled HLO); cross-attention to 77 text tokens: XLA's attention (no kernel call)."""
    text, choice = _compiled_attention(tokens, kv_tokens)
    kernel = "tpu_custom_call" in text
    assert kernel == (choice.impl == "flash"), (choice, text[:2000])
    assert choice.impl == ("flash" if tokens >= 4096 else "xla")


@needs_libtpu
def test_a_program_larger_than_the_chip_s_memory_is_one_line(tmp_path):
    """A v5e has 16 GB of HBM: a program whose temporaries need more fails naming the target and the
    program's stage, not with XLA's traceback."""
    from dataclasses import dataclass

    from preheat.cache.compile import TargetCompiler

    @dataclass(frozen=True)
    class Sig:
        stage: str = "decode"

    def program(x):  # (65536,) -> (65536, 65536): an output of 16 GiB of float32
        return jnp.outer(x, x)

    compiler = TargetCompiler(resolve_target("v5e"), root=tmp_path, remote=None)
    with pytest.raises(TargetError) as err:
        compiler.get_or_compile({"model": "huge"}, Sig(), program, jax.ShapeDtypeStruct((65536,), jnp.float32))
    assert err.value.reason == "memory" and "\n" not in str(err.value)
    assert str(err.value).startswith("--target v5e:1x1: the decode program does not fit it: "), err.value


@needs_libtpu
def test_a_pipeline_compiling_for_a_target_refuses_to_run_in_one_line(tmp_path):
    """``generate`` on a pipeline whose compiler builds for a v5e names the target and
    ``preheat warm --target`` (an executable for another machine would fail deep in jax)."""
    from preheat.cache.compile import TargetCompiler
    from preheat.errors import InvalidArgumentError

    pipe = preheat.load(None, cache="off")
    pipe.compiler = TargetCompiler(resolve_target("v5e"), root=tmp_path, remote=None)
    with pytest.raises(InvalidArgumentError) as err:
        pipe.generate(1, steps=1, seed=0)
    assert "\n" not in str(err.value) and "--target v5e:1x1" in str(err.value), err.value
    assert "preheat warm --target" in str(err.value) and not pipe.compiler.events  # refused before compiling


@needs_libtpu
def test_a_target_s_programs_compile_at_once_each_key_once_and_in_order(tmp_path, monkeypatch):
    """``compile_described``: two calls' programs for a v5e compile together (two compiles meet at a
    barrier, which one at a time never reaches), a program both calls share compiles once, and each
    call's records come back in order, as its programs are ready."""
    import threading

    from preheat.cache.compile import TargetCompiler, compile_described

    pipe = preheat.load(None, cache="off")
    compiler = TargetCompiler(resolve_target("v5e"), root=tmp_path, remote=None)
    met, calls, original = threading.Barrier(2, timeout=120), [], compiler.get_or_compile

    def meeting(*args, **kwargs):
        calls.append(args[1])
        if len(calls) <= 2:
            met.wait()  # BrokenBarrierError after the timeout when compiles run one at a time
        return original(*args, **kwargs)

    monkeypatch.setattr(compiler, "get_or_compile", meeting)
    described = [pipe.describe(n, steps=1, seed=0) for n in (1, 2, 1)]
    seen = []
    compile_described(compiler, described, pipe.program, at_once=2, each=lambda i, records: seen.append((i, records)))
    assert len(calls) == 2  # the third call is the first's program
    assert [i for i, _ in seen] == [0, 1, 2]
    keys = [records[0]["key"] for _, records in seen]
    assert keys[0] == keys[2] != keys[1] and all(records[0]["layer"] == "none" for _, records in seen)
    assert sorted(m["fields"]["signature"]["batch"] for m in _manifests(tmp_path)) == [1, 2]


@needs_libtpu
def test_warm_target_leaves_a_host_encode_stage_to_the_machine_that_runs_it(tmp_path):
    """FLUX.1 with ``encoders_on="host"``: the encode stage runs on the TPU VM's own CPU, which the
    builder cannot compile for; ``warm --target v5e`` compiles the loop and the decoder, says so, and
    writes no encode entry (one keyed for the TPU would never be asked for)."""
    from tests._support.flow_fixtures import save_tiny_flow_model

    folder = save_tiny_flow_model(tmp_path / "flux-dev", "flux-dev")
    result = CliRunner().invoke(main, ["warm", str(folder), "--target", "v5e", "--max-batch-size", "1", "--guidance",
                                       "off", "--encoders-on", "host", "--json"])
    assert result.exit_code == 0, result.output
    rows = json.JSONDecoder().raw_decode(result.output[result.output.index("{"):])[0]["signatures"]
    assert rows and all(set(row["skipped"]) == {"encode"} for row in rows), rows
    stages = sorted(m["fields"]["signature"].get("stage", "denoise") for m in _manifests(_root()))
    assert "encode" not in stages and {"denoise", "decode"} <= set(stages), stages
    # the dry run after it: every program cached but the encode stage, which it names as left out
    dry = CliRunner().invoke(main, ["warm", str(folder), "--target", "v5e", "--max-batch-size", "1", "--guidance",
                                    "off", "--encoders-on", "host", "--dry-run"])
    assert dry.exit_code == 0, dry.output
    assert "missing" not in dry.output.replace("0 missing locally", ""), dry.output
    assert dry.output.count("+ encode program not compiled here: it runs on the target machine's own CPU") == len(rows)


@needs_libtpu
@pytest.mark.slow  # FLUX.1's three stages and the encoders' stream compiled for a v5e (~60-130 s here)
def test_warm_target_compiles_an_offloaded_encode_stage_reading_the_chip_s_host_memory(tmp_path):
    """FLUX.1 with ``encoders_on="offload"``: the encode stage runs on the chip, its weights streamed
    from the chip's pinned host memory, so a builder compiles it for the v5e like the loop and the
    decoder: its entry's signature names that memory, and the dry run after it finds nothing missing."""
    from tests._support.flow_fixtures import save_tiny_flow_model

    folder = save_tiny_flow_model(tmp_path / "flux-dev", "flux-dev")
    flags = ["--target", "v5e", "--max-batch-size", "1", "--guidance", "off", "--encoders-on", "offload"]
    result = CliRunner().invoke(main, ["warm", str(folder), *flags, "--json"])
    assert result.exit_code == 0, result.output
    rows = json.JSONDecoder().raw_decode(result.output[result.output.index("{"):])[0]["signatures"]
    assert rows and not any(row.get("skipped") for row in rows), rows
    signatures = [m["fields"]["signature"] for m in _manifests(_root())]
    encode = [s for s in signatures if s.get("stage") == "encode"]
    assert encode and all(dict(map(tuple, s["extra"])).get("weights_memory") == "pinned_host" for s in encode), encode
    dry = CliRunner().invoke(main, ["warm", str(folder), *flags, "--dry-run"])
    assert dry.exit_code == 0 and "missing" not in dry.output.replace("0 missing locally", ""), dry.output
