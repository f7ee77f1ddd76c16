"""Data parallelism over local devices (``preheat.load(..., devices=)``), on fake CPU devices.

The test process has four fake CPU devices (tests/conftest.py's
``--xla_force_host_platform_device_count=4``): make test's runs are loads in it. A fresh process
runs only where one is the point, in test-slow: a host of 2 devices, a restart that loads the
4-device executable from disk. One fixture computes everything its tests compare, so each program
compiles once.

Pixels on 1 and N devices are compared to within one uint8 level on a few pixels: each device
runs the batch-1 (or batch B/N) program, and a different batch size may round differently in
XLA -- the same rule as images in different server buckets.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec

import preheat
from preheat.errors import InvalidArgumentError
from preheat.server.core import buckets_for
from preheat.sharding import FSDP_MIN_SIZE, parse_devices, select_devices, weight_spec
from tests._support.numerics import px_diff
from tests._support.sd_fixtures import save_tiny_sd
from tests._support.reference import save_tiny_pipeline

ROOT = Path(__file__).resolve().parent.parent


def _run(script: str, devices: int, home: Path, *args: str) -> str:
    """Run ``script`` in a fresh process with ``devices`` fake CPU devices; its stdout."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform")]
    env = {**os.environ, "XLA_FLAGS": " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"]),
           "JAX_PLATFORMS": "cpu",
           "PREHEAT_HOME": str(home), "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    env.pop("PREHEAT_DEVICES", None)  # the library's own default (all devices)
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(script), *args], env=env, capture_output=True,
                       text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def _close(a: np.ndarray, b: np.ndarray) -> None:
    """Same images, to within XLA's batch-size rounding (at most 1 level, on at most 1% of values)."""
    assert a.shape == b.shape and a.dtype == b.dtype == np.uint8
    diff = px_diff(a, b)
    assert diff.max() <= 1 and (diff > 0).mean() <= 0.01, (diff.max(), (diff > 0).mean())


# ---------------------------------------------------------------------------------- same pixels

CALL = dict(steps=3, seed=5, class_labels=[0, 1, 2, 3], guidance=3.0)  # guided: 2x model batch
PROMPTS = dict(prompt=["a red fox", "a boat", "snow"], negative_prompt="blurry", guidance=4.0, steps=2, seed=11,
               sampler="ddim")

# test-slow's fresh process: 2 devices, and a text model on a 2 x 2 (data, fsdp) mesh
MESH_PIXELS = f"""
    import sys, numpy as np, preheat
    out = {{}}
    out["builtin2"] = preheat.load(None, devices=2, cache="off").generate(4, **{CALL!r})
    q = preheat.load(sys.argv[2], devices=4, fsdp=2, cache="off")
    out["sd_fsdp2"] = q.generate(**{PROMPTS!r})
    out["sd_fsdp2_mesh"] = np.array([q.mesh.shape["data"], q.mesh.shape["fsdp"]])
    np.savez(sys.argv[1], **out)
"""


def _pixels_here(sd: Path) -> dict:
    """make test's runs, in this process (its four devices): the built-in model on 1 and 4 devices,
    its weights split over four (fsdp), and a text model on 1 and 4 devices."""
    out: dict = {}
    for d in (1, 4):
        p = preheat.load(None, devices=d, cache="off")
        out[f"builtin{d}"] = p.generate(4, **CALL)
        if d == 4:  # 3 images pad to the 4-image program: no new executable
            out["builtin4_n3"] = p.generate(3, **{**CALL, "class_labels": [0, 1, 2]})
            out["builtin4_layer"] = np.array(p.last.cache_layer)
            out["builtin4_programs"] = np.array(len(p.executables))
            out["builtin4_count"] = np.array(p.device_count)
    f = preheat.load(None, devices=4, fsdp=4, cache="off")  # weights split over all four devices
    out["fsdp4"] = f.generate(4, **CALL)
    out["fsdp4_shard_sizes"] = np.array([[x.size, x.addressable_shards[0].data.size] for x in jax.tree.leaves(f.params)])
    out["fsdp4_n3"] = f.generate(3, **{**CALL, "class_labels": [0, 1, 2]})
    out["fsdp4_programs"] = np.array(len(f.executables))
    for d in (1, 4):  # encode 6 -> 8 rows, denoise and decode 3 -> 4 on four devices
        out[f"sd{d}"] = preheat.load(sd, devices=d, cache="off").generate(**PROMPTS)
    return out


@pytest.fixture(scope="module")
def sd_folder(tmp_path_factory) -> Path:
    return save_tiny_sd(tmp_path_factory.mktemp("devices-sd") / "sd1", kind="sd1")


