"""Streaming weight loading: the same bits as reading everything first, one tensor on the host at a
time, torn files refused in one line, and a load report whose host-memory figures are bounded.

The reference ("the old path") is written out here: every tensor read with safetensors'
own ``safe_open(framework="numpy")`` into a dict, then ``jnp.asarray(layout(arr), dtype)`` per
parameter -- what ``read_tensors`` + ``fill`` did before they streamed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

import preheat
from preheat.engine import load_jax_pipeline
from preheat.errors import ModelFormatError, WeightsError
from preheat.models import loading
from preheat.models.safetensors_files import DIFFUSERS_STEM, Checkpoint, TensorInfo, read_tensors, weight_files
from preheat.models.load_report import recording
from preheat.models.weights import expected_torch_shape, fill, to_jax_layout, torch_key

TINY = dict(_class_name="UNet2DModel", sample_size=8, in_channels=1, out_channels=1, layers_per_block=1,
            block_out_channels=[8, 16], norm_num_groups=4, down_block_types=["DownBlock2D", "AttnDownBlock2D"],
            up_block_types=["AttnUpBlock2D", "UpBlock2D"], attention_head_dim=8)
DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype(np.float16)}


@pytest.fixture(scope="module")
def abstract():
    return loading.build_abstract(loading.UNet2DConfig.from_dict(TINY))[1]


def _random_state_dict(abstract, dtype, seed=0) -> dict[str, np.ndarray]:
    """Random torch-layout tensors for every parameter (values of every magnitude, so casts round)."""
    rng = np.random.default_rng(seed)
    out = {}
    for path, var in nnx.to_flat_state(abstract):
        shape = expected_torch_shape(tuple(var.shape), str(path[-1]))
        out[torch_key(path)] = (rng.standard_normal(shape) * np.exp(rng.uniform(-8, 8, shape))).astype(dtype)
    return out


def _save(folder: Path, sd: dict[str, np.ndarray], shards: int = 1) -> Path:
    """A diffusers-style folder: one file, or ``shards`` files plus ``.safetensors.index.json``."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(TINY))
    if shards == 1:
        save_file(sd, folder / f"{DIFFUSERS_STEM}.safetensors")
        return folder
    keys = sorted(sd)
    weight_map = {}
    for i in range(shards):
        name = f"{DIFFUSERS_STEM}-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = keys[i::shards]
        save_file({k: sd[k] for k in part}, folder / name)
        weight_map.update({k: name for k in part})
    (folder / f"{DIFFUSERS_STEM}.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return folder


def _old_path(abstract, files, dtype, dtype_for=None) -> dict[str, jax.Array]:
    tensors = {}
    for f in files:
        with safe_open(str(f), framework="numpy") as handle:
            for key in handle.keys():
                tensors[key] = handle.get_tensor(key)
    out = {}
    for path, var in nnx.to_flat_state(abstract):
        key = torch_key(path)
        want = dtype_for(key) if dtype_for else dtype
        out[key] = jnp.asarray(to_jax_layout(tensors[key], str(path[-1])), dtype=want)
    return out


def _assert_bitwise_equal(state, reference: dict[str, jax.Array]) -> None:
    flat = nnx.to_flat_state(state)
    assert len(flat) == len(reference)
    for path, var in flat:
        got, want = np.asarray(var.get_value()), np.asarray(reference[torch_key(path)])
        assert got.dtype == want.dtype and got.shape == want.shape, torch_key(path)
        assert got.tobytes() == want.tobytes(), torch_key(path)


@pytest.mark.parametrize("stored", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("target", ["float32", "bfloat16", "float16"])
def test_streamed_load_is_bitwise_the_old_path(tmp_path, abstract, stored, target):
    folder = _save(tmp_path / "unet", _random_state_dict(abstract, DTYPES[stored]))
    files = weight_files(folder, (DIFFUSERS_STEM,))
    state = fill(abstract, read_tensors(files), jnp.dtype(target), str(folder))
    _assert_bitwise_equal(state, _old_path(abstract, files, jnp.dtype(target)))


def test_sharded_folder_with_index_and_a_per_tensor_dtype(tmp_path, abstract):
    sd = _random_state_dict(abstract, DTYPES["bfloat16"], seed=1)
    folder = _save(tmp_path / "unet", sd, shards=3)
    files = weight_files(folder, (DIFFUSERS_STEM,))
    assert len(files) == 3
    keep_fp32 = lambda key: jnp.float32 if key.startswith("conv_in") else jnp.float16  # noqa: E731
    state = fill(abstract, read_tensors(files), jnp.float16, str(folder), dtype_for=keep_fp32)
    _assert_bitwise_equal(state, _old_path(abstract, files, jnp.float16, dtype_for=keep_fp32))
    # the real loader reads the same folder to the same numbers
    unet = preheat.load_unet(folder, dtype=jnp.float16)
    assert all(np.asarray(a).tobytes() == np.asarray(b).tobytes()
               for a, b in zip(jax.tree.leaves(unet.params), jax.tree.leaves(
                   fill(abstract, read_tensors(files, rename=loading.legacy_unet_key), jnp.float16, "x"))))


def test_checkpoint_behaves_like_the_dict_it_replaces(tmp_path, abstract):
    sd = _random_state_dict(abstract, np.float32)
    folder = _save(tmp_path / "unet", sd, shards=2)
    ckpt = read_tensors(weight_files(folder, (DIFFUSERS_STEM,)), rename=lambda k: "m." + k)
    assert isinstance(ckpt, Checkpoint) and sorted(ckpt) == sorted("m." + k for k in sd) and len(ckpt) == len(sd)
    assert "m.conv_in.bias" in ckpt and "conv_in.bias" not in ckpt
    assert np.array_equal(ckpt["m.conv_in.weight"], sd["conv_in.weight"])
    assert {k: v.tobytes() for k, v in dict(ckpt).items()} == {"m." + k: v.tobytes() for k, v in sd.items()}
    ckpt["m.conv_in.bias"] = np.full(8, 3.0, np.float32)  # assignment wins over the file
    assert ckpt.meta("m.conv_in.bias") == ((8,), np.dtype(np.float32)) and float(ckpt["m.conv_in.bias"][0]) == 3.0
    del ckpt["m.conv_out.bias"]
    assert "m.conv_out.bias" not in ckpt and len(ckpt) == len(sd) - 1


def test_a_mismatched_checkpoint_is_refused_before_any_tensor_is_read(tmp_path, abstract, monkeypatch):
    sd = _random_state_dict(abstract, np.float32)
    del sd["conv_in.bias"]
    sd["conv_out.weight"] = np.zeros((1, 8, 5, 5), np.float32)
    sd["surprise.weight"] = np.zeros((3,), np.float32)
    folder = _save(tmp_path / "unet", sd)
    reads = []
    real = TensorInfo.read
    monkeypatch.setattr(TensorInfo, "read", lambda info, into=None: reads.append(info.key) or real(info, into))
    with pytest.raises(WeightsError) as err:
        fill(abstract, read_tensors(weight_files(folder, (DIFFUSERS_STEM,))), jnp.float32, str(folder))
    msg = str(err.value)
    assert "\n" not in msg and reads == []
    assert "missing conv_in.bias (expected shape (8,))" in msg
    assert "conv_out.weight has shape (1, 8, 5, 5), expected (1, 8, 3, 3)" in msg
    assert "unexpected surprise.weight (3,)" in msg


def _tear(path: Path, how: str) -> None:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    if how == "truncated":
        path.write_bytes(raw[:-100])
    elif how == "cut in the header":
        path.write_bytes(raw[: 8 + n // 2])
    elif how == "garbled header":
        path.write_bytes(raw[:8] + b"\xff" * n + raw[8 + n:])
    elif how == "trailing bytes":
        path.write_bytes(raw + b"\0" * 64)
    elif how == "tiny":
        path.write_bytes(raw[:5])
    elif how == "unknown dtype":
        header = json.loads(raw[8:8 + n])
        header[sorted(k for k in header if k != "__metadata__")[0]]["dtype"] = "F4"
        text = json.dumps(header).encode()
        path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n:])


@pytest.mark.parametrize("how", ["truncated", "cut in the header", "garbled header", "trailing bytes", "tiny",
                                 "unknown dtype"])
def test_a_torn_shard_is_one_line_naming_it(tmp_path, abstract, how):
    folder = _save(tmp_path / "unet", _random_state_dict(abstract, np.float32), shards=2)
    files = weight_files(folder, (DIFFUSERS_STEM,))
    _tear(files[1], how)
    with pytest.raises(ModelFormatError) as err:
        preheat.load_unet(folder)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"cannot read {files[1]}: ")


def test_a_shard_cut_while_streaming_is_one_line_and_returns_nothing(tmp_path, abstract):
    """The headers were fine when read; the file shrinks before its tensors are read."""
    folder = _save(tmp_path / "unet", _random_state_dict(abstract, np.float32), shards=2)
    files = weight_files(folder, (DIFFUSERS_STEM,))
    ckpt = read_tensors(files)
    files[1].write_bytes(files[1].read_bytes()[:-1000])
    result = None
    with pytest.raises(ModelFormatError) as err:
        result = fill(abstract, ckpt, jnp.float32, str(folder))
    assert result is None
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"cannot read {files[1]}: ") and "truncated while reading" in msg


