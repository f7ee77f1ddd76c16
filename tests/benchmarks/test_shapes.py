"""`benchmarks/shapes.py`: which children run, on which cache roots, and the table they
make (the measurement itself is the command's; see docs/benchmarks.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from benchmarks import shapes

SIZES = (32, 48)


def _fake_child(calls: list[dict]):
    """A child's report: static stores one entry per size, dynamic one for all; a size whose
    entry is missing compiles (2 frames, 9 s), else loads (1 s) or runs from memory."""

    def run(spec: dict, home: Path, workdir: Path, timeout: float) -> dict:
        kind = home / "compile" / "torch"
        kind.mkdir(parents=True, exist_ok=True)
        stored = {p.name for p in kind.iterdir()}
        phase = "cold" if not stored else ("partial" if home.name.endswith("partial") else "warm")
        calls.append({"setting": spec["setting"], "phase": phase, "home": home.name, "stored": sorted(stored),
                      "eager": spec["eager"]})
        sizes, seen = {}, set()
        for size in spec["resolutions"]:
            key = f"{spec['setting']}-{size if spec['setting'] == 'static' else 'all'}"
            if key in seen:
                layer, first, frames = "memory", 0.1, 0
            elif key in stored:
                layer, first, frames = "mega", 1.1, 0
            else:
                (kind / key).mkdir()
                layer, first, frames = "none", 9.1, 2
            seen.add(key)
            steady = {"median": 0.1, "min": 0.1, "max": 0.1, "n": 2}
            sizes[str(size)] = {"first_call_s": first, "frames": frames, "fxgraph_miss": frames, "layers": [layer],
                                "keys": [] if layer == "memory" else [key], "call_s": steady, "denoiser_s": steady,
                                "calls": [0.1, 0.1], "denoiser_calls": [0.05, 0.05]}
        report = {"setting": spec["setting"], "sizes": sizes, "start_to_first_image_s": 5.0,
                  "load_average_1m": [1.0, 1.0]}
        if spec["eager"]:
            report["eager"] = {str(s): {"denoiser_s": steady} for s in spec["resolutions"]}
        return report

    return run


def test_children_and_table(monkeypatch, tmp_path):
    calls: list[dict] = []
    monkeypatch.setattr(shapes, "_run_child", _fake_child(calls))
    folder = tmp_path / "model"
    folder.mkdir()
    result = shapes.bench_torch_shapes((str(folder),), SIZES, "regional", 2, 2, tmp_path)
    assert [(c["setting"], c["phase"]) for c in calls] == [(s, p) for p in ("cold", "warm", "partial")
                                                             for s in ("static", "dynamic")]
    partial = {c["setting"]: c["stored"] for c in calls if c["phase"] == "partial"}
    assert partial == {"static": ["static-32"], "dynamic": ["dynamic-all"]}  # only what 32² stored
    assert [c["eager"] for c in calls] == [True] + [False] * 5
    model = result["models"]["model"]
    assert model["entries"] == {"static": 2, "dynamic": 1}
    rows = {row["what"]: row for row in model["table"]}
    assert rows["cold: extra compile s at 48²"]["static"] == pytest.approx(9.0)
    assert rows["cold: extra compile s at 48²"]["dynamic"] == pytest.approx(0.0)
    assert rows["partial (only 32² stored): first call s at 48²"]["note"].startswith("layers none / memory")
    text = shapes.markdown(result)
    assert "| cold: frames compiled, all sizes | 4 | 2 | 0.50× |" in text


@pytest.mark.parametrize("args, message", [
    (["--resolutions", "32,x"], "distinct comma-separated positive ints"),
    (["--resolutions", "32,32"], "distinct comma-separated positive ints"),
    (["--repeats", "0"], "must be >= 1"),
    (["/no/such/folder"], "neither a diffusers pipeline folder"),
])
def test_bad_options_are_one_line_errors(args, message):
    result = CliRunner().invoke(shapes.main, args)
    assert result.exit_code != 0 and message in result.output
