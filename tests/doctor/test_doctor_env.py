"""GPU memory settings, LD_LIBRARY_PATH and conflicting CUDA library wheels."""

from __future__ import annotations

import sys

from preheat.doctor import dists
from tests._support.doctor_fixtures import check, jax_gpu
from tests._support.doctor_sites import fake_site

BUSY = "2 other process(es) use 20390 MiB of 24564 MiB (pid 2714 /usr/bin/python3 18342 MiB, pid 3120 /opt/conda/bin/python 2048 MiB)"


def _busy(machine):
    machine.gpu("rtx4090_550_busy")
    machine.jax(jax_gpu("NVIDIA GeForce RTX 4090"))


def test_busy_gpu_with_default_preallocation_warns(machine):
    _busy(machine)
    code, rep = machine.run()
    mem = check(rep, "gpu_memory")
    assert mem["status"] == "warn"
    assert mem["finding"].startswith(BUSY + " while preallocation is on (XLA_PYTHON_CLIENT_* unset: JAX defaults)")
    assert "JAX will try to reserve 75% (18423 MiB) at startup but only 4174 MiB is left: out of memory" in mem["finding"]
    assert mem["fix"] == (
        "export XLA_PYTHON_CLIENT_PREALLOCATE=false (or export XLA_PYTHON_CLIENT_MEM_FRACTION=0.15)"
        " (set it before JAX is imported: in the shell or the pod's env, not after `import jax`)"
    )
    assert [p["pid"] for p in mem["details"]["other_processes"]] == [2714, 3120]
    assert code == 0  # a warning does not fail


def test_busy_gpu_with_preallocation_off_is_ok(machine, monkeypatch):
    _busy(machine)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    _, rep = machine.run()
    mem = check(rep, "gpu_memory")
    assert mem["status"] == "ok"
    assert mem["finding"] == BUSY + "; JAX preallocation is off, so it takes memory as needed (XLA_PYTHON_CLIENT_PREALLOCATE=false)"


def test_busy_gpu_with_platform_allocator_is_ok(machine, monkeypatch):
    _busy(machine)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")
    _, rep = machine.run()
    assert check(rep, "gpu_memory")["status"] == "ok"


def test_busy_gpu_mem_fraction_that_fits_is_ok_and_too_big_warns(machine, monkeypatch):
    _busy(machine)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.15")
    _, rep = machine.run()
    mem = check(rep, "gpu_memory")
    assert mem["status"] == "ok"
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION=0.15 reserves 3684 MiB, which fits in the 4174 MiB left" in mem["finding"]
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
    _, rep = machine.run()
    mem = check(rep, "gpu_memory")
    assert mem["status"] == "warn"
    assert "JAX will try to reserve 50% (12282 MiB) at startup but only 4174 MiB is left" in mem["finding"]


def test_idle_gpu_memory_ok(machine):
    machine.gpu("a100_535")
    _, rep = machine.run()
    mem = check(rep, "gpu_memory")
    assert mem["status"] == "ok"
    assert mem["finding"] == "no other process on the GPU; JAX preallocates 75% of GPU memory at startup (XLA_PYTHON_CLIENT_* unset: JAX defaults)"


def test_bad_allocator_fails_on_gpu(machine, monkeypatch):
    machine.gpu("a100_535")
    monkeypatch.setenv("XLA_PYTHON_CLIENT_ALLOCATOR", "cuda_malloc")
    code, rep = machine.run()
    mem = check(rep, "gpu_memory")
    assert mem["status"] == "fail"
    assert "XLA_PYTHON_CLIENT_ALLOCATOR=cuda_malloc is not one of default, platform, bfc, cuda_async, vmm" in mem["finding"]
    assert mem["fix"] == "unset XLA_PYTHON_CLIENT_ALLOCATOR"
    assert code == 1


def test_bad_mem_fraction_without_gpu_only_warns(machine, monkeypatch):
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "75")
    code, rep = machine.run()
    mem = check(rep, "gpu_memory")
    assert mem["status"] == "warn"
    assert mem["finding"] == "XLA_PYTHON_CLIENT_MEM_FRACTION=75 is not a fraction in (0, 1]"
    assert mem["fix"].startswith("export XLA_PYTHON_CLIENT_MEM_FRACTION=0.75")
    assert code == 0


def test_both_mem_fraction_variables(machine, monkeypatch):
    machine.gpu("a100_535")
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
    monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "0.5")
    _, rep = machine.run()
    mem = check(rep, "gpu_memory")
    assert mem["status"] == "fail" and mem["fix"] == "unset XLA_PYTHON_CLIENT_MEM_FRACTION"


