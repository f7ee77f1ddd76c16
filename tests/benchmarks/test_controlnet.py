"""``benchmarks/controlnet.py``: a real run at the tiny size, through the CLI (what it measures is
docs/benchmarks.md's; here, that it runs each condition and reports them side by side)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from benchmarks.controlnet import main


@pytest.mark.slow  # builds a tiny SD 1.x folder and its ControlNet, compiles two programs
def test_bench_controlnet_times_each_condition_and_their_ratios(tmp_path, monkeypatch):
    monkeypatch.setenv("PREHEAT_HOME", str(tmp_path / "home"))
    out = tmp_path / "controlnet.json"
    result = CliRunner().invoke(main, ["random:sd1-tiny", "--n", "1", "--steps", "2",
                                       "--repeats", "2", "--report", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert [r["condition"] for r in report["rows"]] == ["none", "controlnet", "window"]
    for row in report["rows"]:
        assert row["call_s"]["n"] == row["denoise_s"]["n"] == 2 and row["images_per_s"] > 0
        assert 0 < row["denoise_s"]["min"] <= row["denoise_s"]["median"] <= row["denoise_s"]["max"]
    by = {r["condition"]: r for r in report["rows"]}
    ratios = report["ratios"]
    assert ratios["controlnet_vs_none"] == pytest.approx(by["controlnet"]["images_per_s"] / by["none"]["images_per_s"])
    assert report["family"] == "stable-diffusion" and report["size"] == [32, 32]
    assert "with a ControlNet / without" in result.output


def test_bench_controlnet_refuses_a_model_without_a_unet(tmp_path):
    result = CliRunner().invoke(main, ["random:flux-tiny", "--n", "1", "--repeats", "1"],
                                env={"PREHEAT_HOME": str(tmp_path)})
    assert result.exit_code != 0
    assert result.output.strip().splitlines()[-1] == ("error: random:flux-tiny has no UNet for a ControlNet; bench an "
                                                      "SD 1.x/2.x or SDXL folder (e.g. random:sd-small)")
