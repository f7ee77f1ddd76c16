"""FLUX.1 with its text encoders on the host (``preheat.load(encoders_on="host")``): the weights stay in
host memory and the encode stage runs on the host's CPU, the images as with the encoders on the device."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import preheat
from preheat import platforms
from preheat.errors import InvalidArgumentError
from tests._support.flow_fixtures import save_tiny_flow_model
from tests._support.tpu_fixtures import vm_host_cpu

CALL = dict(prompt="a fox", steps=2, seed=3, width=32, height=32)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_flow_model(tmp_path_factory.mktemp("flux-host") / "flux-dev", "flux-dev")


@pytest.fixture(scope="module")
def pipes(folder):
    return {on: preheat.load(folder, cache="off", devices=1, encoders_on=on) for on in ("device", "host")}


def test_host_encoders_draw_the_same_pixels(pipes):
    device, host = pipes["device"].generate(**CALL), pipes["host"].generate(**CALL)
    assert np.abs(device.astype(np.int16) - host.astype(np.int16)).max() <= 1  # float rounding at most


def test_host_encoders_weights_are_committed_to_the_host_cpu(pipes):
    host = platforms.host_device()
    leaves = [leaf for te in pipes["host"].components.text_encoders for leaf in jax.tree.leaves(te.params)]
    assert leaves and all(leaf.committed and leaf.devices() == {host} for leaf in leaves)
    assert pipes["host"].components.encoders_on == "host"


def test_the_encode_stage_signature_names_where_it_runs(pipes):
    """The executable's signature (its memory key and the cache key's ``signature``) says it is the
    host CPU's program, so a device program and a host one are never confused."""
    pipe = pipes["host"]
    pipe.generate(**CALL)
    pipes["device"].generate(**CALL)  # this test's own calls, in whatever order the tests run
    sigs = [sig for sig in pipe.executables.signatures() if getattr(sig, "stage", "") == "encode"]
    assert sigs and all(dict(sig.extra)["runs_on"] == "cpu" and dict(sig.extra)["host_cpu"] for sig in sigs)
    device_sigs = [sig for sig in pipes["device"].executables.signatures() if getattr(sig, "stage", "") == "encode"]
    assert device_sigs and all("runs_on" not in dict(sig.extra) for sig in device_sigs)


def test_host_encoders_on_a_mesh_run_unsplit(folder, pipes):
    """Over 4 devices the denoiser's batch is split; the host's encode stage is the CPU's alone."""
    mesh = preheat.load(folder, cache="off", devices=4, encoders_on="host")
    out = mesh.generate(n=4, **CALL)
    want = pipes["device"].generate(n=4, **CALL)
    assert np.abs(out.astype(np.int16) - want.astype(np.int16)).max() <= 1


def test_offloaded_encoders_stay_in_host_memory_on_a_mesh(folder, pipes):
    """Over 4 devices the weights are distributed (``sharding.distribute``): the encoders' offloaded
    matrices stay in the devices' pinned host memory, replicated there, and the image is the
    resident encoders' on the same mesh."""
    mesh = preheat.load(folder, cache="off", devices=4, encoders_on="offload")
    matrices = [leaf for te in mesh.components.text_encoders for leaf in jax.tree.leaves(te.params) if leaf.ndim >= 2]
    assert matrices and {(leaf.sharding.memory_kind, len(leaf.sharding.device_set)) for leaf in matrices} == {
        ("pinned_host", 4)}
    want = preheat.load(folder, cache="off", devices=4).generate(n=4, **CALL)
    np.testing.assert_array_equal(mesh.generate(n=4, **CALL), want)


def test_encoders_on_is_refused_where_it_does_not_apply(folder):
    with pytest.raises(InvalidArgumentError, match="encoders_on='host' applies to FLUX.1 models"):
        preheat.load(None, cache="off", encoders_on="host")
    with pytest.raises(InvalidArgumentError, match="encoders_on='cloud' is not supported; use one of device, host, "
                                                   "offload"):
        preheat.load(folder, cache="off", encoders_on="cloud")
    with pytest.raises(InvalidArgumentError, match="give one"):
        preheat.load(folder, cache="off", encoders_on="host", offload_encoders=True)


@pytest.mark.parametrize("kind", ["flux-dev", "flux-kontext", "flux-fill"])
def test_offloaded_encoders_give_the_resident_image_and_restart_hot(kind, tmp_path):
    """``encoders_on="offload"`` (the v5e's T5-XXL beside the int8 transformer): the encoders' matrices
    in pinned host memory, read by the encode program (``families.text.offload``); the image is the
    load's with them resident, exactly. A restart's prefetch (FLUX.1's text-to-image call) traces
    placeholders in that memory, so its encode executable is the one the first start stored."""
    folder = save_tiny_flow_model(tmp_path / kind, kind, quiet_posterior=kind == "flux-fill")
    call = dict(CALL, **({} if kind == "flux-dev" else _edit_inputs(kind)))
    want = preheat.load(folder, cache="off", devices=1, **V5E_LOAD).generate(**call)
    prefetch = [{"steps": 2, "width": 32, "height": 32}] if kind == "flux-dev" else None  # compiled from placeholders
    cold = preheat.load(folder, devices=1, encoders_on="offload", prefetch=prefetch, **V5E_LOAD)  # its own cache root
    kinds = {leaf.sharding.memory_kind for te in cold.components.text_encoders for leaf in jax.tree.leaves(te.params)
             if leaf.ndim >= 2}
    assert kinds == {"pinned_host"} and cold.components.offload_encoders
    np.testing.assert_array_equal(cold.generate(**call), want)
    if kind != "flux-dev":
        return
    warm = preheat.load(folder, devices=1, encoders_on="offload", prefetch=prefetch, **V5E_LOAD)
    np.testing.assert_array_equal(warm.generate(**call), want)
    got = {e["stage"]: (e["layer"], e.get("prefetch")) for e in warm.compiler.events}
    assert got["encode"] == ("aot", "background") and got["denoise"] == ("aot", "background"), warm.compiler.events


