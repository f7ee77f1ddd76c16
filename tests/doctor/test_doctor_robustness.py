"""Doctor never hangs and never crashes; the CLI's JSON and table; the real entry point."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from preheat.doctor import report
from preheat.doctor.checks.cuda_libs import LD_LIBRARY_PATH
from tests._support.doctor_fixtures import JAX_CPU, check

CHECK_IDS = ["accelerator", "jax", "torch", "cuda_libs", "ld_library_path", "gpu_memory", "storage_cache", "storage_hf", "cache_health"]


def _gone_or_zombie(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def test_hanging_nvidia_smi_is_reported_within_the_timeout(machine, monkeypatch):
    data = machine.gpu("a100_535", hang=True)
    # record the sleeping grandchild's pid so we can check it was killed with its group
    smi = machine.bin / "nvidia-smi"
    smi.write_text(smi.read_text().replace("  /bin/sleep 60   #", f'  /bin/sleep 60 & echo $! >> "{data}/pids"; wait   #'))
    monkeypatch.setenv("PREHEAT_DOCTOR_TIMEOUT", "1")
    t0 = time.monotonic()
    code, rep = machine.run()
    elapsed = time.monotonic() - t0
    # Each fake nvidia-smi sleeps 60 s; a report well before that means the 1 s timeouts fired
    # (a bound that fails only on a hang, not on a slow machine).
    assert elapsed < 30, elapsed
    acc = check(rep, "accelerator")
    assert acc["status"] == "fail"
    assert acc["finding"] == "nvidia-smi did not answer within 1 s: the driver or GPU is hung"
    assert acc["fix"].startswith("restart the pod")
    assert [c["id"] for c in rep["checks"]] == CHECK_IDS
    assert check(rep, "gpu_memory")["finding"].endswith("could not list GPU processes (did not answer within 1 s)")
    assert code == 1
    pids = [int(p) for p in (data / "pids").read_text().split()]
    assert len(pids) == 3
    deadline = time.monotonic() + 3
    while not all(_gone_or_zombie(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(_gone_or_zombie(p) for p in pids), "a sleeping nvidia-smi child survived the timeout"


def test_hanging_jax_probe_times_out(machine, monkeypatch):
    machine.gpu("a100_535")
    machine.jax(JAX_CPU, sleep=60)
    monkeypatch.setenv("PREHEAT_DOCTOR_TIMEOUT", "1")
    t0 = time.monotonic()
    code, rep = machine.run()
    assert time.monotonic() - t0 < 30  # the probe sleeps 60 s: only the 1 s timeout ends it sooner
    jax = check(rep, "jax")
    assert jax["status"] == "fail"
    assert "`import jax` + a tiny computation did not finish within 1 s (a CUDA plugin hanging at initialisation?)" in jax["finding"]
    assert 'pip install -U "jax[cuda12]"' in jax["fix"] and "PREHEAT_DOCTOR_TIMEOUT=60" in jax["fix"]
    assert code == 1


def test_crashing_jax_probe_reports_the_signal_and_stderr(machine):
    machine.gpu("h100_580")
    machine.jax(None, rc=-11, stderr="Fatal Python error: Segmentation fault\n\nCurrent thread 0x00007f (most recent call first):")
    code, rep = machine.run()
    jax = check(rep, "jax")
    assert jax["status"] == "fail"
    assert "the JAX probe process died (killed by SIGSEGV): Fatal Python error: Segmentation fault" in jax["finding"]
    assert jax["fix"] == 'pip install -U "jax[cuda13]"'
    assert [c["id"] for c in rep["checks"]] == CHECK_IDS


def test_a_check_that_raises_is_a_fail_and_the_others_still_run(machine, monkeypatch):
    def boom(ctx):
        raise RuntimeError("boom in the LD check")

    monkeypatch.setattr(LD_LIBRARY_PATH, "run", boom)
    code, rep = machine.run()
    ld = check(rep, "ld_library_path")
    assert ld["status"] == "fail"
    assert ld["finding"] == "the check itself raised RuntimeError: boom in the LD check"
    assert ld["fix"].startswith("this is a bug in preheat doctor")
    assert [c["id"] for c in rep["checks"]] == CHECK_IDS
    others = [c for c in rep["checks"] if c["id"] != "ld_library_path"]
    assert all("the check itself raised" not in c["finding"] for c in others)
    assert check(rep, "jax")["status"] == "ok" and check(rep, "accelerator")["status"] == "ok"
    assert rep["summary"]["fail"] == 1 and code == 1


def test_a_fact_that_cannot_be_gathered_fails_only_its_readers(machine, monkeypatch):
    def broken(timeout):
        raise OSError("nvidia-smi exploded")

    monkeypatch.setattr(report, "_query_nvidia_smi", broken)
    code, rep = machine.run()
    acc = check(rep, "accelerator")
    assert acc["status"] == "fail"
    assert acc["finding"] == "gathering smi failed: OSError: nvidia-smi exploded"
    assert acc["fix"].startswith("this is a bug in preheat doctor")
    assert check(rep, "jax")["status"] == "ok"
    assert check(rep, "storage_cache")["status"] == "ok"
    assert rep["versions"]["nvidia_driver"] is None
    assert code == 1


def test_json_output_has_checks_summary_versions(machine):
    machine.gpu("a100_535")
    code, rep = machine.run()
    assert set(rep) >= {"ok", "exit_code", "require_gpu", "gpu_backend", "summary", "checks", "versions", "elapsed_s"}
    assert [c["id"] for c in rep["checks"]] == CHECK_IDS
    for c in rep["checks"]:
        assert set(c) == {"id", "title", "status", "finding", "fix", "details"}
        assert c["status"] in ("ok", "warn", "fail")
        assert c["finding"] and "\n" not in c["finding"]
        if c["status"] != "ok":
            assert c["fix"], c
    assert rep["summary"] == {s: sum(c["status"] == s for c in rep["checks"]) for s in ("ok", "warn", "fail")}
    v = rep["versions"]
    assert v["jax"] and v["jaxlib"] and v["python"] and v["preheat"] == "0.1.0"
    assert v["nvidia_driver"] == "535.129.03" and v["cuda_driver_supports"] == "12.2"
    assert v["jax_backend"] == "cpu"
    assert rep["exit_code"] == code == 1 and rep["ok"] is False


def test_human_output_is_a_table_with_copyable_fixes(machine):
    machine.gpu("a100_535")
    code, out = machine.human()
    assert code == 1
    assert "preheat doctor" in out and "┃ Check" in out
    for title in ("Accelerator", "JAX backend", "PyTorch", "CUDA libraries", "LD_LIBRARY_PATH", "GPU memory", "preheat cache", "HF cache", "Cache health"):
        assert title in out
    assert "FAIL" in out and "WARN" in out
    fixes = out.split("How to fix:", 1)[1].splitlines()
    assert '  [fail] JAX backend: pip install -U "jax[cuda12]"' in fixes  # one unbroken line
    assert "exit 1" in out


def test_real_entry_point_without_gpu(machine):
    """`preheat doctor` as a user runs it (a fresh process, real JAX and torch probes)."""
    machine.real_jax()
    machine.real_torch()
    code = "import sys; from preheat.cli import main; sys.argv = ['preheat'] + sys.argv[1:]; main()"
    proc = subprocess.run([sys.executable, "-c", code, "doctor", "--json", "--require-gpu"], capture_output=True, text=True, env=dict(os.environ), timeout=120)
    assert proc.returncode == 1, proc.stderr
    rep = json.loads(proc.stdout)  # exactly one JSON object on stdout
    assert rep["gpu_backend"] is False and rep["require_gpu"] is True
    assert check(rep, "jax")["finding"].endswith("but --require-gpu was given")
    assert "Traceback" not in proc.stderr