@pytest.fixture(scope="module")
def pixels(sd_folder):
    assert len(jax.local_devices()) == 4, "tests/conftest.py gives the test process four CPU devices"
    return _pixels_here(sd_folder)


@pytest.fixture(scope="module")
def mesh_pixels(tmp_path_factory, sd_folder):
    """test-slow's process (about 20 s): the built-in model on 2 devices, a text model on a 2 x 2 mesh."""
    base = tmp_path_factory.mktemp("devices-mesh")
    _run(MESH_PIXELS, 4, base / "home", str(base / "out.npz"), str(sd_folder))
    return dict(np.load(base / "out.npz"))


@pytest.mark.slow
def test_builtin_model_same_pixels_on_1_2_4_devices(pixels, mesh_pixels):
    _close(pixels["builtin1"], mesh_pixels["builtin2"])
    _close(pixels["builtin1"], pixels["builtin4"])
    assert pixels["builtin4"].std() > 0  # real images, not a constant


def test_a_batch_that_does_not_split_is_padded_and_reuses_the_bucket_program(pixels):
    assert int(pixels["builtin4_count"]) == 4
    _close(pixels["builtin4_n3"], pixels["builtin4"][:3])  # per-image seeds: the same 3 images
    assert str(pixels["builtin4_layer"]) == "memory" and int(pixels["builtin4_programs"]) == 1


def test_text_model_same_pixels_on_1_and_4_devices(pixels):
    assert pixels["sd4"].shape == (3, *pixels["sd1"].shape[1:])
    _close(pixels["sd1"], pixels["sd4"])


def test_fsdp_splits_the_weights_and_gives_the_same_pixels(pixels):
    sizes = pixels["fsdp4_shard_sizes"]  # (whole, one device's part) per weight
    big = sizes[:, 0] >= FSDP_MIN_SIZE
    assert big.any() and np.array_equal(sizes[big, 1] * 4, sizes[big, 0])  # every big weight split in four
    assert np.array_equal(sizes[~big, 1], sizes[~big, 0])  # small ones kept whole
    assert sizes[:, 1].sum() < 0.6 * sizes[:, 0].sum()
    _close(pixels["builtin1"], pixels["fsdp4"])
    _close(pixels["fsdp4_n3"], pixels["fsdp4"][:3])  # padded to the bucket: one program
    assert int(pixels["fsdp4_programs"]) == 1


@pytest.mark.slow  # make test splits a text model's weights with fsdp in test_scaled_fp8/test_gguf
def test_fsdp_on_a_two_by_two_mesh_runs_every_stage_of_a_text_model(pixels, mesh_pixels):
    assert mesh_pixels["sd_fsdp2_mesh"].tolist() == [2, 2]
    _close(pixels["sd1"], mesh_pixels["sd_fsdp2"])


def test_weight_placement_rule():
    data_only = Mesh(np.array(jax.local_devices()[:1]), ("data",))
    assert weight_spec((3, 3, 128, 64), data_only) == PartitionSpec()  # data parallel: weights whole
    fake = type("FakeMesh", (), {"axis_names": ("data", "fsdp"), "shape": {"data": 1, "fsdp": 4}})()  # 4 parts
    assert weight_spec((3, 3, 128, 64), fake) == PartitionSpec(None, None, "fsdp", None)  # the largest dim
    assert weight_spec((3, 3, 130, 64), fake) == PartitionSpec(None, None, None, "fsdp")  # the largest that divides
    assert weight_spec((4096, 4096), fake) == PartitionSpec("fsdp", None)  # ties: the first
    assert weight_spec((64,), fake) == PartitionSpec()  # small: whole
    assert weight_spec((129, 131), fake) == PartitionSpec()  # nothing divides: whole


