"""Accelerator, JAX backend and PyTorch checks on simulated machines."""

from __future__ import annotations

import sys

import pytest

from preheat.doctor import dists
from tests._support.doctor_fixtures import JAX_CPU, check, jax_gpu
from tests._support.doctor_sites import fake_site


def test_no_gpu_real_jax_and_torch_ok(machine):
    machine.real_jax()
    machine.real_torch()
    code, rep = machine.run()
    acc = check(rep, "accelerator")
    assert acc["status"] == "ok"
    assert acc["finding"].startswith("no NVIDIA GPU: no ")
    assert "no nvidia-smi on PATH" in acc["finding"]
    jax = check(rep, "jax")
    assert jax["status"] == "ok", jax
    assert "backend cpu" in jax["finding"] and "no GPU on this machine" in jax["finding"]
    assert jax["details"]["probe"]["result_ok"] is True  # the real computation ran
    torch = check(rep, "torch")
    import torch as real_torch

    if real_torch.version.cuda is None:  # the CPU build (Python 3.11's test path)
        assert torch["status"] == "ok", torch
        assert "(CPU build); no GPU on this machine" in torch["finding"]
        assert code == 0 and rep["exit_code"] == 0
    else:  # Python 3.12's torch 2.13.0 is the index's CUDA build: doctor says it has no GPU to use
        assert torch["status"] == "warn", torch
        assert (f"is a CUDA {real_torch.version.cuda} build with no usable GPU (torch.cuda.is_available() is False; "
                "no GPU on this machine)") in torch["finding"]
    assert rep["gpu_backend"] is False


def test_no_gpu_require_gpu_exits_1(machine):
    code, rep = machine.run("--require-gpu")
    assert code == 1
    jax = check(rep, "jax")
    assert jax["status"] == "fail"
    assert "backend cpu and no GPU on this machine, but --require-gpu was given" in jax["finding"]
    assert jax["fix"].startswith("run on a GPU pod")
    assert check(rep, "accelerator")["status"] == "ok"


def test_require_gpu_with_gpu_backend_exits_0(machine):
    machine.gpu("a100_535")
    machine.jax(jax_gpu("NVIDIA A100-SXM4-80GB"))
    code, rep = machine.run("--require-gpu")
    assert code == 0 and rep["gpu_backend"] is True


def test_driver_535_recommends_cuda12_and_gpu_backend_ok(machine):
    machine.gpu("a100_535")
    machine.jax(jax_gpu("NVIDIA A100-SXM4-80GB"))
    code, rep = machine.run()
    acc = check(rep, "accelerator")
    assert acc["status"] == "ok"
    assert acc["finding"] == (
        "1x NVIDIA A100-SXM4-80GB (81920 MiB, SM 8.0); driver 535.129.03 (supports CUDA <= 12.2) -> use jax[cuda12] "
        "(CUDA 12 builds support SM >= 5.2; jax[cuda13] needs driver >= 580)"
    )
    assert acc["details"]["recommended_jax"] == "jax[cuda12]"
    jax = check(rep, "jax")
    assert jax["status"] == "ok"
    assert "backend gpu, 1x NVIDIA A100-SXM4-80GB" in jax["finding"]
    assert rep["versions"]["nvidia_driver"] == "535.129.03"
    assert rep["versions"]["cuda_driver_supports"] == "12.2"
    assert code == 0


def test_driver_535_cpu_jax_fails_with_cuda12_fix(machine):
    machine.gpu("a100_535")
    code, rep = machine.run()
    jax = check(rep, "jax")
    assert jax["status"] == "fail"
    assert "JAX runs on cpu although an NVIDIA GPU is present" in jax["finding"]
    assert jax["fix"] == 'pip install -U "jax[cuda12]"'
    assert code == 1


