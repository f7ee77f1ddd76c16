"""Scanned transformer stages (``preheat.models.stacking``): the same numbers as the unrolled
blocks, for plain, fp8-stored, deferred and LoRA-carrying weights; the checkpoint's keys round-trip."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from preheat.errors import InvalidArgumentError
from preheat.models.adapters import Adapters, attach, targets
from preheat.models.stacking import BlockStack, scan_min, unstack
from preheat.models.unet2d_condition import load_unet_condition
from preheat.models.weights import DeferredFills, LoadOptions
from tests._support.unet_condition_fixtures import jax_output, save_tiny_unet_condition, tiny_config, tiny_inputs

DEEP = dict(transformer_layers_per_block=[1, 3])  # TINY_SDXL with a 3-block stage: scanned


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_unet_condition(tmp_path_factory.mktemp("deep"), "sdxl", **DEEP)


@pytest.fixture(scope="module")
def inputs():
    return tiny_inputs(tiny_config("sdxl", **DEEP), batch=2, seed=0)


def _load(folder, monkeypatch, scan: bool, **kw):
    with monkeypatch.context() as m:
        m.setenv("PREHEAT_SCAN_MIN", "3" if scan else "off")
        return load_unet_condition(folder, **kw)


def _stacks(unet):
    return [v for _, v in nnx.iter_graph(nnx.merge(unet.graphdef, unet.params)) if isinstance(v, BlockStack)]


def test_scanned_stages_match_the_unrolled_blocks(folder, inputs, monkeypatch):
    flat, scanned = _load(folder, monkeypatch, False), _load(folder, monkeypatch, True)
    assert not _stacks(flat)
    assert [s.n for s in _stacks(scanned)] == [3, 3, 3, 3]  # down 1, mid, up 0's two
    np.testing.assert_allclose(jax_output(scanned, inputs), jax_output(flat, inputs), rtol=0, atol=2e-5)


def test_unstack_gives_back_the_checkpoints_leaves(folder, monkeypatch):
    flat, scanned = _load(folder, monkeypatch, False), _load(folder, monkeypatch, True)
    want = {tuple(map(str, k)): v.get_value() for k, v in nnx.to_flat_state(flat.params)}
    got = {tuple(map(str, k)): v.get_value() for k, v in nnx.to_flat_state(unstack(scanned.params))}
    assert got.keys() == want.keys()
    for key, value in want.items():
        np.testing.assert_array_equal(np.asarray(got[key]), np.asarray(value), err_msg=".".join(key))


def test_deferred_reads_stack_after_they_run(folder, inputs, monkeypatch):
    pending = DeferredFills()
    scanned = _load(folder, monkeypatch, True, options=LoadOptions(pending=pending))
    leaves = jax.tree.leaves(scanned.params)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)  # shapes only: the compile key's
    pending.run()
    flat = _load(folder, monkeypatch, False)
    np.testing.assert_allclose(jax_output(scanned, inputs), jax_output(flat, inputs), rtol=0, atol=2e-5)


def test_fp8_storage_upcasts_each_block_inside_the_scan(folder, inputs, monkeypatch):
    options = LoadOptions(weights_dtype="float8_e4m3fn")
    flat = _load(folder, monkeypatch, False, options=options)
    scanned = _load(folder, monkeypatch, True, options=options)
    stacked = [v for k, v in nnx.to_flat_state(scanned.params) if "stacked" in map(str, k) and k[-1] == "kernel"]
    assert stacked and all(v.get_value().dtype == jnp.float8_e4m3fn for v in stacked)
    np.testing.assert_allclose(jax_output(scanned, inputs), jax_output(flat, inputs), rtol=0, atol=2e-5)


def test_lora_reaches_every_scanned_block(folder, inputs, monkeypatch):
    flat, scanned = _load(folder, monkeypatch, False), _load(folder, monkeypatch, True)
    layers = targets(flat.graphdef, flat.params)
    assert targets(scanned.graphdef, scanned.params) == layers  # per-block paths, the checkpoint's
    k, r = 2, 4
    keys = iter(jax.random.split(jax.random.key(0), 2 * len(layers)))
    factors = {path: (jax.random.normal(next(keys), (k, cin, r)) * 0.1, jax.random.normal(next(keys), (k, r, cout)) * 0.1)
               for path, (cin, cout) in layers.items()}
    lora = Adapters(factors, jnp.ones((k, r)), jnp.array([0, 1], jnp.int32))
    x = jnp.transpose(jnp.asarray(inputs["sample"]), (0, 2, 3, 1))
    added = {"text_embeds": inputs["text_embeds"], "time_ids": inputs["time_ids"]}

    def run(unet, lora):
        return jax.jit(lambda p, lo: unet.apply(p, x, inputs["timestep"], inputs["encoder_hidden_states"], added,
                                                lora=lo))(unet.params, lora)

    base, want, got = run(flat, None), run(flat, lora), run(scanned, lora)
    assert float(jnp.abs(want - base).max()) > 1e-2  # the adapters change the output
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=5e-5)
    # one scanned block's adapter alone moves the output: the slice reaches its block
    one = {p: (f[0] * 0, f[1] * 0) for p, f in factors.items()}
    path = "mid_block.attentions.0.transformer_blocks.2.ff.net.2"
    one[path] = factors[path]
    lone = Adapters(one, lora.scales, lora.index)
    np.testing.assert_allclose(np.asarray(run(scanned, lone)), np.asarray(run(flat, lone)), rtol=0, atol=5e-5)
    assert float(jnp.abs(run(scanned, lone) - base).max()) > 1e-4
    assert attach(nnx.merge(scanned.graphdef, scanned.params), None) is not None


def test_scan_min_setting(monkeypatch):
    monkeypatch.delenv("PREHEAT_SCAN_MIN", raising=False)
    assert scan_min() == 3
    monkeypatch.setenv("PREHEAT_SCAN_MIN", "off")
    assert scan_min() is None
    for bad in ("1", "many"):
        monkeypatch.setenv("PREHEAT_SCAN_MIN", bad)
        with pytest.raises(InvalidArgumentError, match="PREHEAT_SCAN_MIN"):
            scan_min()