def test_what_is_split_is_named_by_each_stage_argument():
    """``BATCHED`` field names, not positions: seeds, conditioning, noise and a Start's arrays are
    split; weights, the plan, the guidance scale, a LoRA's factors and a Start's scalars are not,
    and a LoRA's slots are (its own ``BATCHED``)."""
    from preheat.families.stages import DenoiseArgs, EncodeArgs, LoraArgs
    from preheat.samplers import Start
    from preheat.sharding import batch_specs

    mesh = Mesh(np.array(jax.local_devices()[:1]), ("data",))
    split, whole = PartitionSpec("data"), PartitionSpec()
    b = np.zeros((4,), np.float32)
    lora = LoraArgs(factors={"a": (np.zeros((2, 8, 4)), np.zeros((2, 4, 8)))}, scales=np.zeros((2, 4)),
                    slots=np.zeros((4,), np.int32))
    args = DenoiseArgs(params={"w": np.zeros((8, 8))}, plan={"timesteps": np.zeros((11,))}, seeds=b,
                       cond={"context": np.zeros((4, 7, 8))}, uncond={}, guidance=np.float32(3), noise=np.zeros(()),
                       start=Start(index=np.int32(1), x0=np.zeros((4, 2, 2, 1)), pure_noise=np.bool_(False)),
                       lora=lora)
    specs = batch_specs(args, mesh)
    assert isinstance(specs, DenoiseArgs) and isinstance(specs.lora, LoraArgs)
    assert specs.params["w"] == whole and specs.plan["timesteps"] == whole and specs.guidance == whole
    assert specs.seeds == split and specs.cond["context"] == split and specs.noise == whole  # a () placeholder
    assert (specs.start.x0, specs.start.index, specs.start.pure_noise) == (split, whole, whole)
    assert specs.lora.factors["a"] == (whole, whole) and specs.lora.scales == whole and specs.lora.slots == split
    bare = batch_specs(args._replace(start=None, lora=None), mesh)
    assert bare.start is None and bare.lora is None
    encode = batch_specs(EncodeArgs(params=({"w": np.zeros((8, 8))}, None), ids=(np.zeros((4, 77), np.int32),),
                                    lora=(lora, None), clip_skip=np.zeros((4,), np.int32)), mesh)
    assert encode.params == ({"w": whole}, None) and encode.ids == (split,) and encode.clip_skip == split
    assert encode.lora[0].slots == split and encode.lora[0].scales == whole and encode.lora[1] is None


@pytest.mark.parametrize("fsdp", [0, -2, 2.0, True, "2"])
def test_bad_fsdp_is_a_one_line_error(fsdp):
    with pytest.raises(InvalidArgumentError) as err:
        preheat.load(None, fsdp=fsdp, cache="off")
    assert "fsdp" in str(err.value) and "\n" not in str(err.value)


def test_fsdp_must_divide_the_device_count():
    with pytest.raises(InvalidArgumentError, match="fsdp=.* must divide the device count"):
        select_devices(1, fsdp=len(jax.local_devices()) + 1)


# ------------------------------------------------------------------------------------ the cache

SERVE = """
    import json, sys, numpy as np, preheat
    prefetch = [{"n": 4, "steps": 3}] if sys.argv[5] == "prefetch" else None
    p = preheat.load(sys.argv[1], devices=int(sys.argv[2]), fsdp=int(sys.argv[4]), prefetch=prefetch)
    out = p.generate(4, steps=3, seed=7)
    np.save(sys.argv[3], out)
    print(json.dumps({"layer": p.last.cache_layer, "event": p.compiler.events[-1]}, default=str))
"""

EXPLAIN = """
    import sys
    from preheat.cli import main
    sys.argv = ["preheat", "cache", "explain", sys.argv[1], "--n", "4", "--steps", "3", "--devices", sys.argv[2]]
    main()
"""


@pytest.mark.slow
def test_sharded_executable_restarts_warm_and_is_not_used_on_two_devices(tmp_path):
    model = save_tiny_pipeline(tmp_path / "pipe")
    home = tmp_path / "home"

    def serve(devices: int, host_devices: int, name: str, fsdp: int = 1, prefetch: bool = False) -> dict:
        return json.loads(_run(SERVE, host_devices, home, str(model), str(devices), str(tmp_path / name),
                               str(fsdp), "prefetch" if prefetch else "-").splitlines()[-1])

    cold = serve(4, 4, "cold.npy")
    assert cold["layer"] == "none" and cold["event"]["store"] == "written"
    # a fresh process loads the 4-device executable, on the background thread while the weights
    # are read: its key (mesh included) is known from placeholder weights placed as they will be
    warm = serve(4, 4, "warm.npy", prefetch=True)
    assert warm["layer"] == "aot" and warm["event"]["trace_lower_s"] == 0.0
    assert warm["event"]["prefetch"] == "background", warm
    assert np.array_equal(np.load(tmp_path / "cold.npy"), np.load(tmp_path / "warm.npy"))  # the same program
    assert _run(EXPLAIN, 4, home, str(model), "4").startswith("hit:")

    said = _run(EXPLAIN, 2, home, str(model), "2")  # a host with two devices
    assert said.startswith("miss:") and "mesh.axes.data" in said and "mesh.devices" in said, said
    two = serve(2, 2, "two.npy")
    assert two["layer"] == "none" and "mesh.axes.data" in two["event"]["miss"], two
    _close(np.load(tmp_path / "cold.npy"), np.load(tmp_path / "two.npy"))

    split = serve(4, 4, "fsdp.npy", fsdp=2)  # the same devices, weights split: another program
    assert split["layer"] == "none" and "mesh.axes" in split["event"]["miss"], split
    again = serve(4, 4, "fsdp_warm.npy", fsdp=2, prefetch=True)  # weights split: prefetched all the same
    assert again["layer"] == "aot" and again["event"]["trace_lower_s"] == 0.0
    assert again["event"]["prefetch"] == "background", again
    assert np.array_equal(np.load(tmp_path / "fsdp.npy"), np.load(tmp_path / "fsdp_warm.npy"))
    _close(np.load(tmp_path / "cold.npy"), np.load(tmp_path / "fsdp.npy"))
    shutil.rmtree(home)  # nothing cached: a prefetching start compiles on its threads, weights split alike
    fresh = serve(4, 4, "fsdp_fresh.npy", fsdp=2, prefetch=True)
    assert fresh["event"]["prefetch"] == "background" and fresh["event"]["background_compile"] == "done", fresh
    assert np.array_equal(np.load(tmp_path / "fsdp.npy"), np.load(tmp_path / "fsdp_fresh.npy"))