def test_recording_reports_every_component_of_a_pipeline_load(tmp_path):
    with recording() as rec:
        pipe = load_jax_pipeline(None)
    total = pipe.load_report
    assert total is not None and rec.total is not None and rec.total.tensors == total.tensors
    files = [Path(f) for f in total.files]
    with safe_open(str(files[0]), framework="numpy") as h:
        n_tensors, n_bytes = len(list(h.keys())), sum(h.get_tensor(k).nbytes for k in h.keys())
    assert (total.tensors, total.bytes_read) == (n_tensors, n_bytes)
    assert total.largest_file_bytes == files[0].stat().st_size
    assert len(total.parts) == 1 and total.abstract_s > 0
    d = total.to_dict()
    assert d["bytes_read"] == n_bytes and {"peak_host_bytes", "transient_host_bytes", "parts"} <= set(d)


MEMORY_CHILD = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp, ml_dtypes, numpy as np
    from flax import nnx
    from safetensors.numpy import save_file
    from preheat.models.load_report import recording
    from preheat.models.safetensors_files import read_tensors
    from preheat.models.weights import build_abstract, fill

    N, D = 16, 1024  # 16 linear layers: 16 x 4 MiB fp32 kernels (64 MiB) plus biases

    class Stack(nnx.Module):
        def __init__(self, rngs):
            for i in range(N):
                setattr(self, f"l{i}", nnx.Linear(D, D, rngs=rngs))

    stored, target, path = sys.argv[1], sys.argv[2], sys.argv[3]
    rng = np.random.default_rng(0)
    sd = {}
    for i in range(N):
        sd[f"l{i}.weight"] = rng.standard_normal((D, D), dtype=np.float32).astype(stored)
        sd[f"l{i}.bias"] = rng.standard_normal(D, dtype=np.float32).astype(stored)
    save_file(sd, path)
    del sd
    _, abstract = build_abstract(Stack)
    jax.block_until_ready(jnp.zeros(1) + 1)  # the runtime's own first allocations, outside the window

    # control first, everything kept alive, so that neither load reuses memory the other freed
    with recording() as copied:  # the whole file on the host first (what reading into a dict did)
        # a real copy of every tensor, as safe_open's get_tensor made (a lazy or memory-mapped view
        # may leave pages untouched, and the control would then see less than the file)
        everything = {k: np.array(v, copy=True) for k, v in read_tensors([path]).items()}
        kept = fill(abstract, everything, jnp.dtype(target), "stack")
    with recording() as streamed:
        params = fill(abstract, read_tensors([path]), jnp.dtype(target), "stack")
    placed = sum(x.nbytes for x in jax.tree.leaves(params))
    assert streamed.total.placed_bytes == placed
    print(json.dumps(dict(streamed=streamed.total.to_dict(), copied=copied.total.to_dict(), placed=placed)))
