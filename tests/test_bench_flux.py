"""The Flux benchmark's pieces that can be checked without writing the 4.7 GB folder: its T5
tokenizer against transformers', its configs against each other, and bench compare's defaults."""

from __future__ import annotations

from pathlib import Path

import pytest

from preheat.bench.random_models import (FLUX_CLIP, FLUX_T5, FLUX_TRANSFORMER, FLUX_VAE, TEXT_ARCHITECTURES,
                                         t5_pieces, write_t5_tokenizer)

PROMPTS = ["a watercolor fox", "A Photo of  the cat, riding 12 horses!", "  zzz  ", "portrait <extra_id_3> night", ""]


@pytest.fixture(scope="module")
def t5_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_t5_tokenizer(tmp_path_factory.mktemp("flux") / "tokenizer_2")


def test_t5_tokenizer_matches_transformers(t5_folder: Path) -> None:
    from transformers import T5TokenizerFast

    from preheat.models.t5_tokenizer import T5Tokenizer

    ours = T5Tokenizer.from_folder(t5_folder, max_length=512).encode(PROMPTS)
    ref = T5TokenizerFast.from_pretrained(str(t5_folder))(PROMPTS, padding="max_length", max_length=512,
                                                          truncation=True)["input_ids"]
    assert ours.tolist() == ref
    assert int(ours.max()) < FLUX_T5["vocab_size"]


def test_t5_pieces_are_unique_in_t5_order() -> None:
    pieces = [p for p, _ in t5_pieces()]
    assert len(pieces) == len(set(pieces))
    assert pieces[:3] == ["<pad>", "</s>", "<unk>"] and pieces[-1] == "<extra_id_0>"


def test_flux_configs_fit_together() -> None:
    assert TEXT_ARCHITECTURES["flux-random"] == "save_random_flux"
    assert FLUX_CLIP["hidden_size"] == FLUX_TRANSFORMER["pooled_projection_dim"]
    assert FLUX_T5["d_model"] == FLUX_TRANSFORMER["joint_attention_dim"]
    assert FLUX_TRANSFORMER["in_channels"] == 4 * FLUX_VAE["latent_channels"]
    assert sum(FLUX_TRANSFORMER["axes_dims_rope"]) == FLUX_TRANSFORMER["attention_head_dim"]


def test_compare_defaults_to_a_flow_sampler_for_flow_folders(tmp_path: Path) -> None:
    from preheat.bench.compare import _resolve_defaults

    (tmp_path / "scheduler").mkdir()
    (tmp_path / "model_index.json").write_text('{"_class_name": "FluxPipeline"}')
    (tmp_path / "scheduler" / "scheduler_config.json").write_text('{"_class_name": "FlowMatchEulerDiscreteScheduler"}')
    assert _resolve_defaults(str(tmp_path), None, 2, None)["sampler"] == "flow_euler"
    (tmp_path / "scheduler" / "scheduler_config.json").write_text('{"_class_name": "DDIMScheduler"}')
    assert _resolve_defaults(str(tmp_path), None, 2, None)["sampler"] == "ddim"
