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


FLUX_DEEP = dict(patch_size=1, in_channels=16, num_layers=3, num_single_layers=3, attention_head_dim=16,
                 num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[4, 4, 8],
                 guidance_embeds=True)


def _random(abstract, seed, quantise=False):
    """Random weights for an abstract State; ``quantise``: the blocks' Linear kernels as scaled fp8
    (``Quantised``, a per-output scale), as a scaled fp8 file places them."""
    from preheat.models.quantised import Quantised

    out = []
    for i, (path, var) in enumerate(nnx.to_flat_state(abstract)):
        s = var.get_value()
        x = jax.random.normal(jax.random.fold_in(jax.random.key(seed), i), s.shape) * 0.2
        names = [str(p) for p in path]
        if quantise and names[-1] == "kernel" and len(s.shape) == 2 and "transformer_blocks" in names[0]:
            scale = jnp.abs(jax.random.normal(jax.random.fold_in(jax.random.key(seed + 1), i), (1, s.shape[1]))) + 0.5
            x = Quantised(x.astype(jnp.float8_e4m3fn), scale)
        out.append((path, var.replace(x)))
    return nnx.from_flat_state(out)


@pytest.mark.parametrize("quantise", [False, True], ids=["plain", "scaled-fp8"])
def test_flux_scanned_streams_lora_and_scaled_fp8(quantise):
    from preheat.models.flux import FluxTransformer, FluxTransformer2DModel, FluxTransformerConfig, build_abstract
    from preheat.models.stacking import stack

    cfg = FluxTransformerConfig.from_dict(FLUX_DEEP)
    graph, abstract = build_abstract(cfg)
    flat = FluxTransformer(cfg, graph, _random(abstract, 0, quantise))
    sgraph, sparams = stack(lambda rngs: FluxTransformer2DModel(cfg, rngs=rngs, stacked=True), _random(abstract, 0, quantise))
    scanned = FluxTransformer(cfg, sgraph, sparams)
    assert [s.n for s in _stacks(scanned)] == [3, 3]
    rng = np.random.RandomState(0)
    s_tokens, t_tokens, b = 20, 7, 2
    args = (rng.randn(b, s_tokens, 16), rng.randn(b, t_tokens, 32), rng.randn(b, 32), np.full((b,), 0.5),
            np.zeros((s_tokens, 3)), np.zeros((t_tokens, 3)), np.full((b,), 3.5))
    args = tuple(jnp.asarray(a, jnp.float32) for a in args)
    layers = targets(graph, flat.params)
    assert targets(sgraph, scanned.params) == layers
    keys = iter(jax.random.split(jax.random.key(3), 2 * len(layers)))
    factors = {p: (jax.random.normal(next(keys), (2, i, 4)) * 0.1, jax.random.normal(next(keys), (2, 4, o)) * 0.1)
               for p, (i, o) in layers.items()}
    lora = Adapters(factors, jnp.ones((2, 4)), jnp.array([1, 0], jnp.int32))
    for adapters in (None, lora):
        want = jax.jit(lambda p, lo: flat.apply(p, *args, lora=lo))(flat.params, adapters)
        got = jax.jit(lambda p, lo: scanned.apply(p, *args, lora=lo))(scanned.params, adapters)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=5e-5)
