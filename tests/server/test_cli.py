"""The click commands: argument checks fail in one line, before anything loads."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from preheat.cli.bench import bench_serve_command
from preheat.cli.serve import serve_command


@pytest.mark.parametrize(("args", "message"), [
    (["--max-batch-size", "0"], "--max-batch-size 0 must be in 1..1024"),
    (["--max-queue", "0"], "--max-queue 0 must be >= 1"),
    (["--batch-wait-ms", "-1"], "--batch-wait-ms -1.0 must be >= 0"),
    (["--samplers", "dpmpp_2m,k_lms"], "--samplers 'k_lms' is unknown"),
    (["--header-timeout-s", "0"], "--header-timeout-s 0.0 must be > 0"),
    (["--body-timeout-s", "-1"], "--body-timeout-s -1.0 must be > 0"),
    (["--max-body-bytes", "0"], "--max-body-bytes 0 must be >= 1"),
    (["--webhook-allow", "10.0.0.0/99"], "--webhook-allow: webhook allow-list entry '10.0.0.0/99' is not a valid CIDR"),
    (["--lora-url-allow", "10.0.0.0/99"], "--lora-url-allow: webhook allow-list entry '10.0.0.0/99' is not a valid CIDR"),
    (["--ray", "--lora-url-allow-private"], "--lora-url-allow(-private) are not passed to Ray replicas"),
    (["--backend", "torch", "--weights-dtype", "float8_e4m3fn"], "--weights-dtype applies to --backend jax"),
    (["--compile", "regional"], "--compile regional applies to --backend torch"),
    (["--max-loras", "0"], "--max-loras 0 must be >= 1"),
    (["--max-image-pixels", "0"], "--max-image-pixels 0 must be >= 1"),
    (["--lora-ranks", "16,24"], "LoRA rank bucket(s) 24 are not rank buckets; buckets: 16, 32, 64, 128"),
    (["--lora-ranks", "x"], "--lora-ranks 'x' must be rank buckets"),
    (["--fetch-deadline-s", "0"], "--fetch-deadline-s 0.0 must be > 0"),
    (["--fetch-connect-timeout-s", "-1"], "--fetch-connect-timeout-s -1.0 must be > 0"),
    (["--max-lora-bytes", "0"], "--max-lora-bytes 0 must be >= 1"),
    (["--max-fetches", "0"], "--max-fetches 0 must be >= 1"),
    (["--fetch-per-host", "0"], "--fetch-per-host 0 must be >= 1"),
    (["--max-header-bytes", "10"], "--max-header-bytes 10 must be >= 1024"),
    (["--retune-idle-s", "soon"], "--retune-idle-s 'soon' must be seconds (a number) or off"),
    (["--retune-idle-s", "-1"], "--retune-idle-s '-1' must be >= 0 seconds, or off"),
])
def test_serve_rejects_bad_options_in_one_line(args: list[str], message: str) -> None:
    result = CliRunner().invoke(serve_command, args)
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines() == [f"error: {result.output.strip()[7:]}"]
    assert message in result.output


def test_bench_serve_rejects_bad_counts() -> None:
    result = CliRunner().invoke(bench_serve_command, ["--requests", "0"])
    assert result.exit_code == 2 and result.output.startswith("error: ")


def test_serve_compile_reaches_the_torch_loader(monkeypatch: pytest.MonkeyPatch) -> None:
    import preheat.backends.torch as torch_backend
    from preheat.server.core import CoreConfig, load_pipeline

    calls = []
    monkeypatch.setattr(torch_backend, "load_torch_pipeline", lambda model, **kw: calls.append((model, kw)) or "pipe")
    assert load_pipeline(CoreConfig(model="m", backend="torch", compile="regional")) == "pipe"
    assert calls == [("m", {"dtype": "float32", "compile": "regional", "variant": None, "cache": None})]


def test_serve_ray_passes_the_load_options_to_every_replica(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """`serve --ray` once refused --variant, --cache, --weights-dtype, --config and --no-progress;
    now each replica's core gets them, as a local `serve` does."""
    pytest.importorskip("ray.serve")
    import preheat.integrations.ray as on_ray

    seen = []
    monkeypatch.setattr(on_ray, "run", lambda options, **kw: seen.append(options) or 0)
    file = tmp_path / "model.safetensors"
    file.write_bytes(b"")  # never read: run() is replaced
    result = CliRunner().invoke(serve_command, [str(file), "--ray", "--config", str(tmp_path), "--variant", "fp16",
                                                "--cache", "xla", "--weights-dtype", "float8_e4m3fn", "--no-progress",
                                                "--retune-idle-s", "off"])
    assert result.exit_code == 0, result.output
    config = seen[0].core_config()  # what each replica's server runs
    assert (config.model, config.config, config.variant, config.cache, config.weights_dtype, config.progress,
            config.retune_idle_s) == (str(file), str(tmp_path), "fp16", "xla", "float8_e4m3fn", False, None)


def test_serve_missing_second_folders_name_their_flag(tmp_path) -> None:
    for flag in ("--controlnet", "--refiner"):
        result = CliRunner().invoke(serve_command, [flag, str(tmp_path / "gone")])
        assert result.exit_code == 1, result.output
        assert result.output.strip() == f"error: {flag}: model path {tmp_path / 'gone'} does not exist"
