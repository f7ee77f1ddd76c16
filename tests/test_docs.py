"""The README and docs/*.md stay true (the rules are written in docs/development.md, "The docs check"):

- every fenced ``bash`` block whose first line is ``# runnable offline`` runs, as one
  ``bash -e -o pipefail`` script, in an empty folder with an empty ``PREHEAT_HOME`` and no network,
  ``preheat`` being this checkout's console script (``preheat.cli.run()``, as ``python -m
  preheat``), each command in a process of its own forked from one that imported the CLI once
  (tests/_support/forked_cli.py), and exits 0;
- every relative link or image names a file or folder that exists, and a ``#fragment`` names a
  heading of its Markdown page (GitHub's anchors)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

from tests._support import forked_cli

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = "# runnable offline"
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w+-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.S | re.M)
HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?(?P<target>[^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
INLINE_CODE = re.compile(r"(`+).+?\1", re.S)
_DEAD_PROXY = "http://127.0.0.1:9"  # the discard port: nothing listens, connections are refused


class Block(NamedTuple):
    page: Path
    line: int
    code: str

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def fenced(text: str) -> list[tuple[int, str, str]]:
    """(line of the opening fence, language, body) of every fenced block."""
    return [(text.count("\n", 0, m.start()) + 1, m["lang"], m["body"]) for m in FENCE.finditer(text)]


def runnable(pages: list[Path] = PAGES) -> list[Block]:
    out = []
    for page in pages:
        for line, lang, body in fenced(page.read_text()):
            if lang in ("bash", "sh", "shell") and body.lstrip("\n").startswith(MARKER + "\n"):
                out.append(Block(page, line, body))
    return out


def prose(text: str) -> str:
    """The text without fenced blocks and inline code, where nothing is a link."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: formatting and punctuation dropped, lower case, spaces -> hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for m in HEADING.finditer(FENCE.sub("", page.read_text())):
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(page: Path) -> list[str]:
    bad = []
    for m in LINK.finditer(prose(page.read_text())):
        target = m["target"]
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:: not checked here
            continue
        path_part, _, fragment = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        if not dest.exists():
            bad.append(f"{target}: no such file ({dest})")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            bad.append(f"{target}: {dest.name} has no heading #{fragment}")
    return bad


RUNNABLE = runnable()


def test_the_pages_have_runnable_blocks_and_the_front_door_commands():
    readme = (ROOT / "README.md").read_text()
    assert "make run" in readme and "make test" in readme
    assert any(b.page.name == "README.md" for b in RUNNABLE), "the README's offline blocks lost their marker"
    assert len(readme.splitlines()) <= 250, "the README is a front door: keep the reference in docs/"


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_name_files_that_exist(page):
    assert not broken_links(page), "\n".join(broken_links(page))


def offline_env(home: Path, bin_dir: Path) -> dict[str, str]:
    """A block's environment: its own PREHEAT_HOME, ``bin_dir`` first on PATH, no network."""
    pythonpath = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PREHEAT_HOME": str(home), "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
            "PYTHONPATH": pythonpath, "HF_HUB_OFFLINE": "1", "HTTP_PROXY": _DEAD_PROXY, "HTTPS_PROXY": _DEAD_PROXY,
            "http_proxy": _DEAD_PROXY, "https_proxy": _DEAD_PROXY, "NO_PROXY": "", "no_proxy": ""}


@pytest.fixture(scope="module")
def zygote(tmp_path_factory):
    """One process that imported the CLI, started with a block's environment (its home unused)."""
    base = tmp_path_factory.mktemp("zygote")
    z = forked_cli.start(offline_env(base / "no-home", base / "no-bin"))
    yield z
    forked_cli.stop(z)


