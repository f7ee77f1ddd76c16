"""`preheat doctor` on a real TPU VM, as a user meets it: one JSON object on stdout.

    PYTHONPATH=src python scripts/tpu_doctor_check.py      # from a checkout, on the TPU machine (~1 min)

Three runs of ``preheat doctor --json`` in fresh processes:

    plain     the chip as it is: the Accelerator and JAX rows should name it (kind, HBM, libtpu)
    held      while another Python process holds the chip (it imported jax and listed the devices):
              the JAX row should name that process's pid, and libtpu's own words are recorded
    gpu_vars  with XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 set: the TPU memory row should warn

Each run's rows (id, status, finding, fix), exit code and seconds are printed, so the lead can
compare them with tests/doctor/test_doctor_tpu.py's fake TPU VM. Nothing is installed or written.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

HOLD = "import jax, time; jax.devices(); print('ready', flush=True); time.sleep(300)"


def doctor(extra_env: dict[str, str] | None = None) -> dict:
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "preheat", "doctor", "--json"], capture_output=True, text=True,
                       timeout=240, env={**os.environ, **(extra_env or {})})
    try:
        report = json.loads(r.stdout)
    except ValueError:
        return {"rc": r.returncode, "stdout": r.stdout[-2000:], "stderr": r.stderr[-2000:]}
    rows = [{k: c[k] for k in ("id", "status", "finding", "fix")} for c in report["checks"]]
    jax = next((c for c in report["checks"] if c["id"] == "jax"), {})
    probe = (jax.get("details") or {}).get("probe") or {}
    return {"rc": r.returncode, "seconds": round(time.monotonic() - t0, 1), "rows": rows,
            "probe_error": probe.get("error"), "backend_errors": probe.get("backend_errors"),
            "device": probe.get("device"), "versions": report.get("versions")}


def main() -> None:
    out: dict = {"plain": doctor()}
    holder = subprocess.Popen([sys.executable, "-c", HOLD], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        ready = holder.stdout.readline().strip() == "ready"  # type: ignore[union-attr]
        out["held"] = {"holder_pid": holder.pid, "holder_ready": ready, **doctor()}
    finally:
        holder.kill()  # only the process this script started
        holder.wait(timeout=30)
    out["gpu_vars"] = doctor({"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"})
    print(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
