"""The CLI's contract: no traceback for any bad input, anywhere.

Every command and subcommand of ``preheat`` (walked from the click tree, so a new one is covered
without a line here) is run with each option given a wrong-type value, an out-of-range value
and no value, and with a required argument missing. Each must exit non-zero before any model is
loaded, with one line on stderr that names the option. In-process (click's ``CliRunner``), with
``preheat.load`` replaced by a function that fails the test if anything reaches it.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Iterator

import click
import pytest
from click.testing import CliRunner

from preheat.cli import main

# Text options whose value has a format: a value each must refuse, before loading anything.
MALFORMED = {
    "--sizes": "33", "--samplers": "plms", "--guidance": "sometimes", "--lora-ranks": "7x", "--devices": "gpu0",
    "--batch-sizes": "one,two", "--resolutions": "big", "--paths": "warp", "--xla-flags": "no-equals-sign",
    "--sampler": "plms", "--class": "giraffe", "--lora": "missing.safetensors:x", "--host": "999.1.1.1.1",
    "--address": "nowhere", "--cache-url": "nope://x",
}
# Options whose out-of-range refusal needs a model (checked later, still in one line) or which
# take any value: not part of the "fails before loading" sweep.
NOT_BEFORE_LOADING = {"--class", "--lora", "--host", "--address", "--cache-url", "--webhook-allow",
                      "--lora-url-allow", "--revision", "--prompt", "--negative-prompt", "--variant",
                      "--out", "--save-images", "--report", "--json-out", "--png-out", "--keep", "--json",
                      "--lora-dir"}


def leaf_commands(cmd: click.Command = main, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], click.Command]]:
    if isinstance(cmd, click.Group):
        ctx = click.Context(cmd)
        for name in cmd.list_commands(ctx):  # the top group imports its commands lazily
            yield from leaf_commands(cmd.get_command(ctx, name), (*path, name))
    else:
        yield path, cmd


def value_options(cmd: click.Command) -> list[click.Option]:
    return [p for p in cmd.params if isinstance(p, click.Option) and not p.is_flag and p.opts[0] not in ("--help",)]


def cases() -> Iterator[tuple[tuple[str, ...], str, str, tuple[str, ...]]]:
    """(command path, option, what, argv) for every case."""
    for path, cmd in leaf_commands():
        required = [p for p in cmd.params if isinstance(p, click.Argument) and p.required]
        if required:
            yield path, required[0].human_readable_name, "missing", path
        lead = ("x",) * len(required)  # a value for each required argument, so the option is what fails
        for opt in cmd.params:
            if isinstance(opt, click.Option) and opt.required:
                yield path, opt.opts[0], "missing", (*path, *lead)
                lead = (*lead, opt.opts[0], "x")
        for opt in value_options(cmd):
            flag = opt.opts[0]
            yield path, flag, "no value", (*path, *lead, flag)
            if isinstance(opt.type, (click.types.IntParamType, click.types.FloatParamType)):
                yield path, flag, "wrong type", (*path, *lead, flag, "abc")
                yield path, flag, "out of range", (*path, *lead, flag, "-7")
            elif isinstance(opt.type, click.Choice):
                yield path, flag, "not a choice", (*path, *lead, flag, "bogus")
            elif flag in MALFORMED and flag not in NOT_BEFORE_LOADING:
                yield path, flag, "malformed", (*path, *lead, flag, MALFORMED[flag])


CASES = list(cases())


@pytest.fixture
def no_loading(monkeypatch, tmp_path):
    """Anything that reaches model loading (or a benchmark's child) fails the case."""
    import preheat
    import preheat.engine

    def refuse(*args, **kwargs):
        raise AssertionError("a bad argument reached model loading")

    monkeypatch.setattr(preheat, "load", refuse)
    monkeypatch.setattr(preheat.engine, "load_jax_pipeline", refuse)
    monkeypatch.setattr(subprocess, "Popen", refuse)
    monkeypatch.chdir(tmp_path)


@pytest.mark.parametrize("path,flag,what,argv", CASES, ids=[f"{' '.join(c[0])} {c[1]} {c[2]}" for c in CASES])
def test_bad_input_is_one_line_naming_the_option(no_loading, path, flag, what, argv):
    result = CliRunner().invoke(main, list(argv))
    assert not isinstance(result.exception, AssertionError), f"{argv}: {result.exception}"
    assert isinstance(result.exception, SystemExit) and result.exit_code != 0, (argv, result.output, result.exception)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), (argv, result.output)
    assert flag in lines[0], (argv, lines[0])


def test_every_command_is_covered():
    covered = {c[0] for c in CASES}
    leaves = {path for path, cmd in leaf_commands() if value_options(cmd) or any(
        isinstance(p, click.Argument) and p.required for p in cmd.params)}
    assert covered == leaves
    assert {("sample",), ("cache", "explain"), ("serve",), ("warm",), ("pull",), ("train-digits",),
            ("bench", "compare")} <= leaves


def test_sample_help_lists_every_sampler():
    from preheat.samplers import SAMPLERS

    out = CliRunner().invoke(main, ["sample", "--help"]).output
    assert all(name in out for name in SAMPLERS) and "flow_euler" in out and "flow_heun" in out


def test_a_missing_extra_names_the_pip_install(tmp_path):
    """`serve` and the Runpod handler without the serve extra: one line naming `pip install ".[serve]"`
    (subprocesses, whose imports of the extra's modules fail as in an environment without it)."""
    blocker = tmp_path / "block" / "sitecustomize.py"
    blocker.parent.mkdir()
    blocker.write_text("import sys\nclass B:\n    def find_spec(self, name, path=None, target=None):\n"
                       "        if name.split('.')[0] in ('uvicorn', 'fastapi', 'prometheus_client'):\n"
                       "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
                       "sys.meta_path.insert(0, B())\n")
    import os

    env = {**os.environ, "PYTHONPATH": f"{blocker.parent}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "PREHEAT_HOME": str(tmp_path / "home")}
    r = subprocess.run([sys.executable, "-m", "preheat", "serve", "--port", "0"], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("error: ") and 'serve needs the serve extra: pip install ".[serve]"' in line, line
    handler = subprocess.run([sys.executable, "-m", "preheat.integrations.runpod"], env=env, capture_output=True,
                             text=True, timeout=120)
    assert handler.returncode == 1 and handler.stderr.strip().splitlines() == [
        'error: the Runpod handler needs the serve extra: pip install ".[serve]" (No module named \'prometheus_client\')'
    ], handler.stderr


@pytest.mark.parametrize("path", [p for p, _ in leaf_commands()], ids=" ".join)
def test_every_command_has_help(path):
    result = CliRunner().invoke(main, [*path, "--help"])
    assert result.exit_code == 0 and "Usage:" in result.output, result.output
