"""`preheat bench compare`: four paths, fresh processes, JSON + markdown + PNG."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

pytest.importorskip("torch")
pytest.importorskip("diffusers")

from preheat.bench.compare import PATHS, markdown, plot  # noqa: E402
from preheat.cli.bench import compare_command  # noqa: E402
from tests._support.torch_models import MICRO  # noqa: E402
from tests._support.reference import save_tiny_pipeline  # noqa: E402
from tests._support.compare_children import ChildStarted, stop_at_children


def _stat(v: float) -> dict:
    return {"median": v, "min": v * 0.9, "max": v * 1.2, "n": 3}


def _fake_result() -> dict:
    state = {"cache_layers": ["none"], "process_start_to_first_image_s": _stat(9.0), "first_call_s": _stat(5.0),
             "trace_plus_compile_s": _stat(4.0), "runs": []}
    path = {"errors": [], "empty": state, "warm": {**state, "cache_layers": ["aot"]},
            "steady": {"1": {"per_image_s": _stat(0.02), "images_per_s": 50.0}}, "peak_rss_mb": 900.0,
            "agreement_vs_torch_eager": {"mean_abs": 0.0, "max_abs": 0}}
    return {"settings": {"model": "m", "sampler": "ddim", "steps": 4, "guidance": None, "seed": 0, "batch": 1,
                         "batch_sizes": [1], "repeats": 3, "steady_repeats": 5},
            "machine": {"line": "a machine"}, "paths": {p: path for p in PATHS},
            "goals": {"torch_aot_compile_share_removed": 0.95, "jax_over_torch_compile_images_per_s": {"1": 1.1}}}


def test_markdown_and_chart_from_a_result(tmp_path):
    text = markdown(_fake_result())
    assert all(f"| {p} |" in text for p in PATHS)
    assert "9.00 (8.10–10.80)" in text and "20.0 (18.0–24.0)" in text and "95.0%" in text and "a machine" in text
    plot(_fake_result(), tmp_path / "chart.png")
    assert (tmp_path / "chart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args, message", [
    (["--paths", "jax,torch-tpu"], "--paths: unknown torch-tpu"),
    (["--batch-sizes", "1,x"], "--batch-sizes '1,x' must be"),
    (["--xla-flags", "noequals"], "--xla-flags 'noequals' must be NAME=FLAGS"),
    (["--sampler", "nope"], "unknown sampler 'nope'"),
])
def test_bad_options_are_one_line_errors(args, message):
    result = CliRunner().invoke(compare_command, args)
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output


def test_missing_model_is_a_one_line_error(tmp_path):
    result = CliRunner().invoke(compare_command, [str(tmp_path / "no-model"), "--quick"])
    assert result.exit_code == 1
    assert f"error: model path {tmp_path / 'no-model'} does not exist" in result.output


@pytest.mark.slow
def test_quick_compare_on_a_micro_model(tmp_path):
    model = save_tiny_pipeline(tmp_path / "micro", config=MICRO)
    out, png = tmp_path / "compare.json", tmp_path / "compare.png"
    # torch-inductor's and torch-aot's warm starts from preheat's entries are checked by
    # test_torch_compile_cache; here JAX (compiled, cached) and eager torch keep the run short.
    paths = ("jax", "torch-eager")
    result = CliRunner().invoke(compare_command, [str(model), "--quick", "--repeats", "1", "--steps", "2",
                                                  "--batch-sizes", "1", "--steady-repeats", "1",
                                                  "--paths", ",".join(paths),
                                                  "--report", str(out), "--png-out", str(png)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert set(data["paths"]) == set(paths)
    for name, path in data["paths"].items():
        assert path["errors"] == [], (name, path["errors"])
        assert path["empty"]["process_start_to_first_image_s"]["median"] > 0
        assert path["steady"]["1"]["images_per_s"] > 0
        assert path["peak_rss_mb"] > 0
        # deterministic sampler (the model's dpmpp_2m), same initial noise: every path agrees with eager
        assert path["agreement_vs_torch_eager"]["mean_abs"] <= 1.0, name
    layers = {p: (data["paths"][p]["empty"]["cache_layers"], data["paths"][p]["warm"]["cache_layers"]) for p in paths}
    assert layers["jax"] == (["none"], ["aot"]) and layers["torch-eager"] == (["none"], ["none"])
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert "| torch-eager |" in result.output and "| jax |" in result.output


def test_a_family_s_flags_reach_every_path_typed_by_its_declared_inputs(tmp_path, monkeypatch):
    """`bench compare MODEL --image P --strength S` (image calls on both backends, issue 27): the
    model's own flags are `preheat sample`'s, typed in the parent by the folder's declared family
    (no weight read), and every path's child gets the same keywords; a bad one is one line before
    any child starts."""
    from PIL import Image

    specs = stop_at_children(monkeypatch)
    image = tmp_path / "in.png"
    Image.new("RGB", (32, 32), (200, 90, 40)).save(image)
    work = ["--quick", "--paths", "jax,torch-eager", "--keep", str(tmp_path / "work")]
    r = CliRunner().invoke(compare_command, ["random:sd1-tiny", *work, "--image", str(image), "--strength", "0.6",
                                             "--prompt", "a fox"])
    assert isinstance(r.exception, ChildStarted), r.output
    assert specs[-1]["inputs"] == {"image": str(image), "strength": 0.6, "prompt": "a fox", "width": 32, "height": 32}
    for args, words in [(["--strength", "much"], "--strength 'much' must be a number"),
                        (["--class", "3"], "--class does not apply to a"),
                        (["--prompt", "a", "--prompt", "b", "--guidance-rescale", "x"], "--guidance-rescale"),
                        (["--width"], "--width needs a value")]:
        r = CliRunner().invoke(compare_command, ["random:sd1-tiny", *work, *args])
        assert r.exit_code == 2 and words in r.output and len(r.output.strip().splitlines()) == 1, (args, r.output)
    assert len(specs) == 1  # no child ran for them


@pytest.mark.parametrize("path", ["jax", "torch-eager"])
def test_dtype_reaches_every_path(path):
    """`--dtype bfloat16` (the GPU check's SDXL/FLUX rows): each path's child loads in that dtype,
    and without it each backend keeps its own default (float32)."""
    from preheat.bench.compare import _load_pipe

    assert str(_load_pipe({"path": path, "model": None, "dtype": "bfloat16"}).dtype).endswith("bfloat16")
    assert str(_load_pipe({"path": path, "model": None}).dtype).endswith("float32")


def test_an_unknown_dtype_is_a_one_line_error():
    result = CliRunner().invoke(compare_command, ["--dtype", "float64"])
    assert result.exit_code == 2 and "'float64' is not one of" in result.output and "Traceback" not in result.output


def test_second_model_folders_reach_every_path(tmp_path, monkeypatch):
    """`bench compare MODEL --controlnet CN --control-image P` (and `--refiner`): every path's child
    loads the folder beside the model, and the flags it declares are typed in the parent; a control
    flag without --controlnet is one line naming it, before any child starts."""
    from PIL import Image

    from preheat.bench.compare import _load_pipe
    from tests._support import image_fixtures
    from tests._support.controlnet_fixtures import save_tiny_controlnet

    sd = image_fixtures.save_image_sd(tmp_path / "sd1", "sd1")
    cn = save_tiny_controlnet(tmp_path / "cn", sd)
    specs = stop_at_children(monkeypatch)
    image = tmp_path / "edges.png"
    Image.new("RGB", (32, 32), (200, 90, 40)).save(image)
    work = ["--quick", "--paths", "jax,torch-eager", "--keep", str(tmp_path / "work")]
    r = CliRunner().invoke(compare_command, [str(sd), *work, "--controlnet", str(cn), "--control-image", str(image),
                                             "--controlnet-conditioning-scale", "0.5", "--prompt", "a fox"])
    assert isinstance(r.exception, ChildStarted), r.output
    assert specs[-1]["companions"] == {"controlnet": str(cn.resolve())}
    assert specs[-1]["inputs"] == {"control_image": str(image), "controlnet_conditioning_scale": 0.5,
                                   "prompt": "a fox"}
    r = CliRunner().invoke(compare_command, [str(sd), *work, "--control-image", str(image)])
    assert r.exit_code == 2 and "--control-image" in r.output and len(r.output.strip().splitlines()) == 1, r.output
    for path in ("jax", "torch-eager"):
        pipe = _load_pipe({"path": path, "model": str(sd), "companions": specs[-1]["companions"]})
        assert "control_image" in [s.name for s in pipe.family.input_specs(pipe)], path