# ---------------------------------------------------------------------------------------------- LD_LIBRARY_PATH


def test_ld_library_path_unset_ok(machine):
    _, rep = machine.run()
    ld = check(rep, "ld_library_path")
    assert ld["status"] == "ok" and ld["fix"] is None
    assert ld["finding"] == "LD_LIBRARY_PATH is not set: JAX and torch load the CUDA libraries of their pip wheels"


def test_ld_library_path_with_cuda_libs_warns(machine, monkeypatch, tmp_path):
    lib = tmp_path / "usr-local-cuda-12.2" / "lib64"
    lib.mkdir(parents=True)
    for f in ("libcudnn.so.8", "libcublas.so.12", "libcublasLt.so.12", "libfoo.so"):
        (lib / f).write_text("")
    monkeypatch.setenv("LD_LIBRARY_PATH", f"{lib}:/usr/local/nvidia/lib64")
    code, rep = machine.run()
    ld = check(rep, "ld_library_path")
    assert ld["status"] == "warn"
    assert f"{lib} (libcublas, libcublasLt, libcudnn); /usr/local/nvidia/lib64" in ld["finding"]
    assert "JAX recommends leaving it unset" in ld["finding"]
    assert ld["fix"].startswith("unset LD_LIBRARY_PATH")
    assert code == 0


def test_ld_library_path_of_driver_folders_only_is_ok(machine, monkeypatch, tmp_path):
    """The lent H200 pod sets LD_LIBRARY_PATH=/usr/local/nvidia/lib64:/usr/local/nvidia/lib, folders
    of the driver's own libraries; JAX ran there on its wheels' cuDNN (docs/gpu.md). Folders that
    are read and hold no CUDA toolkit library shadow nothing."""
    driver = tmp_path / "usr" / "local" / "nvidia" / "lib64"
    driver.mkdir(parents=True)
    for f in ("libcuda.so.1", "libnvidia-ml.so.1", "libnvidia-ptxjitcompiler.so.1"):
        (driver / f).write_text("")
    monkeypatch.setenv("LD_LIBRARY_PATH", str(driver))
    _, rep = machine.run()
    ld = check(rep, "ld_library_path")
    assert ld["status"] == "ok" and ld["fix"] is None, ld
    assert ld["finding"].startswith(f"LD_LIBRARY_PATH={driver} holds no CUDA toolkit library")
    (driver / "libcudnn.so.9").write_text("")  # the same folder with cuDNN in it does shadow the wheels'
    _, rep = machine.run()
    assert check(rep, "ld_library_path")["status"] == "warn"


def test_ld_library_path_without_cuda_still_warns(machine, monkeypatch):
    monkeypatch.setenv("LD_LIBRARY_PATH", "/opt/intel/lib")
    _, rep = machine.run()
    ld = check(rep, "ld_library_path")
    assert ld["status"] == "warn"
    assert ld["finding"] == "LD_LIBRARY_PATH=/opt/intel/lib is set; it can shadow the pip wheels' CUDA libraries (JAX recommends leaving it unset)"
    assert ld["fix"].startswith("unset LD_LIBRARY_PATH")


# ---------------------------------------------------------------------------------------------- CUDA wheels


def _use_site(monkeypatch, site):
    monkeypatch.setattr(dists, "_dist_search_path", lambda: [str(site)] + sys.path)


def test_cudnn_cu12_from_torch_and_cu13_from_jax_warns(machine, monkeypatch, tmp_path):
    shared = "nvidia/cudnn/lib/libcudnn.so.9"
    site = fake_site(
        tmp_path / "site",
        {
            "torch": ("2.8.0", ['nvidia-cudnn-cu12==9.10.2.21; platform_system == "Linux" and platform_machine == "x86_64"'], []),
            "jax-cuda13-plugin": ("0.10.2", ['nvidia-cudnn-cu13<10.0,>=9.12.0.46; sys_platform == "linux" and extra == "with-cuda"'], []),
            "nvidia-cudnn-cu12": ("9.10.2.21", [], [shared]),
            "nvidia-cudnn-cu13": ("9.13.0.50", [], [shared]),
        },
    )
    _use_site(monkeypatch, site)
    machine.gpu("h100_580")
    code, rep = machine.run()
    libs = check(rep, "cuda_libs")
    assert libs["status"] == "warn"
    assert libs["finding"] == (
        "2 cudnn wheels installed side by side: nvidia-cudnn-cu12 9.10.2.21 (needed by torch); "
        "nvidia-cudnn-cu13 9.13.0.50 (needed by jax-cuda13-plugin); they write the same file "
        "nvidia/cudnn/lib/libcudnn.so.9, so the one installed last overwrote the other"
    )
    assert libs["fix"] == (
        "keep CUDA 13 only: pip uninstall -y nvidia-cudnn-cu12 && "
        "pip install -U --force-reinstall torch --index-url $PYTORCH_INDEX_URL/cu130 && "
        "pip install --force-reinstall --no-deps nvidia-cudnn-cu13"
    )


