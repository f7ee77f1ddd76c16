"""Issue 32's bug list, each as a newcomer met it: `cache explain` on text models, `serve --port
99999`, `train-digits --steps 30`, `serve <missing folder>`, `--dtype float64`, a tiny FLUX's
default size in `bench compare`, and `cache info` on hard-linked weights."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request

import pytest
from click.testing import CliRunner

from preheat.cli import main
from tests._support.sd_fixtures import save_tiny_sd
from tests._support.reference import save_tiny_pipeline
from tests._support.compare_children import ChildStarted, stop_at_children


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def sd1(tmp_path_factory):
    return save_tiny_sd(tmp_path_factory.mktemp("newcomer") / "sd1", kind="sd1")


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    return save_tiny_pipeline(tmp_path_factory.mktemp("newcomer") / "digits")


def explained(*args) -> str:
    r = run("cache", "explain", *args)
    assert r.exit_code == 0, r.output
    (line,) = [l for l in r.stdout.splitlines() if l.startswith(("hit:", "miss:"))]
    return line


def test_explain_on_a_text_model_takes_samples_options_and_defaults(sd1, tmp_path):
    """Bug 1: `explain --prompt` said "prompt is required"; --width/--height were ignored; its
    --n defaulted to 1 where sample's is the model's; it had no --dtype."""
    call = ("--prompt", "a fox", "--steps", 2)
    r = run("sample", sd1, *call, "--out", tmp_path / "s.png", "--quiet")
    assert r.exit_code == 0, r.output
    assert explained(sd1, *call).startswith("hit:")  # sample's default n, dtype and size
    assert "signature.dtype" in explained(sd1, *call, "--dtype", "bfloat16")
    assert "signature.sample_shape" in explained(sd1, *call, "--width", 64)
    assert "signature.batch" in explained(sd1, *call, "--n", 2)


def test_explain_on_a_class_model_defaults_to_samples_batch(digits, tmp_path):
    """Bug 1: right after `preheat sample` (16 images), `explain` with no --n reported a miss."""
    r = run("sample", digits, "--steps", 2, "--out", tmp_path / "s.png", "--quiet")
    assert r.exit_code == 0, r.output
    assert explained(digits, "--steps", 2).startswith("hit:")


def test_a_flag_the_model_does_not_take_is_named_as_a_flag(digits, tmp_path):
    """Errors name the flags: `--prompt` on a class model lists `--class`, not `class_labels`."""
    r = run("sample", digits, "--prompt", "a seven", "--steps", 2, "--out", tmp_path / "s.png", "--quiet")
    assert r.exit_code == 2
    assert r.output.strip().splitlines() == [
        "error: --prompt does not apply to a pixel model; its inputs are: --class, --timestep-spacing, --timesteps, "
        "--width, --height"]
    assert not (tmp_path / "s.png").exists()


def test_port_out_of_range_is_a_usage_error():
    """Bug 2: `serve --port 99999` printed a 31-line OverflowError traceback."""
    r = run("serve", "--port", 99999)
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert "'--port'" in r.output and "0<=x<=65535" in r.output


def test_train_digits_schedule_takes_any_step_count():
    """Bug 3: `train-digits --steps 30` (any --steps <= 200) died building the LR schedule; the
    shipped model's 3000-step schedule is unchanged."""
    import optax

    from preheat.train.digits import lr_schedule

    for steps in (1, 2, 30, 200, 201):
        schedule = lr_schedule(steps, 2e-3)
        values = [float(schedule(i)) for i in range(steps + 1)]
        assert all(0.0 <= v <= 2e-3 * (1 + 1e-6) for v in values), steps
        assert values[-1] == pytest.approx(2e-3 * 0.05), steps
    shipped = optax.warmup_cosine_decay_schedule(0.0, 2e-3, 200, 3000, 2e-3 * 0.05)
    assert all(float(shipped(i)) == float(lr_schedule(3000, 2e-3)(i)) for i in range(0, 3001, 7))
    r = run("train-digits", "--out", "x", "--steps", 0)
    assert r.exit_code == 2 and "'--steps'" in r.output and "x>=1" in r.output