def test_driver_580_with_cpu_only_jaxlib_fails_with_cuda13_fix(machine):
    """The real JAX of this machine is CPU-only: exactly the 'forgot jax[cuda13]' pod."""
    machine.gpu("h100_580")
    machine.real_jax()
    code, rep = machine.run()
    acc = check(rep, "accelerator")
    assert acc["status"] == "ok"
    assert "driver 580.65.06 (supports CUDA <= 13.0) -> use jax[cuda13] (CUDA 13 builds support SM >= 7.5" in acc["finding"]
    jax = check(rep, "jax")
    assert jax["status"] == "fail"
    assert "JAX runs on cpu although an NVIDIA GPU is present: jaxlib is CPU-only (no jax-cuda plugin installed)" in jax["finding"]
    assert jax["fix"] == 'pip install -U "jax[cuda13]"'
    assert code == 1 and rep["gpu_backend"] is False


def test_driver_470_too_old_fails(machine):
    machine.gpu("t4_470")
    code, rep = machine.run()
    acc = check(rep, "accelerator")
    assert acc["status"] == "fail"
    assert "1x Tesla T4 (15109 MiB, SM unknown: this nvidia-smi has no compute_cap field); driver 470.199.02 (supports CUDA <= 11.4)" in acc["finding"]
    assert "driver 470 is too old for any JAX GPU build (jax[cuda12] needs >= 525, jax[cuda13] needs >= 580)" in acc["finding"]
    assert acc["fix"].startswith("upgrade the NVIDIA driver to >= 580 (>= 525 for jax[cuda12])")
    # JAX and torch get the same (driver) fix, not a pip command that cannot work
    assert check(rep, "jax")["fix"] == acc["fix"]
    assert check(rep, "torch")["fix"] == acc["fix"]
    assert code == 1


def test_v100_on_driver_580_needs_cuda12(machine):
    machine.gpu("v100_580")
    code, rep = machine.run()
    acc = check(rep, "accelerator")
    assert acc["status"] == "warn"
    assert "CUDA 13 builds need SM >= 7.5; this GPU (SM 7.0) needs jax[cuda12]" in acc["finding"]
    assert acc["fix"] == 'pip install -U "jax[cuda12]"'
    assert check(rep, "jax")["fix"] == 'pip install -U "jax[cuda12]"'


def test_nvidia_smi_without_driver_and_with_device_nodes_fails(machine):
    machine.gpu("no_driver")
    code, rep = machine.run()
    acc = check(rep, "accelerator")
    assert acc["status"] == "fail"
    assert acc["finding"] == "nvidia-smi fails: NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure that the latest NVIDIA driver is installed and running."
    assert code == 1


def test_nvidia_smi_without_driver_and_without_device_nodes_warns(machine):
    machine.gpu("no_driver", dev_nodes=False)
    code, rep = machine.run()
    acc = check(rep, "accelerator")
    assert acc["status"] == "warn"
    assert "no GPU is visible in this container" in acc["finding"]
    assert check(rep, "jax")["status"] == "ok"  # no GPU: CPU JAX is right
    assert code == 0


def test_device_nodes_without_nvidia_smi_warns(machine):
    machine.dev_nodes(2)
    code, rep = machine.run()
    acc = check(rep, "accelerator")
    assert acc["status"] == "warn"
    assert acc["finding"] == "2 GPU device node(s) (nvidia0, nvidia1) but nvidia-smi is not on PATH: cannot read the driver version"
    assert "NVIDIA_DRIVER_CAPABILITIES=compute,utility" in acc["fix"]
    # a GPU is present, JAX is on CPU and the driver is unknown: both builds are offered
    jax = check(rep, "jax")
    assert jax["status"] == "fail"
    assert jax["fix"] == 'pip install -U "jax[cuda12]" (driver >= 525) or pip install -U "jax[cuda13]" (driver >= 580)'