def test_cublas_12_and_13_without_driver_info_keeps_jax_plugin_major(machine, monkeypatch, tmp_path):
    site = fake_site(
        tmp_path / "site",
        {
            "jax-cuda12-plugin": ("0.10.2", ['nvidia-cublas-cu12>=12.1.3.1; extra == "with-cuda"'], []),
            "nvidia-cublas-cu12": ("12.9.1.4", [], ["nvidia/cublas/lib/libcublas.so.12"]),
            "nvidia-cublas": ("13.0.0.19", [], ["nvidia/cu13/lib/libcublas.so.13"]),
        },
    )
    _use_site(monkeypatch, site)
    _, rep = machine.run()
    libs = check(rep, "cuda_libs")
    assert libs["status"] == "warn"
    assert "2 cublas wheels installed side by side: nvidia-cublas 13.0.0.19; nvidia-cublas-cu12 12.9.1.4 (needed by jax-cuda12-plugin)" in libs["finding"]
    assert "torch and JAX may load a different one than they were built for" in libs["finding"]
    assert libs["fix"] == "keep CUDA 12 only: pip uninstall -y nvidia-cublas && pip install --force-reinstall --no-deps nvidia-cublas-cu12"


def test_cudnn_version_pinned_by_torch_below_jax_minimum(machine, monkeypatch, tmp_path):
    site = fake_site(
        tmp_path / "site",
        {
            "torch": ("2.5.1", ['nvidia-cudnn-cu12==9.1.0.70; platform_system == "Linux"'], []),
            "jax-cuda12-plugin": ("0.10.2", ['nvidia-cudnn-cu12<10.0,>=9.8; extra == "with-cuda"'], []),
            "nvidia-cudnn-cu12": ("9.1.0.70", [], []),
        },
    )
    _use_site(monkeypatch, site)
    _, rep = machine.run()
    libs = check(rep, "cuda_libs")
    assert libs["status"] == "warn"
    assert libs["finding"] == "nvidia-cudnn-cu12 9.1.0.70 is installed but jax-cuda12-plugin requires nvidia-cudnn-cu12<10.0,>=9.8"
    assert libs["fix"] == (
        "pip install -U torch (its pin on nvidia-cudnn-cu12 is older than the others accept); "
        "if no release fits, give torch and JAX separate virtualenvs"
    )


def test_cudnn_too_old_for_everyone_reinstall_with_combined_spec(machine, monkeypatch, tmp_path):
    site = fake_site(
        tmp_path / "site",
        {
            "torch": ("2.8.0", ['nvidia-cudnn-cu12==9.10.2.21; platform_system == "Linux"'], []),
            "jax-cuda12-plugin": ("0.10.2", ['nvidia-cudnn-cu12<10.0,>=9.8; extra == "with-cuda"'], []),
            "nvidia-cudnn-cu12": ("9.5.1.17", [], []),
        },
    )
    _use_site(monkeypatch, site)
    _, rep = machine.run()
    libs = check(rep, "cuda_libs")
    assert libs["finding"] == (
        "nvidia-cudnn-cu12 9.5.1.17 is installed but jax-cuda12-plugin requires nvidia-cudnn-cu12<10.0,>=9.8, "
        "torch requires nvidia-cudnn-cu12==9.10.2.21"
    )
    assert libs["fix"] == 'pip install "nvidia-cudnn-cu12<10.0,>=9.8,==9.10.2.21"'


def test_no_cuda_wheels_ok(machine):
    _, rep = machine.run()
    libs = check(rep, "cuda_libs")
    assert libs["status"] == "ok" and libs["finding"] == "one cuDNN / cuBLAS wheel per family (none installed)"


def test_preallocate_spelled_in_capitals_does_not_count(machine, monkeypatch):
    machine.gpu("a100_535")
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "FALSE")
    _, rep = machine.run()
    mem = check(rep, "gpu_memory")
    assert mem["status"] == "warn"
    assert mem["finding"] == "XLA_PYTHON_CLIENT_PREALLOCATE=FALSE does NOT turn preallocation off (JAX accepts only false, False or 0)"
    assert mem["fix"].startswith("export XLA_PYTHON_CLIENT_PREALLOCATE=false (set it before JAX is imported")
