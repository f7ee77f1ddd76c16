"""Peak host memory of converting a single-file checkpoint against loading its converted folder.

    python benchmarks/single_file_memory.py [--model sd-small] [--work DIR]

``random:MODEL`` (an SD 1.x folder) is written once under DIR, and its weights in the original LDM
layout as one ``.safetensors`` (``tests/_support/ldm_files.to_original``, the test suite's own
inverse). Each step then runs in a fresh process, so one step's allocations do not hide another's:

* ``convert``: ``preheat.models.single_file.materialize`` alone (the renamed tensors are held in
  host memory until they are written);
* ``load converted``: ``preheat.load(<converted folder>)``, the start after the first;
* ``load file``: ``preheat.load(file, config=folder)`` into an empty cache root (conversion, then load).

Peak = the kernel's high-water mark over the step (``preheat.models.load_report.PeakWindow``)
minus the resident set before it (the interpreter, its imports, JAX's backend). On a CPU-only
machine the loaded weights' device copies are host memory too.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MB = 1e6


def _child(step: str, file: Path, folder: Path, home: Path) -> dict[str, float]:
    import os

    os.environ["PREHEAT_HOME"] = str(home)
    import preheat
    from preheat.models.load_report import PeakWindow
    from preheat.models.single_file import materialize

    if step == "load converted":
        converted = materialize(file, folder, home)  # made by the convert step: found, not converted again
    if step != "convert":  # the imports and JAX's backend before the window: they are not the weights'
        import jax

        import preheat.engine  # noqa: F401
        import preheat.families  # noqa: F401

        jax.numpy.zeros(1).block_until_ready()
    window = PeakWindow()
    if step == "convert":
        materialize(file, folder, home)
    elif step == "load converted":
        preheat.load(converted, cache="off")
    else:
        preheat.load(file, config=folder, cache="off")
    before, peak, _, exact = window.close()
    return {"peak_mb": ((peak or 0) - (before or 0)) / MB, "exact": exact}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="sd-small", help="random:MODEL, an SD 1.x folder (sd1-tiny, sd-small)")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "preheat-single-file-memory")
    parser.add_argument("--child", nargs=4, metavar=("STEP", "FILE", "FOLDER", "HOME"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        step, file, folder, home = args.child
        print(json.dumps(_child(step, Path(file), Path(folder), Path(home))))
        return

    sys.path.insert(0, str(ROOT))
    from safetensors.numpy import save_file

    from preheat.bench.random_models import build_random
    from tests._support.ldm_files import to_original

    folder = build_random(args.model, args.work / args.model)
    file = args.work / f"{args.model}-ldm.safetensors"
    if not file.is_file():
        save_file(to_original(folder, "sd1"), str(file))
    print(f"random:{args.model}: single file {file.stat().st_size / MB:.1f} MB")
    homes = {"convert": args.work / "home-a", "load converted": args.work / "home-a", "load file": args.work / "home-b"}
    for home in set(homes.values()):
        subprocess.run(["rm", "-rf", str(home)], check=True)
    for step, home in homes.items():
        out = subprocess.run([sys.executable, __file__, "--child", step, str(file), str(folder), str(home)],
                             check=True, capture_output=True, text=True, cwd=ROOT,
                             env={**__import__("os").environ, "PYTHONPATH": str(ROOT / "src")})
        result = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{step:>15}: peak host memory +{result['peak_mb']:.1f} MB" + ("" if result["exact"] else " (upper bound)"))


if __name__ == "__main__":
    main()
