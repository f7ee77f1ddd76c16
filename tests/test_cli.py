"""`preheat sample` from outside: files, report, cache hit on the second run, one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from tests._support.reference import save_tiny_pipeline


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return save_tiny_pipeline(tmp_path_factory.mktemp("cli") / "pipe")


def preheat(*args, home, cwd=None):
    """``python -m preheat ARGS`` in a fresh process: for what a process shows (its exit, its
    stderr as a user sees it, the cache a later process finds, what it imports)."""
    env = {**os.environ, "PREHEAT_HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "preheat", *map(str, args)], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def preheat_here(*args, home, monkeypatch):
    """The same command in this process (click's CliRunner): for what the command does and says,
    where no fresh interpreter needs to import jax and torch again. ``returncode`` as a process's."""
    from click.testing import CliRunner

    from preheat.cli import main

    monkeypatch.setenv("PREHEAT_HOME", str(home))
    r = CliRunner().invoke(main, list(map(str, args)))
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        raise r.exception
    return subprocess.CompletedProcess(args, r.exit_code, r.stdout, r.stderr)


def test_sample_writes_grid_images_and_report_then_hits_the_cache(model, tmp_path):
    out, report = tmp_path / "grid.png", tmp_path / "r.json"
    first = preheat("sample", model, "--n", 4, "--steps", 3, "--class", 7, "--out", out, "--save-images",
                    tmp_path / "each", "--report", report, home=tmp_path / "home")
    assert first.returncode == 0, first.stderr
    assert Image.open(out).size == (2 * 8 * 8, 2 * 8 * 8)  # 2x2 grid, small images upscaled 8x
    assert sorted(p.name for p in (tmp_path / "each").iterdir()) == [f"000{i}.png" for i in range(4)]
    rec = json.loads(report.read_text())
    for key in ("load_s", "weights_s", "trace_lower_s", "compile_s", "compile_or_load_s", "first_call_s",
                "process_start_to_first_image_s", "cache_layer"):
        assert isinstance(rec[key], (int, float, str)), key
    assert rec["batch"] == 4 and rec["steps"] == 3 and rec["sampler"] == "dpmpp_2m"
    assert rec["cache_layer"] in ("none", "xla") and rec["trace_lower_s"] > 0
    # one draw: no warm call timed unless asked (--timing)
    assert not {"second_call_s", "per_image_s", "warm_run_s"} & set(rec) and "second call" not in first.stderr
    second = preheat("sample", model, "--n", 4, "--steps", 3, "--class", 7, "--out", out, "--report", report,
                     "--timing", home=tmp_path / "home")
    assert second.returncode == 0, second.stderr
    rec2 = json.loads(report.read_text())
    assert rec2["cache_layer"] == "aot" and rec2["trace_lower_s"] == 0.0  # loaded, not traced or compiled
    assert all(isinstance(rec2[k], float) for k in ("second_call_s", "per_image_s", "warm_run_s"))
    assert rec2["per_image_s"] == rec2["second_call_s"] / 4 and " · second call " in second.stderr


@pytest.mark.parametrize("timing", [False, True])
def test_sample_draws_once_unless_timing_is_asked(model, tmp_path, monkeypatch, timing):
    """A user who asked for images gets one call (a large model's second call doubled the wait);
    ``--timing`` keeps the warm call of the same inputs."""
    from preheat.engine import Pipeline

    calls = []
    real = Pipeline.__call__
    monkeypatch.setattr(Pipeline, "__call__", lambda self, *a, **kw: calls.append(1) or real(self, *a, **kw))
    r = preheat_here("sample", model, "--n", 1, "--steps", 2, "--out", tmp_path / "s.png", "--json",
                     *(["--timing"] if timing else []), home=tmp_path / "home", monkeypatch=monkeypatch)
    assert r.returncode == 0, r.stderr
    assert len(calls) == (2 if timing else 1)
    assert ("second_call_s" in json.loads(r.stdout)) is timing


@pytest.mark.parametrize("args,needle", [
    (["--sampler", "plms"], "unknown sampler 'plms'"),
    (["--steps", "0"], "'--steps': 0 is not in the range x>=1"),  # the declared Int(1)
    (["--n", "0"], "'--n': 0 is not in the range x>=1"),
    (["--class", "11"], "error: --class=11 is not a class of this model; classes are 0.."),  # named by its flag
    (["--class", "giraffe"], "error: --class='giraffe' is not a class of this model"),
    (["--out", "x.jpg"], "must end in .png"),
    (["--weights-dtype", "float8_e5m3"], "--weights-dtype"),
    (["--weights-dtype", "float8_e4m3fn", "--backend", "torch"], "applies to backend='jax'"),
])
def test_bad_arguments_exit_with_one_line_and_no_file(model, tmp_path, monkeypatch, args, needle):
    """In-process (click's CliRunner: the same command, no fresh interpreter to import jax and
    torch eight times); the real process's exit and stderr are the next test's."""
    from click.testing import CliRunner

    from preheat.cli import main

    monkeypatch.chdir(tmp_path)
    argv = ["sample", str(model), *args, *(["--out", str(tmp_path / "s.png")] if "--out" not in args else ["--quiet"])]
    r = CliRunner().invoke(main, argv)
    assert isinstance(r.exception, SystemExit) and r.exit_code != 0, (r.output, r.exception)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and lines[0].startswith("error: "), r.stderr
    assert not (tmp_path / "s.png").exists() and not (tmp_path / "x.jpg").exists()


def test_a_bad_argument_exits_the_real_process_with_one_line_and_no_file(model, tmp_path):
    """A refusal that comes after the model is read (its classes), from `python -m preheat`."""
    r = preheat("sample", model, "--class", "11", "--out", tmp_path / "s.png", home=tmp_path / "h", cwd=tmp_path)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "--class=11 is not a class" in lines[0], r.stderr
    assert not (tmp_path / "s.png").exists()


@pytest.mark.parametrize("weights_dtype", ["float8_e4m3fn", "int8"])
def test_sample_stores_the_weights_in_8_bits(model, tmp_path, monkeypatch, weights_dtype):
    out, report = tmp_path / "s.png", tmp_path / "r.json"
    r = preheat_here("sample", model, "--n", 2, "--steps", 2, "--weights-dtype", weights_dtype, "--out", out,
                     "--report", report, home=tmp_path / "home", monkeypatch=monkeypatch)
    assert r.returncode == 0, r.stderr
    assert out.is_file() and json.loads(report.read_text())


def test_unreadable_model_path(tmp_path, monkeypatch):
    r = preheat_here("sample", tmp_path / "missing", "--out", tmp_path / "s.png", home=tmp_path / "h",
                     monkeypatch=monkeypatch)
    assert r.returncode == 1 and r.stderr.strip() == f"error: model path {tmp_path / 'missing'} does not exist"
    assert not (tmp_path / "s.png").exists()


def test_cache_cli_lists_verifies_and_explains(model, tmp_path, monkeypatch):
    """In-process: each command reads what the last one left on disk; no process boundary is tested."""
    home = tmp_path / "home"

    def cli(*args):
        return preheat_here(*args, home=home, monkeypatch=monkeypatch)

    assert cli("sample", model, "--n", 2, "--steps", 2, "--out", tmp_path / "s.png", "--quiet").returncode == 0
    ls = cli("cache", "ls")
    assert ls.returncode == 0 and "jax" in ls.stdout and "b=2" in ls.stdout
    assert cli("cache", "verify").returncode == 0
    explain = cli("cache", "explain", model, "--n", 3)
    assert "miss" in explain.stdout and "signature.batch" in explain.stdout
    entry = next((home / "compile" / "jax").iterdir())
    (entry / "executable.bin").write_bytes(b"garbage")
    bad = cli("cache", "verify")
    assert bad.returncode == 1 and "BAD  jax/" in bad.stdout


# What a pixel model's start must not import: other commands' modules, downloads, LoRA, the fleet
# store (none configured) and GPU targets. Each was on `preheat sample`'s path and cost import time.
NOT_ON_A_PIXEL_START = ("preheat.cli.bench", "preheat.cli.serve", "preheat.cli.doctor", "preheat.doctor",
                        "preheat.server", "preheat.bench.", "preheat.store._http", "preheat.store._hf",
                        "preheat.lora", "preheat.cache.remote", "preheat.cache.targets")


def test_sample_on_the_builtin_model_imports_only_its_own_path(tmp_path):
    code = ("import json, sys\nfrom preheat.cli import main\n"
            "try:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
            "print(json.dumps(sorted(sys.modules)))")
    env = {k: v for k, v in os.environ.items() if k != "PREHEAT_CACHE_URL"}
    env["PREHEAT_HOME"] = str(tmp_path / "home")
    r = subprocess.run([sys.executable, "-c", code, "sample", "--n", "1", "--steps", "2", "--quiet", "--out",
                        str(tmp_path / "s.png")], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    loaded = set(json.loads(r.stdout.strip().splitlines()[-1]))
    assert "preheat.engine" in loaded and "preheat.cli.sample" in loaded  # it did run the sample
    assert not {m for m in loaded if m.startswith(NOT_ON_A_PIXEL_START)}


def test_warm_runs_without_the_serve_extra(tmp_path):
    """`preheat warm` is a build step (a CI job, a pod's first start), not a server: it works where
    the serve extra (pydantic, FastAPI, uvicorn) is not installed, as on the lent GPU machine, where
    it once stopped with ``No module named 'pydantic'`` (the sizes parser lived in the server's
    request models)."""
    code = ("import json, sys\n"
            "class NoServeExtra:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] in ('pydantic', 'fastapi', 'uvicorn', 'starlette'):\n"
            "            raise ModuleNotFoundError(f'No module named {name!r}')\n"
            "sys.meta_path.insert(0, NoServeExtra())\n"
            "from preheat.cli import main\n"
            "try:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
            "print(json.dumps(sorted(sys.modules)))")
    r = subprocess.run([sys.executable, "-c", code, "warm", "--dry-run", "--json"],
                       env={**os.environ, "PREHEAT_HOME": str(tmp_path / "home")}, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    loaded = set(json.loads(r.stdout.strip().splitlines()[-1]))
    assert "preheat.cli.warm" in loaded and not {m for m in loaded if m.split(".")[0] == "pydantic"}


def test_the_process_ends_after_atexit_with_the_command_s_code(tmp_path):
    """`preheat` (console script and `python -m preheat`) exits through `cli.run`: atexit handlers run
    (the fleet store's uploads wait there), then the process ends without the interpreter's
    finalisation, which aborted it (exit 134, "FATAL: exception not rethrown") when a background
    executable load was inside XLA as a command failed."""
    marker = tmp_path / "atexit-ran"
    code = ("import atexit, sys\nfrom preheat import cli\n"
            "path = sys.argv[1]\natexit.register(lambda: open(path, 'w').write('ran'))\n"
            "sys.argv = ['preheat', 'sample', '--steps', '0']\ncli.run()")
    r = subprocess.run([sys.executable, "-c", code, str(marker)], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PREHEAT_HOME": str(tmp_path / "home")})
    assert r.returncode == 2 and marker.read_text() == "ran", (r.returncode, r.stderr)
    assert r.stderr.strip().splitlines()[-1] == ("error: Invalid value for '--steps': 0 is not in the range x>=1. "
                                                 "(preheat sample --help)")
    import preheat

    main_module = Path(preheat.__file__).with_name("__main__.py").read_text()
    assert "run()" in main_module  # python -m preheat (importing preheat.__main__ would run it)


def test_python_m_preheat_server_gives_click_errors_in_one_line(tmp_path):
    """`python -m preheat.server` runs the serve command on its own, not under the `preheat` group:
    a bad flag is the same one line (exit 2), not click's usage block."""
    r = subprocess.run([sys.executable, "-m", "preheat.server", "--max-batch-size", "two"], capture_output=True,
                       text=True, timeout=120, env={**os.environ, "PREHEAT_HOME": str(tmp_path / "home")})
    assert r.returncode == 2 and r.stdout == "", (r.returncode, r.stdout, r.stderr)
    assert r.stderr.strip().splitlines() == ["error: Invalid value for '--max-batch-size': 'two' is not a valid "
                                             "integer. (python -m preheat.server --help)"], r.stderr


def test_a_failing_call_on_a_warm_cache_exits_with_its_own_code(tmp_path):
    """The case that aborted: a text model whose executables are cached, and a flag it does not take.
    The background load of the cached executable is still running when the error ends the command."""
    home = tmp_path / "home"
    first = preheat("sample", "builtin:text-digits", "--n", 2, "--prompt", "a 7", "--out", tmp_path / "a.png",
                    home=home)
    assert first.returncode == 0, first.stderr
    for _ in range(2):  # the abort depended on timing: it showed in about one run of three
        r = preheat("sample", "builtin:text-digits", "--class", 3, "--out", tmp_path / "b.png", home=home)
        assert r.returncode == 2 and "FATAL" not in r.stderr, (r.returncode, r.stderr)
        assert r.stderr.strip().splitlines()[-1].startswith("error: --class does not apply")


def test_torch_explain_runs_a_custom_timesteps_call_at_their_count(tmp_path, monkeypatch):
    """`cache explain --backend torch` runs the call once, at its fewest steps: one, or the length of
    a list that counts them (custom timesteps; a forced steps=1 refused that call). The steps are not
    in a torch key, so the explained key is the plain call's."""
    from click.testing import CliRunner

    from preheat.cli.cache import explain_command
    from tests._support.sd_fixtures import save_tiny_sd

    monkeypatch.setenv("PREHEAT_HOME", str(tmp_path / "home"))
    folder = save_tiny_sd(tmp_path / "sd1", "sd1")
    base = [str(folder), "--backend", "torch", "--compile", "regional", "--prompt", "a cat"]

    def explained(*flags: str) -> str:
        result = CliRunner().invoke(explain_command, [*base, *flags])
        assert result.exit_code == 0, result.output
        (line,) = [line for line in result.stdout.splitlines() if line.startswith(("hit:", "miss:"))]
        return line

    custom = explained("--sampler", "tcd", "--timesteps", "999,499")
    assert custom.startswith("miss: key ") and custom == explained("--steps", "7")
