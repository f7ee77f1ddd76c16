"""`preheat bench serve` end to end, small: a subprocess server, concurrent clients, exactly-once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from preheat.cli.bench import bench_serve_command


@pytest.fixture(scope="module")
def bench_home(tmp_path_factory) -> Path:
    """One PREHEAT_HOME for the module's bench runs: whichever runs second loads the programs (its
    offline pipeline's and its server's) from the compile cache the first one wrote, instead of
    compiling them again. Neither test checks compiling; each checks its load and its report."""
    return tmp_path_factory.mktemp("bench-home")


@pytest.fixture(autouse=True)
def _shared_home(_private_cache_root: None, bench_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREHEAT_HOME", str(bench_home))  # after conftest's private root: this one wins


def test_bench_serve_small(model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a pod's deployment variables in the bench's shell: `preheat serve` reads them where a flag is
    # absent, but the bench's server is declared by the bench (its 2-step requests, its sampler)
    monkeypatch.setenv("PREHEAT_MAX_STEPS", "1")
    monkeypatch.setenv("PREHEAT_SAMPLERS", "euler")
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(bench_serve_command, [str(model_dir), "--requests", "24", "--concurrency", "6",
                                                      "--max-batch-size", "2", "--steps", "2", "--timeout-s", "240", "--offline-s", "0.5",
                                                      "--report", str(out)])
    assert result.exit_code == 0, result.output
    record = json.loads(out.read_text())
    assert record["exactly_once"] and record["succeeded"] == 24 and record["server_predictions_succeeded"] == 24
    assert record["server_exit_code"] == 0
    assert record["served_images_per_s"] > 0 and record["offline_images_per_s"] > 0
    assert 1 <= record["mean_batch_images"] <= 2
    assert "| served / offline |" in result.output


def test_bench_serve_stream_small(model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(bench_serve_command, [str(model_dir), "--stream", "--requests", "8", "--concurrency", "4",
                                                      "--max-batch-size", "2", "--steps", "2", "--timeout-s", "240", "--offline-s", "0.5",
                                                      "--report", str(out)])
    assert result.exit_code == 0, result.output
    record = json.loads(out.read_text())
    assert record["exactly_once"] and record["succeeded"] == 8
    # the streamed load, on the same server: every request's completed event succeeded with one image
    assert record["stream_exactly_once"] and record["stream_succeeded"] == 8 and record["stream_distinct_ids"] == 8
    assert record["stream_server_predictions_succeeded"] == 8 and record["stream_steps_logged_min"] == 2
    assert record["stream_ratio"] > 0 and record["server_exit_code"] == 0
    assert 1 <= record["stream_mean_batch_images"] <= 2
    assert "| streamed / JSON served |" in result.output
