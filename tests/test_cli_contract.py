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


def test_sample_help_lists_a_declared_input_with_the_families_declaring_it():
    """The model inputs section is read from the declarations: SD's and SDXL's guidance_rescale is
    listed under its flag with those families (the SDXL refiner's too; no hand-written option, no other family)."""
    out = CliRunner().invoke(main, ["sample", "--help"], terminal_width=400, max_content_width=400).output
    (row,) = [line.split() for line in out.splitlines() if line.split()[:1] == ["--guidance-rescale"]]
    assert " ".join(row).endswith("[stable-diffusion, stable-diffusion-xl, stable-diffusion-xl-refiner]"), row


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


# Each benchmark's own default for a common input, where it differs from the declared one (what it
# measures by default); every other common input a bench takes has the declared default.
BENCH_DEFAULTS = {("sampler", "--n"): (), ("sampler", "--steps"): 10, ("lora", "--n"): 8, ("lora", "--steps"): 4,
                  ("coldstart", "--n"): 8}


def bench_common_options() -> Iterator[tuple[str, click.Option, object]]:
    """(bench command, its option, the spec) for every option of a `preheat bench` command whose flag
    is a common input's declared flag."""
    from preheat.families.inputs import COMMON_SPECS

    specs = {s.cli_flag: s for s in COMMON_SPECS if "cli" in s.surfaces}
    for path, cmd in leaf_commands():
        if path[0] != "bench":
            continue
        for option in (p for p in cmd.params if isinstance(p, click.Option)):
            if option.opts[0] in specs:
                yield path[1], option, specs[option.opts[0]]


def test_bench_options_are_the_declared_common_inputs():
    """A bench's --n, --steps, --sampler, --seed, --guidance are the declared inputs: the spec's flag,
    type and bounds, and its default unless the bench declares its own (``BENCH_DEFAULTS``)."""
    from preheat.families.inputs import Choice, Float, Int

    seen = set()
    for bench, option, spec in bench_common_options():
        seen.add((bench, option.opts[0]))
        assert option.name == spec.name, (bench, option.opts)
        kind = spec.type
        if isinstance(kind, Int):
            assert isinstance(option.type, click.IntRange), (bench, option.opts)
            assert (option.type.min, option.type.max) == (kind.low, kind.high), (bench, option.opts)
        elif isinstance(kind, Float):
            assert isinstance(option.type, click.FloatRange), (bench, option.opts)
            assert (option.type.min, option.type.max, option.type.min_open) == (kind.low, kind.high, kind.low_open)
        elif isinstance(kind, Choice):
            assert option.type.name == "sampler", (bench, option.opts)
        assert option.default == BENCH_DEFAULTS.get((bench, option.opts[0]), spec.default), (bench, option.opts)
    assert set(BENCH_DEFAULTS) <= seen  # a stale entry fails here
    assert {("compare", f) for f in ("--steps", "--sampler", "--seed", "--guidance")} <= seen
    assert {("sampler", "--sampler"), ("serve", "--steps"), ("coldstart", "--steps")} <= seen


def test_bench_sizes_are_the_declared_size_inputs():
    """`bench sampler` and `bench lora` take the image size as its declaration's two flags (the
    ``--width`` / ``--height`` of ``preheat sample``): positive ints, absent by default (the model's own)."""
    from preheat.cli.family_options import cli_size_specs

    commands = dict(leaf_commands())
    for bench in ("sampler", "lora"):
        options = {p.opts[0]: p for p in commands[("bench", bench)].params if isinstance(p, click.Option)}
        for spec in cli_size_specs():
            option = options[spec.cli_flag]
            assert isinstance(option.type, click.IntRange) and (option.type.min, option.type.max) == (1, None)
            assert option.default is None and spec.description in (option.help or ""), (bench, option.help)


@pytest.mark.slow  # a real benchmark run: 45 s on this project's loaded 2-core machine
def test_bench_sampler_counts_images_by_n_and_still_takes_the_old_batch():
    """The image count is --n, as everywhere; --batch, the old spelling (scripts used it), still
    works, with one deprecation line, and adds its batch sizes to --n's (the built-in model, one
    step: a real run)."""
    import json

    result = CliRunner().invoke(main, ["bench", "sampler", "--n", "1", "--batch", "2", "--steps", "1", "--repeats", "1",
                                       "--json"])
    assert result.exit_code == 0, result.output
    assert result.stderr.strip().splitlines() == ["warning: --batch is deprecated; use --n"], result.stderr
    assert [row["batch"] for row in json.loads(result.stdout)["rows"]] == [1, 2], result.stdout


def test_the_old_batch_flag_is_still_a_bench_sampler_count(no_loading):
    """--batch is parsed as --n's deprecated alias (a positive count), hidden from --help."""
    result = CliRunner().invoke(main, ["bench", "sampler", "--batch", "0"])
    assert result.exit_code == 2 and "Invalid value for '--batch': 0 is not in the range x>=1." in result.stderr
    assert "--batch" not in CliRunner().invoke(main, ["bench", "sampler", "--help"]).output


def test_bench_compare_counts_images_by_n_and_still_takes_the_old_batch(no_loading, monkeypatch):
    """`bench compare --batch` was the images of each cold-start call, `bench coldstart --n`'s count:
    it is --n now; --batch still works alone, with one deprecation line, and is hidden."""
    import preheat.cli.bench as bench

    seen = []
    monkeypatch.setattr(bench, "_compare", lambda model, sampler, steps, n, *args, **kwargs: seen.append(n))
    for argv, n, err in [([], None, []), (["--n", "2"], 2, []),
                         (["--batch", "3"], 3, ["warning: --batch is deprecated; use --n"])]:
        result = CliRunner().invoke(main, ["bench", "compare", *argv])
        assert result.exit_code == 0 and result.stderr.strip().splitlines() == err, result.output
        assert seen.pop() == n
    both = CliRunner().invoke(main, ["bench", "compare", "--n", "2", "--batch", "3"])
    assert both.exit_code == 2 and both.stderr.strip().splitlines()[-1].startswith(
        "error: --batch is the old spelling of --n: give --n only"), both.stderr
    zero = CliRunner().invoke(main, ["bench", "compare", "--batch", "0"])
    assert zero.exit_code == 2 and "Invalid value for '--batch': 0 is not in the range x>=1." in zero.stderr
    assert "--batch " not in CliRunner().invoke(main, ["bench", "compare", "--help"]).output and not seen


@pytest.mark.parametrize("bench,flag", sorted({(b, o.opts[0]) for b, o, s in bench_common_options()
                                               if s.name in ("n", "steps")}))
def test_a_bench_count_of_zero_is_a_range_error_naming_the_flag(no_loading, bench, flag):
    result = CliRunner().invoke(main, ["bench", bench, flag, "0"])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: Invalid value for '{flag}': 0 is not in the range x>=1."), \
        lines