def test_cuda_plugin_failing_to_initialise_reports_jax_error(machine, monkeypatch, tmp_path):
    """jax-cuda13-plugin on a 535 driver: modern JAX raises; report its text and swap the plugin."""
    site = fake_site(tmp_path / "site", {"jax-cuda13-plugin": ("0.10.2", [], []), "jax-cuda13-pjrt": ("0.10.2", [], [])})
    monkeypatch.setattr(dists, "_dist_search_path", lambda: [str(site)] + sys.path)
    machine.gpu("a100_535")
    err = (
        "RuntimeError: Unable to initialize backend 'cuda': INTERNAL: CUDA error: Failed call to cuInit: "
        "CUDA_ERROR_INSUFFICIENT_DRIVER: CUDA driver version is insufficient for CUDA runtime version "
        "(you may need to uninstall the failing plugin package, or set JAX_PLATFORMS=cpu to skip this backend.)"
    )
    machine.jax({"ok": False, "error": err, "backend_errors": {}, "warnings": []})
    code, rep = machine.run()
    jax = check(rep, "jax")
    assert jax["status"] == "fail"
    assert "jax-cuda13-pjrt 0.10.2, jax-cuda13-plugin 0.10.2" in jax["finding"]
    assert "JAX fails to start: RuntimeError: Unable to initialize backend 'cuda': INTERNAL: CUDA error: Failed call to cuInit: CUDA_ERROR_INSUFFICIENT_DRIVER" in jax["finding"]
    assert jax["fix"] == 'pip uninstall -y jax-cuda13-pjrt jax-cuda13-plugin && pip install -U "jax[cuda12]"'
    assert code == 1


def test_cuda_plugin_fallback_warning_is_reported(machine, monkeypatch, tmp_path):
    """Older JAX falls back to CPU and logs the plugin's error: that line is the finding."""
    site = fake_site(tmp_path / "site", {"jax-cuda12-plugin": ("0.10.2", [], []), "jax-cuda12-pjrt": ("0.10.2", [], [])})
    monkeypatch.setattr(dists, "_dist_search_path", lambda: [str(site)] + sys.path)
    machine.gpu("a100_535")
    cudnn = "Found cuDNN version 8907, but JAX was built against version 9800, which is newer. The copy of cuDNN that is installed must be at least as new as the version against which JAX was built."
    machine.jax({**JAX_CPU, "backend_errors": {"cuda": cudnn}, "warnings": [f"CUDA backend failed to initialize: {cudnn} (Set TF_CPP_MIN_LOG_LEVEL=0 and rerun for more info.)"]})
    code, rep = machine.run()
    jax = check(rep, "jax")
    assert jax["status"] == "fail"
    assert f"the CUDA plugin failed to initialise: {cudnn}" in jax["finding"]
    assert jax["fix"] == 'pip install -U "jax[cuda12]"'


def test_jax_platforms_cpu_on_gpu_machine(machine, monkeypatch):
    machine.gpu("h100_580")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    code, rep = machine.run()
    jax = check(rep, "jax")
    assert jax["status"] == "fail"
    assert "JAX_PLATFORMS=cpu keeps JAX off the GPU" in jax["finding"]
    assert jax["fix"] == "unset JAX_PLATFORMS (it is 'cpu', which keeps JAX off the GPU)"


def test_wrong_numeric_result_fails(machine):
    machine.gpu("h100_580")
    machine.jax({**jax_gpu("NVIDIA H100 80GB HBM3"), "result_ok": False})
    code, rep = machine.run()
    jax = check(rep, "jax")
    assert jax["status"] == "fail" and "computed a WRONG result" in jax["finding"]


# ---------------------------------------------------------------------------------------------- torch


def test_torch_cuda_build_without_gpu_warns(machine):
    machine.torch({"ok": True, "version": "2.8.0+cu128", "cuda_build": "12.8", "cuda_available": False, "warnings": []})
    code, rep = machine.run()
    t = check(rep, "torch")
    assert t["status"] == "warn"
    assert t["finding"] == "torch 2.8.0+cu128 is a CUDA 12.8 build with no usable GPU (torch.cuda.is_available() is False; no GPU on this machine)"
    assert "--index-url $PYTORCH_INDEX_URL/cpu" in t["fix"]
    assert code == 0


def test_torch_cpu_build_on_gpu_machine_warns_with_index(machine):
    machine.gpu("a100_535")
    machine.jax(jax_gpu("NVIDIA A100-SXM4-80GB"))
    code, rep = machine.run()
    t = check(rep, "torch")
    assert t["status"] == "warn"
    assert "is a CPU build: the torch side runs on CPU although a GPU is present" in t["finding"]
    assert t["fix"] == "pip install -U --force-reinstall torch --index-url $PYTORCH_INDEX_URL/cu128"
    assert code == 0


