"""Model folders, and the fresh-process runner, shared by the backend tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests._support.reference import TINY_CLASS_CONDITIONAL

# The smallest UNet2DModel that still has every part (class embedding, resnets, skip connections):
# one level, no attention. Inductor / AOTInductor compile C++ per kernel, so fewer blocks = faster tests.
MICRO: dict[str, Any] = dict(TINY_CLASS_CONDITIONAL, block_out_channels=(8,), down_block_types=("DownBlock2D",),
                             up_block_types=("UpBlock2D",), add_attention=False)


REPO = Path(__file__).resolve().parents[2]


def run_child(script: str, model: Path, home: Path, inductor_dir: Path, *flags: str) -> dict:
    """``script`` in a fresh process (a new pod: its own cache root and Inductor folder); the JSON
    it prints on its ``RESULT `` line."""
    env = {**os.environ, "PREHEAT_HOME": str(home), "TORCHINDUCTOR_CACHE_DIR": str(inductor_dir),
           "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])}
    env.pop("PREHEAT_CACHE", None)
    proc = subprocess.run([sys.executable, "-c", script, str(model), *flags], env=env, capture_output=True,
                          text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def count_cpp_builds() -> list[int]:
    """In a child process: from now on, one entry per C++ build Inductor runs (a warm start from
    preheat's cache must run none)."""
    import torch._inductor.cpp_builder as cpp_builder

    builds: list[int] = []
    build = cpp_builder.CppBuilder.build

    def counted(self: Any) -> Any:
        builds.append(1)
        return build(self)

    cpp_builder.CppBuilder.build = counted
    return builds
