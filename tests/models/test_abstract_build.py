"""Abstract builds without nnx.eval_shape (issue 17): the same graph and the same parameter shapes
and dtypes as nnx.eval_shape of the same constructor (the reference), and nothing computed."""

from __future__ import annotations

import jax
import pytest
from flax import nnx

from preheat.models import weights
from preheat.models.clip import CLIPTextConfig, CLIPTextModel
from preheat.models.t5 import T5Config, T5EncoderModel
from preheat.models.unet2d import UNet2DConfig, UNet2DModule
from tests._support.reference import TINY_CLASS_CONDITIONAL

CASES = {
    "unet2d": lambda: (UNet2DModule, UNet2DConfig.from_dict(TINY_CLASS_CONDITIONAL)),
    "clip": lambda: (CLIPTextModel, CLIPTextConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                                   projection_dim=8, num_hidden_layers=2, num_attention_heads=2,
                                                   max_position_embeddings=8, model_class="CLIPTextModelWithProjection")),
    "t5": lambda: (T5EncoderModel, T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2,
                                            feed_forward_proj="gated-gelu")),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_direct_abstract_build_equals_eval_shape(name):
    cls, config = CASES[name]()
    graphdef, state = weights.build_abstract(lambda rngs: cls(config, rngs=rngs))
    ref_graphdef, ref_state = nnx.split(nnx.eval_shape(lambda: cls(config, rngs=weights.OneKey())))  # the old path
    # the same tree (paths, Variable types and their metadata), shapes and dtypes
    assert jax.tree_util.tree_structure(state) == jax.tree_util.tree_structure(ref_state)
    shapes = jax.tree.map(lambda x: (x.shape, x.dtype), state)
    assert shapes == jax.tree.map(lambda x: (x.shape, x.dtype), ref_state)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(state))
    # the same graph: each graph takes the other's state (a Variable's metadata order aside, they are equal)
    assert type(nnx.merge(graphdef, ref_state)) is type(nnx.merge(ref_graphdef, state)) is cls


def test_abstract_build_draws_no_random_numbers(monkeypatch):
    """Every UNet parameter is made by weights.param: in an abstract build no initialiser runs."""
    def refuse(*a, **k):
        raise AssertionError("an initialiser ran during an abstract build")

    monkeypatch.setattr(jax.random, "uniform", refuse)
    monkeypatch.setattr(jax.random, "normal", refuse)
    weights.build_abstract(lambda rngs: UNet2DModule(UNet2DConfig.from_dict(TINY_CLASS_CONDITIONAL), rngs=rngs))


def test_outside_an_abstract_build_param_initialises():
    import jax.numpy as jnp
    import numpy as np

    made = weights.param((2, 3), lambda: jnp.full((2, 3), 0.5))
    assert isinstance(made.get_value(), jax.Array) and np.array_equal(made.get_value(), np.full((2, 3), 0.5))