@pytest.mark.parametrize("block", RUNNABLE, ids=[b.name for b in RUNNABLE])
def test_runnable_block_exits_0(block, tmp_path, zygote):
    bin_dir, work, home = tmp_path / "bin", tmp_path / "work", tmp_path / "home"
    for d in (bin_dir, work, home):
        d.mkdir()
    forked_cli.shim(bin_dir / "preheat", zygote)  # this checkout's preheat, whatever is installed
    env = offline_env(home, bin_dir)
    proc = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", block.code], cwd=work, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (f"{block.name} exited {proc.returncode}\n--- block\n{block.code}"
                                  f"--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}")


# The checker itself, on pages written here.

def test_the_checker_finds_marked_blocks_only(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# T\n\n```bash\n# runnable offline\ntrue\n```\n\n```bash\nfalse\n```\n\n"
                    "```python\n# runnable offline\n```\n")
    assert [(b.line, b.code) for b in runnable([page])] == [(3, "# runnable offline\ntrue\n")]


def test_the_checker_flags_missing_files_and_headings(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A page\n\n## `preheat warm`: compile first\n\n## Again\n\n## Again\n")
    page = tmp_path / "p.md"
    page.write_text("[ok](docs/a.md#preheat-warm-compile-first) [ok2](docs/a.md#again-1) ![img](docs/a.md) "
                    "[web](https://example.com/x) [self](#t)\n\n# T\n\n"
                    "[gone](docs/b.md) [bad](docs/a.md#nowhere) `[code](nope.md)`\n\n```\n[block](nope.md)\n```\n")
    assert broken_links(page) == [f"docs/b.md: no such file ({tmp_path / 'docs' / 'b.md'})",
                                  "docs/a.md#nowhere: a.md has no heading #nowhere"]


def test_a_forked_command_answers_as_a_fresh_process_does(zygote, tmp_path):
    """The blocks' ``preheat`` (forked from the zygote) against a fresh interpreter running the
    console script's ``preheat.cli.run()``: the same exit status, stdout and stderr, with the
    caller's environment (its PREHEAT_HOME, which ``cache ls`` names) and working folder."""
    forked = forked_cli.shim(tmp_path / "preheat", zygote)
    fresh = [sys.executable, "-c", "import sys; from preheat.cli import run; sys.argv[0] = 'preheat'; run()"]
    calls = (["sample", "--steps", "0", "--out", "x.png"],  # exit 2, one line on stderr
             ["sample", "m", "--out", "x.png"],  # ./m, an empty folder: "m has no model_index.json" (exit 1)
             ["cache", "ls"])
    for n, args in enumerate(calls):
        work = tmp_path / f"work{n}"
        (work / "m").mkdir(parents=True)
        env = offline_env(tmp_path / f"home{n}", tmp_path / "no-bin")
        got, want = (subprocess.run([*cmd, *args], cwd=work, env=env, capture_output=True, text=True, timeout=300)
                     for cmd in ([str(forked)], fresh))
        assert (got.returncode, got.stdout, got.stderr) == (want.returncode, want.stdout, want.stderr)
        assert not (work / "x.png").exists()
    assert got.returncode == 0 and str(tmp_path / "home2") in "".join(got.stdout.split())  # cache ls: the caller's
    # home (in a table's title, wrapped at 80 columns)


def test_a_command_setting_an_import_time_variable_is_not_forked(zygote, tmp_path):
    """jax reads its JAX_* flags when it is imported, which the zygote did once: a command whose
    environment sets one otherwise would run with the zygote's value, so the shim starts it fresh.
    The zygote's log names every command it forked."""
    forked = forked_cli.shim(tmp_path / "preheat", zygote)
    log = zygote.folder / "zygote.log"
    env = offline_env(tmp_path / "home", tmp_path / "no-bin")
    for marker, extra in (("plain-run", {}), ("x64-run", {"JAX_ENABLE_X64": "1"})):
        r = subprocess.run([str(forked), "cache", "ls", marker], env={**env, **extra}, cwd=tmp_path,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 2 and marker in r.stderr, r.stderr  # click: an unexpected extra argument, either way
    forked_log = log.read_text()
    assert "forked: cache ls plain-run" in forked_log
    assert "x64-run" not in forked_log
