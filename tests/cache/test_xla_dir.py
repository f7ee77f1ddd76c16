"""JAX's persistent cache follows the root of the load that compiles (``preheat.cache.xla_layer``'s
``persistent_cache_at``): JAX has one cache directory per process, so a second root used to read
and write the first root's ``compile/xla``. Tiny programs; the pipeline-level check (two
``preheat.load`` roots) is in test_compile_cache.py."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
from preheat.cache import xla_layer
from preheat.cache.compile import JaxCompiler
from tests._support.threads import run_together


@dataclass(frozen=True)
class Sig:
    stage: str = "denoise"
    batch: int = 3


def program(k: float) -> Callable[[jax.Array], jax.Array]:
    """A new function object per call, so that JAX's in-memory caches never answer: each compile
    asks its persistent cache. ``k`` (a constant in the program) makes programs that differ."""
    return lambda x: jnp.sin(x) * k + jnp.cos(x * k)


ARGS = jnp.linspace(0.0, 1.0, 12, dtype=jnp.float32).reshape(3, 4)


def layer(root: Path, k: float) -> str:
    """The layer that served the program ``k`` to a fresh xla-mode compiler on ``root``."""
    compiled, timings = JaxCompiler(root=root, mode="xla", remote=None).get_or_compile({"m": k}, Sig(), program(k), ARGS)
    assert jnp.allclose(compiled(ARGS), program(k)(ARGS))
    return timings.cache_layer


def files(root: Path) -> set[Path]:
    return {p for p in (root / "compile" / "xla").rglob("*") if p.is_file()}


def test_each_root_reads_and_writes_its_own_xla_dir(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    assert layer(a, 2.0) == "none"
    assert layer(b, 2.0) == "none", "the second root's compile was served from the first root's directory"
    assert files(b), "the second root's program was written to the first root's directory"
    before = files(a)
    assert layer(a, 3.0) == "none" and files(a) > before and layer(b, 3.0) == "none"  # back to a, then b again
    assert layer(a, 2.0) == "xla" and layer(b, 3.0) == "xla"  # each hits what it wrote


def test_one_root_never_repoints(tmp_path, monkeypatch):
    """A one-root process pays nothing new: no ``reset_cache`` per compile."""
    root = tmp_path / "root"
    layer(root, 4.0)  # points the process at root (if it was not)
    calls = []
    monkeypatch.setattr(xla_layer, "_point_at", lambda d: calls.append(d))
    assert layer(root, 5.0) == "none" and layer(root, 5.0) == "xla"
    assert calls == []


def test_another_root_waits_for_the_compiles_in_flight_and_newcomers_wait_for_it(tmp_path):
    """Compiles for the root pointed at run together; one for another root waits until none is in
    flight, then re-points; a compile for the first root arriving meanwhile waits behind it
    (no starvation), and re-points back after it."""
    a, b = tmp_path / "a", tmp_path / "b"
    order: list[str] = []
    release_a1, release_b = threading.Event(), threading.Event()

    def hold(root: Path, name: str, release: threading.Event | None) -> None:
        with xla_layer.persistent_cache_at(root):
            order.append(f"{name} in {Path(jax.config.jax_compilation_cache_dir).parent.parent.name}")
            if release is not None:
                assert release.wait(10)

    def waiting(n: int) -> bool:
        for _ in range(500):
            with xla_layer._dir_turns:
                if sum(xla_layer._dir_waiting.values()) == n:
                    return True
            threading.Event().wait(0.01)
        return False

    a1 = threading.Thread(target=hold, args=(a, "a1", release_a1), daemon=True)
    a1.start()
    for _ in range(500):
        if order:
            break
        threading.Event().wait(0.01)
    assert order == ["a1 in a"]
    hold(a, "a2", None)  # joins a1's turn at once: same root, nobody waiting
    b1 = threading.Thread(target=hold, args=(b, "b1", release_b), daemon=True)
    b1.start()
    assert waiting(1)
    a3 = threading.Thread(target=hold, args=(a, "a3", None), daemon=True)
    a3.start()
    assert waiting(2), "a compile for the current root must wait while another root waits"
    assert order == ["a1 in a", "a2 in a"]
    release_a1.set()
    a1.join(10)
    assert waiting(1) and order[-1] == "b1 in b"
    release_b.set()
    b1.join(10)
    a3.join(10)
    assert order == ["a1 in a", "a2 in a", "b1 in b", "a3 in a"]
    assert xla_layer._dir_users == 0 and not xla_layer._dir_waiting


def test_concurrent_compiles_on_two_roots_land_in_their_own(tmp_path):
    """Two threads, each compiling its own programs through its own root at once: afterwards each
    root serves its own programs and never the other's."""
    roots = {"a": tmp_path / "a", "b": tmp_path / "b"}
    ks = {"a": [10.0, 11.0, 12.0], "b": [20.0, 21.0, 22.0]}

    def work(name: str) -> None:
        for k in ks[name]:
            assert layer(roots[name], k) == "none"

    errors = run_together(work, roots, timeout_s=60)
    assert not errors, errors
    for name, other in (("a", "b"), ("b", "a")):
        assert all(layer(roots[name], k) == "xla" for k in ks[name]), f"{name}'s programs are not in its root"
        assert all(layer(roots[name], k) == "none" for k in ks[other][:1]), f"{other}'s program is in {name}'s root"