def test_torch_too_new_for_driver_reports_torch_warning(machine):
    machine.gpu("a100_535")
    msg = (
        "CUDA initialization: The NVIDIA driver on your system is too old (found version 12020). Please update your GPU "
        "driver by downloading and installing a new version from the URL: http://www.nvidia.com/Download/index.aspx"
    )
    machine.torch({"ok": True, "version": "2.9.0+cu130", "cuda_build": "13.0", "cuda_available": False, "warnings": [msg]})
    code, rep = machine.run()
    t = check(rep, "torch")
    assert t["status"] == "warn"
    assert "is a CUDA 13.0 build but torch.cuda.is_available() is False although a GPU is present: CUDA initialization: The NVIDIA driver on your system is too old" in t["finding"]
    assert t["fix"].endswith("--index-url $PYTORCH_INDEX_URL/cu128")


def test_torch_cuda_ok_on_580(machine):
    machine.gpu("h100_580")
    machine.jax(jax_gpu("NVIDIA H100 80GB HBM3"))
    machine.torch({"ok": True, "version": "2.9.0+cu130", "cuda_build": "13.0", "cuda_available": True, "device_count": 1,
                   "devices": ["NVIDIA H100 80GB HBM3"], "capabilities": [[9, 0]], "result_ok": True, "warnings": []})
    code, rep = machine.run()
    t = check(rep, "torch")
    assert t["status"] == "ok"
    assert t["finding"] == "torch 2.9.0+cu130 (CUDA 13.0 build): torch.cuda.is_available() is True, 1x NVIDIA H100 80GB HBM3"
    assert code == 0 and rep["summary"]["fail"] == 0


def test_torch_not_installed_is_ok(machine, monkeypatch):
    machine.real_torch()
    real = dists._dist_version
    monkeypatch.setattr(dists, "_dist_version", lambda name: None if name == "torch" else real(name))
    code, rep = machine.run()
    t = check(rep, "torch")
    assert t["status"] == "ok" and t["finding"].startswith("PyTorch is not installed")


@pytest.mark.parametrize("fixture,build", [("a100_535", "cuda12"), ("h100_580", "cuda13"), ("rtx4090_550_busy", "cuda12")])
def test_plan_follows_driver(machine, fixture, build):
    machine.gpu(fixture)
    _, rep = machine.run()
    assert check(rep, "accelerator")["details"]["recommended_jax"] == f"jax[{build}]"
    assert check(rep, "jax")["fix"] == f'pip install -U "jax[{build}]"'


def test_old_style_cuda_jaxlib_is_not_called_cpu_only(machine, monkeypatch):
    """jaxlib 0.4.x shipped CUDA inside jaxlib itself (version 0.4.23+cuda12.cudnn89), no plugin."""
    real = dists._dist_version
    monkeypatch.setattr(dists, "_dist_version", lambda name: "0.4.23+cuda12.cudnn89" if name == "jaxlib" else real(name))
    machine.gpu("a100_535")
    _, rep = machine.run()
    jax = check(rep, "jax")
    assert jax["status"] == "fail"
    assert "the CUDA jaxlib (0.4.23+cuda12.cudnn89) is installed but not used" in jax["finding"]
    assert "CPU-only" not in jax["finding"]
    assert jax["fix"] == 'pip install -U "jax[cuda12]"'


def test_torch_fixes_take_the_index_from_pytorch_index_url(machine, monkeypatch):
    """preheat names no package host: a fix prints $PYTORCH_INDEX_URL for the shell, or its value
    (a mirror, or the index PyTorch's install selector names) when it is set."""
    monkeypatch.setenv("PYTORCH_INDEX_URL", "http://127.0.0.1:9/whl/")
    machine.gpu("a100_535")
    machine.jax(jax_gpu("NVIDIA A100-SXM4-80GB"))
    code, rep = machine.run()
    assert check(rep, "torch")["fix"] == "pip install -U --force-reinstall torch --index-url http://127.0.0.1:9/whl/cu128"