""")


@pytest.mark.parametrize("stored,target", [("float32", "float32"), ("bfloat16", "float32")])
def test_streaming_holds_about_one_tensor_on_the_host(tmp_path, stored, target):
    """Peak host memory during a 16-tensor load is bounded well under the file (a fresh process
    for a clean resident set; the kernel's high-water mark, so no sampling and no timing)."""
    path = tmp_path / "stack.safetensors"
    src = str(Path(preheat.__file__).resolve().parents[1])
    # glibc raises its mmap threshold after a large free, so later buffers may land in heap pages
    # that are already resident and the resident set does not grow: pin the threshold (and trim
    # eagerly) so every large buffer is its own mapping, counted when touched and returned when freed.
    env = {**os.environ, "PYTHONPATH": src, "JAX_PLATFORMS": "cpu",
           "MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}
    proc = subprocess.run([sys.executable, "-c", MEMORY_CHILD, stored, target, str(path)], capture_output=True,
                          text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    streamed, copied = r["streamed"], r["copied"]
    file_bytes = path.stat().st_size
    if not streamed["peak_exact"]:
        pytest.skip("this kernel does not let a process reset its peak resident set (/proc/self/clear_refs)")
    assert streamed["tensors"] == 32 and streamed["largest_file_bytes"] == file_bytes
    assert streamed["largest_tensor_bytes"] == 1024 * 1024 * np.dtype(DTYPES[stored]).itemsize
    # On the CPU backend the placed weights are host memory too: what the load needed beyond them
    # is the transient, and beyond the weights the growth is a few tensors, not a second copy.
    assert streamed["transient_host_bytes"] < 0.5 * file_bytes
    assert streamed["peak_host_bytes"] - r["placed"] < 0.5 * file_bytes
    # the measurement sees a second copy when there is one: above the streamed bound of 0.5x, which
    # is the control's whole point (it measures 0.57-1.0x of the file here: under load some MB of the
    # copy land in pages already resident; 0.69x in a full `make test` on 2026-12-03, 0.57x on 12-04)
    assert copied["peak_host_bytes"] - r["placed"] > 0.5 * file_bytes