def test_a_restart_prefetches_the_host_encode_stage(folder, pipes):
    """The rehearsal's placeholders are placed on the host and its program traced for the CPU, so the
    prefetched encode executable is the one the first start stored (no quarantine, the same image)."""
    cold = preheat.load(folder, devices=1, encoders_on="host")  # this test's own cache root (conftest)
    want = cold.generate(**CALL)
    warm = preheat.load(folder, devices=1, encoders_on="host", prefetch=[{"steps": 2, "width": 32, "height": 32}])
    np.testing.assert_array_equal(warm.generate(**CALL), want)
    got = [(e["stage"], e["layer"], e.get("prefetch")) for e in warm.compiler.events]
    assert got == [(s, "aot", "background") for s in ("encode", "denoise", "decode")], warm.compiler.events


def test_host_encoders_compute_in_float32_on_a_cpu_without_bf16_products(folder, monkeypatch):
    """A bfloat16 load on a host whose CPU has no bf16 products (a TPU v5e VM's AMD host) keeps and
    runs CLIP and T5 in float32 there (``platforms.host_compute_dtype``); the image is the bfloat16
    pipeline's with its encoders on the device, but for the encoders' rounding."""
    vm_host_cpu(monkeypatch)
    host = preheat.load(folder, cache="off", devices=1, dtype="bfloat16", encoders_on="host")
    leaves = [leaf for te in host.components.text_encoders for leaf in jax.tree.leaves(te.params)]
    assert leaves and {leaf.dtype for leaf in leaves} == {np.dtype("float32")}
    device = preheat.load(folder, cache="off", devices=1, dtype="bfloat16")
    assert {leaf.dtype for te in device.components.text_encoders for leaf in jax.tree.leaves(te.params)} == \
        {jnp.dtype("bfloat16")}
    got, want = host.generate(**CALL).astype(np.float64), device.generate(**CALL).astype(np.float64)
    assert np.abs(got - want).mean() <= 1.0  # in 1/255: the bf16 encoders' rounding alone (0.16 measured)


V5E_LOAD = dict(dtype="bfloat16", weights_dtype="int8", weights_layers="linear")  # what one v5e chip holds


def _edit_inputs(kind: str) -> dict:
    from tests._support.flow_fixtures import picture

    if kind == "flux-kontext":  # used as it is (its default resize would make a 1024² reference)
        return dict(image=picture(32, 32), image_resize="none")
    mask = np.zeros((32, 32), np.uint8)
    mask[8:24, 10:28] = 255
    return dict(image=picture(32, 32), mask_image=mask)


@pytest.mark.parametrize("kind", ["flux-kontext", "flux-fill"])
def test_kontext_and_fill_run_as_one_v5e_chip_holds_them(kind, tmp_path, monkeypatch):
    """Kontext and Fill with the v5e's load options (int8 Linear weights, the encoders on the host,
    in float32 on a CPU without bf16 products): the image of the same int8 load with its encoders
    on the device, but for the encoders' rounding; their weights on the host's CPU."""
    vm_host_cpu(monkeypatch)
    folder = save_tiny_flow_model(tmp_path / kind, kind, quiet_posterior=kind == "flux-fill")
    host = preheat.load(folder, cache="off", devices=1, encoders_on="host", **V5E_LOAD)
    device = preheat.load(folder, cache="off", devices=1, **V5E_LOAD)
    leaves = [leaf for te in host.components.text_encoders for leaf in jax.tree.leaves(te.params)]
    assert leaves and all(leaf.devices() == {platforms.host_device()} and leaf.dtype == np.float32 for leaf in leaves)
    call = dict(CALL, **_edit_inputs(kind))
    got, want = host.generate(**call).astype(np.float64), device.generate(**call).astype(np.float64)
    assert got.shape == want.shape == (1, 32, 32, 3)
    assert np.abs(got - want).mean() <= 1.0  # in 1/255


def test_the_encode_stage_takes_offloaded_weights_in_host_memory_whenever_it_is_described():
    """``families.text._in_memory``: a prefetch's rehearsal may describe the encode stage before, while
    or after the weights are read (its thread races the reads), so a placeholder, a weight read but not
    yet moved, and a moved one all reach the program in pinned host memory; vectors stay on the device."""
    from preheat.families.text import _in_memory

    device = jax.devices()[0]
    host = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
    params = {"placeholder": jax.ShapeDtypeStruct((4, 8), jnp.float32), "read": jnp.ones((4, 8)),
              "moved": jax.device_put(jnp.ones((4, 8)), host), "norm": jnp.ones((8,)),
              "stacked": {"scale": jax.ShapeDtypeStruct((3, 8), jnp.float32)}}
    out = _in_memory(params, "pinned_host")
    assert {k: out[k].sharding.memory_kind for k in ("placeholder", "read", "moved")} == {
        "placeholder": "pinned_host", "read": "pinned_host", "moved": "pinned_host"}
    assert out["moved"] is params["moved"] and out["norm"] is params["norm"]
    assert out["stacked"]["scale"].sharding is None  # a stack's vector: one block's row each, kept on the device
