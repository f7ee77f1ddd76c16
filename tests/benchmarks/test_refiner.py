"""``benchmarks/refiner.py``: a real run at the tiny size, through the CLI (what it measures is
docs/benchmarks.md's; here, that it runs each condition and reports them side by side), and the
random refiner it makes is one diffusers' refiner pipeline loads."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from benchmarks.refiner import main


@pytest.mark.slow  # builds a tiny SDXL folder and its refiner, compiles two programs
def test_bench_refiner_times_each_condition_and_their_ratios(tmp_path, monkeypatch):
    monkeypatch.setenv("PREHEAT_HOME", str(tmp_path / "home"))
    out = tmp_path / "refiner.json"
    result = CliRunner().invoke(main, ["random:sdxl-tiny", "--n", "1", "--steps", "3",
                                       "--repeats", "2", "--report", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert [r["condition"] for r in report["rows"]] == ["base", "ensemble", "base only"]
    for row in report["rows"]:
        assert row["call_s"]["n"] == row["denoise_s"]["n"] == 2 and row["images_per_s"] > 0
    by = {r["condition"]: r for r in report["rows"]}
    assert report["ratios"]["ensemble_vs_base"] == pytest.approx(by["ensemble"]["images_per_s"]
                                                                 / by["base"]["images_per_s"])
    assert report["family"] == "stable-diffusion-xl" and report["size"] == [32, 32]
    assert "the ensemble (denoising_end 0.8) / the base alone" in result.output


@pytest.mark.slow  # a tiny SDXL folder and diffusers' pipeline
def test_the_random_refiner_is_one_diffusers_loads(tmp_path):
    from diffusers import DiffusionPipeline

    from preheat.bench.random_models import build_random
    from benchmarks.refiner import write_random_refiner

    base = build_random("sdxl-tiny", tmp_path / "base")
    refiner = DiffusionPipeline.from_pretrained(write_random_refiner(base, tmp_path / "refiner"))
    assert type(refiner).__name__ == "StableDiffusionXLImg2ImgPipeline" and refiner.text_encoder is None
    assert refiner.config.requires_aesthetics_score and refiner.unet.config.projection_class_embeddings_input_dim == (
        refiner.text_encoder_2.config.projection_dim + 5 * refiner.unet.config.addition_time_embed_dim)


def test_bench_refiner_refuses_a_model_that_is_not_an_sdxl_base(tmp_path):
    result = CliRunner().invoke(main, ["random:sd1-tiny", "--n", "1", "--repeats", "1"],
                                env={"PREHEAT_HOME": str(tmp_path)})
    assert result.exit_code != 0
    assert result.output.strip().splitlines()[-1] == ("error: random:sd1-tiny is not an SDXL base; bench an SDXL "
                                                      "folder (e.g. random:sdxl-tiny)")