def test_server_compiles_one_program_per_bucket_and_no_device_idles(tmp_path):
    """A server's core on the test process's four devices."""
    from preheat.server.core import Core, CoreConfig

    model = save_tiny_pipeline(tmp_path / "pipe")
    core = Core(CoreConfig(model=str(model), max_batch_size=8, devices=4, batch_wait_ms=0)).start()
    try:
        assert core.wait_setup(600) and core.setup.status == "succeeded", core.setup.logs
        programs = len(core.pipe.executables)
        pred, _ = core.submit(*core.parse({"seed": 3, "num_outputs": 3, "num_inference_steps": 2}))
        assert pred.done.wait(300), pred.status
        got = {"buckets": list(core.buckets), "signatures": len(core.signatures()), "programs": programs,
               "status": pred.status, "images": len(pred.output or []), "stats": core.batcher.stats,
               "after": len(core.pipe.executables)}
    finally:
        core.close()
    assert got["buckets"] == [4, 8]  # multiples of the device count
    assert got["programs"] == got["signatures"] == 4  # guidance off / on x two buckets: one program each
    assert got["status"] == "succeeded" and got["images"] == 3  # 3 images ran in bucket 4, padded
    assert got["stats"]["traffic_compiles"] == 0 and got["after"] == got["programs"]


# ------------------------------------------------------------------------- choices and buckets


def test_single_device_keeps_the_single_device_program():
    first = jax.local_devices()[0].id
    assert select_devices(1) is None and select_devices([first]) is None
    if len(jax.local_devices()) >= 2:
        mesh = select_devices(2)
        assert mesh.axis_names == ("data",) and mesh.size == 2


@pytest.mark.parametrize("devices", ["most", 0, -1, 10_000, [10_000], [0, 0], [], True, 2.0, ["0"]])
def test_bad_devices_are_one_line_errors(devices):
    with pytest.raises(InvalidArgumentError) as err:
        preheat.load(None, devices=devices, cache="off")
    assert "devices" in str(err.value) and "\n" not in str(err.value)


def test_devices_from_the_command_line_and_environment(monkeypatch):
    assert parse_devices("all") == "all" and parse_devices("2") == 2 and parse_devices("0, 2") == [0, 2]
    assert parse_devices(None) is None
    with pytest.raises(InvalidArgumentError, match="--devices"):
        parse_devices("gpu0", "--devices")
    monkeypatch.setenv("PREHEAT_DEVICES", "1")
    assert select_devices() is None
    monkeypatch.setenv("PREHEAT_DEVICES", "none")
    with pytest.raises(InvalidArgumentError, match="PREHEAT_DEVICES"):
        select_devices()


def test_server_buckets_are_multiples_of_the_device_count():
    assert buckets_for(8) == (1, 2, 4, 8) and buckets_for(6) == (1, 2, 4, 6)  # one device: as before
    assert buckets_for(8, 4) == (4, 8)
    assert buckets_for(6, 4) == (4, 8)  # 6 images still fit a bucket
    assert buckets_for(3, 4) == (4,)
    assert buckets_for(32, 8) == (8, 16, 32)
    for max_batch, devices in [(8, 2), (12, 8), (1, 2)]:
        buckets = buckets_for(max_batch, devices)
        assert all(b % devices == 0 for b in buckets) and buckets[-1] >= max_batch