def _serve(*args, env_extra=None):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env_extra or {})}
    return subprocess.Popen([sys.executable, "-m", "preheat", "serve", *map(str, args), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def test_serve_a_missing_folder_says_why_and_exits_1(tmp_path, monkeypatch):
    """Bug 4: `serve <missing folder>` said only "listening ... STARTING" and kept running. Then
    (issue 55) it started uvicorn and printed ten lines before the error: now one line, before
    the port is bound. In this process: the server's start (``preheat.server.serve.serve``, which
    binds the port) is replaced by a failure, so reaching it fails the test; the real process's
    exit and stderr: the keep-alive test below and tests/server/test_sigterm.py."""
    import preheat.server.serve as serving

    monkeypatch.setenv("PREHEAT_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(serving, "serve", lambda *a, **k: pytest.fail("the server started"))
    r = run("serve", tmp_path / "missing", "--port", 0)
    assert r.exit_code == 1, r.output
    assert r.stderr.strip().splitlines() == [f"error: model path {tmp_path / 'missing'} does not exist"], r.stderr


def test_serve_keep_alive_on_failure_answers_setup_failed(tmp_path):
    """Bug 4, Cog's way: with --keep-alive-on-failure the server stays up and /health-check says
    SETUP_FAILED with the error; SIGTERM then stops it."""
    proc = _serve(tmp_path / "missing", "--keep-alive-on-failure", env_extra={"PREHEAT_HOME": str(tmp_path / "h")})
    try:
        port = None
        for _ in range(200):
            line = proc.stderr.readline()
            found = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
            if found:
                port = int(found.group(1))
            if "set-up failed" in line:
                assert "staying up" in line
                break
        assert port is not None
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health-check", timeout=10) as resp:
            health = json.loads(resp.read())
        assert health["status"] == "SETUP_FAILED" and "does not exist" in json.dumps(health)
        assert proc.poll() is None
        proc.terminate()
        proc.communicate(timeout=60)
    finally:
        proc.kill()


@pytest.mark.parametrize("command", [("sample",), ("warm",), ("serve",), ("cache", "explain")])
def test_dtype_is_a_choice(command):
    """Bug 5: `sample --dtype float64` was accepted (JAX truncated it and compiled a new program)."""
    r = run(*command, "--dtype", "float64")
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert "'--dtype'" in r.output and "'float64' is not one of 'float32', 'bfloat16', 'float16'" in r.output


def test_bench_compare_runs_a_tiny_flux_at_its_tiny_size(tmp_path, monkeypatch):
    """Bug 6: `bench compare flux-tiny-random --quick` ran at the FLUX default (128 latents:
    256x256 with the tiny VAE) and ran out of memory; a tiny random model runs at 32x32."""
    from preheat.bench import compare

    specs = stop_at_children(monkeypatch)
    for name in ("flux-tiny-random", "random:flux-tiny"):
        with pytest.raises(ChildStarted):
            compare.bench_compare(name, paths=("jax",), repeats=1, batch=1, batch_sizes=(1,), workdir=tmp_path)
        assert specs[-1]["inputs"] == {"width": 32, "height": 32}
    with pytest.raises(ChildStarted):
        compare.bench_compare("random:flux-tiny", paths=("jax",), repeats=1, batch=1, batch_sizes=(1,),
                              workdir=tmp_path, inputs={"width": 64, "height": 32})
    assert specs[-1]["inputs"] == {"width": 64, "height": 32}  # given sizes win


def test_cache_info_counts_hard_linked_weights_once(digits, tmp_path, monkeypatch):
    """Bug 7: `cache info` counted the store's snapshot files and their blobs (hard links) twice."""
    from preheat.store import pull

    home = tmp_path / "home"
    monkeypatch.setenv("PREHEAT_HOME", str(home))
    snapshot = pull(str(digits), progress=False)
    on_disk = sum(f.stat().st_size for f in (home / "models" / "blobs").iterdir())
    assert any(f.stat().st_nlink > 1 for f in snapshot.rglob("*") if f.is_file())  # the case: links
    r = run("cache", "info", "--json")
    assert r.exit_code == 0, r.output
    info = json.loads(r.stdout)
    refs = sum(f.stat().st_size for f in (home / "models" / "refs").rglob("*") if f.is_file())
    assert on_disk <= info["models_bytes"] <= on_disk + refs + 4096


def test_library_errors_name_the_flag(sd1, tmp_path):
    """An argument error from the library (``argument="prompt"``) names the input by its flag."""
    r = run("sample", sd1, "--steps", 2, "--out", tmp_path / "s.png", "--quiet")
    assert r.exit_code == 2
    assert r.stderr.strip().splitlines() == ["error: --prompt is required: a string or one string per image"]
    assert not (tmp_path / "s.png").exists()
