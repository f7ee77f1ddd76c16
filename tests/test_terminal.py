"""Progress on the terminal: `preheat sample` names its phases with a spinner and the elapsed time
and draws a bar over the steps (the call's progress callback),
`preheat warm` counts signatures done of total; a pipe or `--quiet` gets none of it.

Run as a person runs them: a subprocess whose stderr is a pseudo-terminal (tests/_support/terminal).
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from tests._support.server_fixtures import write_tiny_model
from tests._support.terminal import run_on_terminal, run_piped

SPINNER = re.compile("[⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏]")
ELAPSED = re.compile(r"[0-9]+:[0-9]{2}:[0-9]{2}")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("terminal-model"))


def preheat(*args: object, home: Path) -> list[str]:
    return [sys.executable, "-m", "preheat", *map(str, args)]


def env_of(home: Path) -> dict[str, str]:
    return {**os.environ, "PREHEAT_HOME": str(home), "JAX_PLATFORMS": "cpu", "COLUMNS": "100"}


def test_sample_names_its_phases_on_a_terminal_and_not_in_a_pipe(model: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"  # an empty cache: the first call traces and compiles
    args = preheat("sample", model, "--n", 2, "--steps", 2, "--out", tmp_path / "a.png", "--timing", home=home)
    shown = run_on_terminal(args, env=env_of(home))
    assert shown.returncode == 0, shown.plain_stderr[-2000:]
    text = shown.plain_stderr
    for phase in ("loading model", "first call: tracing", "first call: compiling (XLA)", "second call (warm)"):
        assert re.search(rf"{SPINNER.pattern} {re.escape(phase)} {ELAPSED.pattern}", text), phase
    assert re.search(r"first call.* 2/2 steps", text) and re.search(r"second call \(warm\).* 2/2 steps", text)
    assert "\x1b[" in shown.stderr and "wrote" in text
    assert shown.stdout == ""  # nothing of it on stdout

    piped = run_piped(args, env=env_of(home))
    assert piped.returncode == 0, piped.stderr
    assert "\x1b[" not in piped.stderr and not SPINNER.search(piped.stderr)
    assert "loading model" not in piped.stderr and "first call:" not in piped.stderr
    assert "wrote" in piped.stderr  # the summary line stays

    quiet = run_on_terminal([*args, "--quiet"], env=env_of(home))
    assert quiet.returncode == 0 and not SPINNER.search(quiet.stderr) and "loading model" not in quiet.stderr


def test_warm_counts_signatures_done_of_total(model: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"
    args = preheat("warm", model, "--max-batch-size", 2, "--guidance", "off", home=home)
    shown = run_on_terminal(args, env=env_of(home))
    assert shown.returncode == 0, shown.plain_stderr[-2000:]
    counts = re.findall(r"warm: signatures\s.*?(\d+)/(\d+)", shown.plain_stderr)
    totals = {int(total) for _, total in counts}
    assert len(totals) == 1 and (total := totals.pop()) >= 2, counts  # buckets 1 and 2
    assert (str(total), str(total)) in counts and ("0", str(total)) in counts
    assert ELAPSED.search(shown.plain_stderr)

    piped = run_piped(args, env=env_of(home))
    assert piped.returncode == 0, piped.stderr
    assert "warm: signatures" not in piped.stderr and "\x1b[" not in piped.stderr
    assert "(cache:" in piped.stderr  # the per-signature log lines stay
