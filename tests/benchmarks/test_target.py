"""`benchmarks/target.py`: the real command, for XLA's H200 description (deviceless: no GPU here).

The table is read back and checked against the command's own JSON report: one row per compiled
stage of each model's call, compile seconds and executable bytes on both sides, and the two ratio
columns equal to the target's number over the CPU's. An unknown target is one line.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from preheat import platforms
from benchmarks.target import main
from tests._support.tiers import gpu_only

# every test here compiles for a GPU with the CUDA plugin, which only make test-slow installs (the
# test-gpu extra): the whole module runs there, where the plugin is
pytestmark = [pytest.mark.skipif(not any(k.startswith("jax-cuda") for k in platforms.cuda_versions()),
                                 reason="needs the test-gpu extra's jax-cuda13-plugin (make test-slow installs it)"),
              gpu_only]

COLUMNS = ["model", "stage", "dtype", "target trace+lower s", "target compile s", "target bytes",
           "CPU trace+lower s", "CPU compile s", "CPU bytes", "compile target/CPU", "bytes target/CPU",
           "cuDNN calls left unfinished"]


def _table(text: str) -> list[dict[str, str]]:
    """The markdown table's rows, by column name (the header must be ``COLUMNS``)."""
    lines = [line for line in text.splitlines() if line.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header == COLUMNS, header
    assert re.fullmatch(r"\|(---\|)+", lines[1])
    return [dict(zip(header, (c.strip() for c in line.strip("|").split("|")))) for line in lines[2:]]


@pytest.mark.slow  # two models, each stage compiled twice (H200 and CPU): about a minute on 2 cores
def test_bench_target_h200_gives_one_row_per_stage_with_both_sides_and_their_ratios(tmp_path, monkeypatch):
    monkeypatch.setenv("PREHEAT_HOME", str(tmp_path / "home"))
    report = tmp_path / "report.json"
    result = CliRunner().invoke(main, ["--target", "h200", "--no-full-size", "--report", str(report)])
    assert result.exit_code == 0, result.output
    data = json.loads(report.read_text())
    assert data["target"] == "h200"
    rows = data["rows"]
    # the built-in model's one program (the whole sampling loop); tiny SD 1.x's text encoder, loop and decoder
    assert [(r["model"], r["stage"]) for r in rows] == [
        ("built-in", "denoise"), ("tiny SD 1.x", "encode"), ("tiny SD 1.x", "denoise"), ("tiny SD 1.x", "decode")]
    table = _table(result.output)
    assert len(table) == len(rows)
    for row, cells in zip(rows, table):
        assert (cells["model"], cells["stage"], cells["dtype"]) == (row["model"], row["stage"], "bfloat16")
        for side in ("target", "cpu"):
            assert row[f"{side}_compile_s"] > 0 and row[f"{side}_trace_lower_s"] >= 0
            assert isinstance(row[f"{side}_bytes"], int) and row[f"{side}_bytes"] > 1000  # a real executable
        assert cells["target compile s"] == f"{row['target_compile_s']:.2f}"
        assert cells["CPU compile s"] == f"{row['cpu_compile_s']:.2f}"
        assert cells["target bytes"] == f"{row['target_bytes'] / 1e6:.2f} MB"
        assert cells["CPU bytes"] == f"{row['cpu_bytes'] / 1e6:.2f} MB"
        # the ratios are the numbers' own, in the report and in the table
        assert row["compile_ratio"] == pytest.approx(row["target_compile_s"] / row["cpu_compile_s"], rel=1e-12)
        assert row["bytes_ratio"] == pytest.approx(row["target_bytes"] / row["cpu_bytes"], rel=1e-12)
        assert cells["compile target/CPU"] == f"{row['target_compile_s'] / row['cpu_compile_s']:.2f}×"
        assert cells["bytes target/CPU"] == f"{row['target_bytes'] / row['cpu_bytes']:.2f}×"
        assert cells["cuDNN calls left unfinished"] == "-"  # read only for the full-size UNets
        # the target's executables are the GPU's (PTX kernels, cuDNN graphs), not a copy of the CPU's
        assert row["target_bytes"] != row["cpu_bytes"]


def test_bench_target_with_an_unknown_target_is_one_line(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PREHEAT_HOME", str(tmp_path / "home"))
    result = CliRunner().invoke(main, ["--target", "h300"])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "h300" in lines[0], result.output
    assert "h200" in lines[0]  # it names the targets it knows
