"""`preheat bench serve` end to end, small: a subprocess server, concurrent clients, exactly-once."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from preheat.cli.bench import bench_serve_command


def test_bench_serve_small(model_dir: Path, tmp_path: Path) -> None:
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
