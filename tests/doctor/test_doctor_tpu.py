"""`preheat doctor` on a simulated TPU v5e VM (tests/_support/tpu_fixtures.py): the chips, JAX on
them, and each thing that goes wrong there with its one-line fix."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests._support.doctor_fixtures import JAX_CPU, check
from tests._support.script_modules import load_script
from tests._support.tpu_fixtures import IN_USE, JAX_TPU, LOCKFILE_ERROR, weights_folder

TPU_IDS = ["accelerator", "jax", "torch", "tpu_hugepages", "tpu_memory", "storage_cache", "storage_hf", "cache_health"]
PIP_TPU = ('pip install "jax[tpu]==0.10.2" (jax\'s tpu extra brings the libtpu built for it; from a preheat checkout: '
           'pip install ".[tpu]")')


def test_a_healthy_v5e_names_the_chip_and_passes(machine):
    machine.tpu()
    code, rep = machine.run()
    assert [c["id"] for c in rep["checks"]] == TPU_IDS  # no NVIDIA rows on a TPU VM
    acc = check(rep, "accelerator")
    assert acc["status"] == "ok"
    assert acc["finding"] == ("1x TPU v5 lite, 15.75 GiB HBM each; JAX sees 1 chip (1x1x1) of the v5litepod-4 slice, "
                              "topology 2x2; libtpu 0.0.42.1")
    jax = check(rep, "jax")
    assert jax["status"] == "ok"
    assert jax["finding"] == ("jax 0.10.2 / jaxlib 0.10.2 + libtpu 0.0.42.1: backend tpu, 1x TPU v5 lite "
                              "(import + test matmul in 9.4 s)")
    assert check(rep, "tpu_hugepages")["finding"] == ("cannot read /sys/kernel/mm/transparent_hugepage/enabled: "
                                                      "not checked")  # the recorded sandbox has no such file
    assert check(rep, "tpu_memory")["finding"] == (
        "the TPU runtime gives one process each chip's whole HBM, 15.75 GiB, with no preallocation and no fraction to set")
    assert rep["versions"]["tpu"]["generation"] == "v5e"  # from TPU_ACCELERATOR_TYPE: no PCI bus in the sandbox
    assert code == 0


def test_the_table_on_a_v5e(machine):
    machine.tpu()
    code, out = machine.human()
    assert code == 0
    assert "1x TPU v5 lite, 15.75 GiB HBM each; JAX sees 1 chip (1x1x1) of the v5litepod-4 slice" in out
    assert "| TPU v5e, libtpu 0.0.42.1" in out
    assert "NVIDIA" not in out


def test_jax_without_libtpu_runs_on_the_cpu_and_says_so(machine):
    machine.tpu(versions={"libtpu": None}, jax=JAX_CPU)
    code, rep = machine.run()
    jax = check(rep, "jax")
    assert jax["status"] == "fail"
    assert jax["finding"] == ("jax 0.10.2 / jaxlib 0.10.2 + no libtpu: JAX runs on cpu on a TPU VM: this jax has no "
                              "libtpu, so it never tries the TPU")
    assert jax["fix"] == PIP_TPU
    acc = check(rep, "accelerator")
    assert acc["finding"] == ("TPU VM: TPU v5e (the v5litepod-4 slice, topology 2x2; seen from TPU_ACCELERATOR_TYPE="
                              "v5litepod-4, TPU_WORKER_ID=0, /dev/vfio/2); no libtpu installed; JAX does not compute on "
                              "it (see JAX backend)")
    assert code == 1


def test_a_tpu_found_by_its_pci_id_alone(machine):
    machine.tpu(versions={"libtpu": None}, jax=JAX_CPU, env=False, pci=True)
    _, rep = machine.run()
    assert check(rep, "jax")["fix"] == PIP_TPU
    assert check(rep, "accelerator")["finding"].startswith("TPU VM: 1x TPU v5e (seen from PCI 0x1ae0:0x0063, /dev/vfio/2)")


def test_jax_not_installed(machine):
    machine.tpu(versions={"jax": None, "jaxlib": None, "libtpu": None})
    machine.mp.delenv("PREHEAT_DOCTOR_JAX_PROBE")
    _, rep = machine.run()
    jax = check(rep, "jax")
    assert (jax["status"], jax["finding"]) == ("fail", "jax is not installed on this TPU VM")
    assert jax["fix"].startswith('pip install "jax[tpu]" ')


def test_jax_platforms_cpu_keeps_jax_off_the_tpu(machine, monkeypatch):
    machine.tpu(jax=JAX_CPU)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    _, rep = machine.run()
    jax = check(rep, "jax")
    assert jax["finding"].endswith("JAX runs on cpu on a TPU VM: JAX_PLATFORMS=cpu keeps it off the TPU")
    assert jax["fix"] == "unset JAX_PLATFORMS"


def test_the_chip_held_by_another_process_names_it(machine):
    machine.tpu(jax={"ok": False, "error": IN_USE.format(pid=4242), "backend_errors": {}, "warnings": []})
    machine.holder(4242, "python3", "/dev/vfio/2")
    code, rep = machine.run()
    jax = check(rep, "jax")
    assert jax["status"] == "fail"
    assert jax["finding"] == ("jax 0.10.2 / jaxlib 0.10.2 + libtpu 0.0.42.1: the TPU is held by another process: "
                              "pid 4242 (python3) has /dev/vfio/2 open; one process owns a chip")
    assert jax["fix"] == "stop it (`kill 4242`, or wait for it to finish), then run again"
    assert code == 1


def test_a_holder_this_user_cannot_see_is_named_from_libtpus_words(machine):
    machine.tpu(jax={"ok": False, "error": IN_USE.format(pid=977), "backend_errors": {}, "warnings": []})
    _, rep = machine.run()
    assert "the TPU is held by another process: pid 977; one process owns a chip" in check(rep, "jax")["finding"]
    assert check(rep, "jax")["fix"].startswith("stop it (`kill 977`")


def test_a_stale_lockfile_is_removed(machine):
    machine.tpu(jax={"ok": False, "error": LOCKFILE_ERROR, "backend_errors": {}, "warnings": []})
    machine.lockfile()
    _, rep = machine.run()
    jax = check(rep, "jax")
    assert jax["finding"].endswith("libtpu's lockfile /tmp/libtpu_lockfile is left from a process that is gone "
                                   "(no process holds the chip)")
    assert jax["fix"] == "rm /tmp/libtpu_lockfile"


@pytest.mark.parametrize("setting, shown", [("always madvise [never]", "never"), ("always [madvise] never", "madvise")])
def test_hugepages_off_or_madvise_warn_with_the_command(machine, setting, shown):
    machine.tpu(thp=setting)
    code, rep = machine.run()
    thp = check(rep, "tpu_hugepages")
    assert thp["status"] == "warn"
    assert thp["finding"].startswith(f"transparent hugepages are [{shown}], not [always]: JAX warns")
    assert thp["fix"] == ("echo always | sudo tee /sys/kernel/mm/transparent_hugepage/enabled (until reboot; "
                          "transparent_hugepage=always on the kernel command line keeps it)")
    assert code == 0


def test_gpu_allocator_variables_do_nothing_on_a_tpu(machine, monkeypatch):
    machine.tpu()
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    code, rep = machine.run()
    mem = check(rep, "tpu_memory")
    assert mem["status"] == "warn"
    assert mem["finding"].startswith("XLA_PYTHON_CLIENT_PREALLOCATE=false, XLA_PYTHON_CLIENT_MEM_FRACTION=0.5: read only "
                                     "by JAX's GPU client, no effect on a TPU")
    assert mem["fix"] == ("unset XLA_PYTHON_CLIENT_PREALLOCATE XLA_PYTHON_CLIENT_MEM_FRACTION; this VM has one chip: "
                          "one process at a time")
    assert code == 0


def test_vfio_alone_is_not_a_tpu(machine):
    (machine.dev / "vfio").mkdir()
    (machine.dev / "vfio" / "3").write_text("")  # a GPU passed through to a VM has vfio groups too
    _, rep = machine.run()
    assert "tpu_hugepages" not in [c["id"] for c in rep["checks"]]
    assert check(rep, "accelerator")["finding"].startswith("no NVIDIA GPU")
    assert rep["versions"]["tpu"] is None


def test_probe_reports_the_chip_facts_json_keys():
    """The real probe's device facts on the CPU: memory stats are absent there, the keys are optional."""
    out = subprocess.run([sys.executable, "-m", "preheat.doctor.jax_probe"], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"}).stdout
    data = json.loads(out.split("PREHEAT_DOCTOR_PROBE=", 1)[1])
    assert data["ok"] and data["backend"] == "cpu"
    assert "device" in data and data["device"].get("process_count") == 1
    assert JAX_TPU["device"].keys() >= {"bytes_limit", "bounds", "cores_per_chip"}


def _small_chip(machine, limit):
    machine.tpu(jax={**JAX_TPU, "device": {**JAX_TPU["device"], "bytes_limit": limit}})
    return weights_folder(machine.root / "model")


def test_model_that_does_not_fit_names_the_option_that_does(machine):
    model = _small_chip(machine, 600_000)
    code, rep = machine.run("--model", str(model))
    fit = check(rep, "model_fit")
    assert fit["status"] == "fail"
    assert fit["finding"] == ("0.7 MiB of weights at --dtype float32 (unet 0.5 MiB, text_encoder 0.2 MiB, vae 0.0 MiB): "
                              "0.2 MiB more than the 0.6 MiB HBM of one TPU chip")
    assert fit["fix"] == "load with --dtype bfloat16 (0.4 MiB, about 68%)"
    assert [c["id"] for c in rep["checks"]][-4] == "model_fit"
    assert code == 1


def test_model_fit_at_bfloat16_suggests_int8_weights_on_a_tpu(machine):
    model = _small_chip(machine, 420_000)
    _, rep = machine.run("--model", str(model), "--dtype", "bfloat16")
    assert check(rep, "model_fit")["fix"] == "load with --dtype bfloat16 --weights-dtype int8 (0.3 MiB, about 73%)"
    model2 = weights_folder(machine.root / "model2")
    _, rep = machine.run("--model", str(model2), "--dtype", "bfloat16", "--weights-dtype", "float8_e4m3fn")
    fit = check(rep, "model_fit")
    assert fit["status"] == "ok" and fit["finding"].endswith(": 73% of the 0.4 MiB HBM of one TPU chip")


def test_model_fit_prints_the_plan_and_counts_offloaded_encoders_while_encoding(machine):
    model = _small_chip(machine, 400_000)
    code, rep = machine.run("--model", str(model), "--dtype", "bfloat16", "--offload-encoders")
    fit = check(rep, "model_fit")
    assert fit["status"] == "fail" and code == 1  # offloading lowers the resting weights, not the encode stage's
    assert fit["finding"].endswith("and text_encoder 0.1 MiB moved in while prompts are encoded: 0.4 MiB, 0.0 MiB more "
                                   "than the 0.4 MiB HBM of one TPU chip")
    assert fit["fix"] == ("load with --dtype bfloat16 --weights-dtype int8 --encoders-on offload "
                          "(0.2 MiB, about 44%; 0.3 MiB while prompts are encoded)")
    plan = fit["details"]["plan"]
    assert plan[1].split()[:4] == ["text_encoder", "host", "->", "device"] and plan[-1].startswith("encoding: 0.4 MiB")


def test_model_nearly_filling_the_chip_warns(machine):
    model = _small_chip(machine, 800_000)
    code, rep = machine.run("--model", str(model))
    fit = check(rep, "model_fit")
    assert fit["status"] == "warn"
    assert fit["finding"].endswith("97% of the 0.8 MiB HBM of one TPU chip, little room left for activations and "
                                   "compiled programs")
    assert code == 0


def test_model_fit_on_a_cpu_machine_and_a_missing_model(machine, tmp_path):
    model = weights_folder(tmp_path / "m")
    _, rep = machine.run("--model", str(model))
    assert check(rep, "model_fit")["finding"].endswith("no accelerator memory to compare with (the weights go to "
                                                        "host memory)")
    _, rep = machine.run("--model", str(tmp_path / "nope"))
    fit = check(rep, "model_fit")
    assert fit["status"] == "fail" and fit["finding"].startswith(f"cannot size {tmp_path / 'nope'}: ")


def test_a_v4_vm_by_its_accel_nodes_and_a_holder_of_one(machine):
    """TPU v2-v4 VMs show their chips as /dev/accel<N> (and /sys/class/accel), with no TPU_* variables needed."""
    for i in range(4):
        (machine.dev / f"accel{i}").write_text("")
    (machine.host / "sys/class/accel/accel0").mkdir(parents=True)
    machine.jax({"ok": False, "error": IN_USE.format(pid=88), "backend_errors": {}, "warnings": []})
    machine.holder(88, "train.py", "/dev/accel2")
    machine.holder(89, "bash", "/dev/null")  # a process with other files open is no holder
    _, rep = machine.run()
    assert [c["id"] for c in rep["checks"]][:5] == TPU_IDS[:5]
    assert check(rep, "accelerator")["details"]["nodes"] == [f"/dev/accel{i}" for i in range(4)]
    assert "pid 88 (train.py) has /dev/accel2 open" in check(rep, "jax")["finding"]
    assert check(rep, "jax")["fix"].startswith("stop it (`kill 88`")


def test_a_libtpu_given_by_tpu_library_path_counts(machine, monkeypatch):
    machine.tpu(versions={"libtpu": None})
    lib = machine.root / "libtpu.so"
    lib.write_text("")
    monkeypatch.setenv("TPU_LIBRARY_PATH", str(lib))
    _, rep = machine.run()
    assert check(rep, "jax")["finding"].startswith(f"jax 0.10.2 / jaxlib 0.10.2 + libtpu from TPU_LIBRARY_PATH={lib}: "
                                                   "backend tpu")


def test_flux_dev_on_a_v5e_fits_with_its_encoders_offloaded_or_on_the_host(machine, tmp_path):
    """FLUX.1-dev's published sizes (scripts/flux_memory_plan.py's header-only folder) on the recorded chip:
    the fix names the text encoders offloaded (T5-XXL streamed a block at a time beside the int8
    transformer), and with that option the model fits; with them on the host it fits too."""
    script = load_script("flux_memory_plan")
    script.write_flux_dev(tmp_path)
    machine.tpu()
    code, rep = machine.run("--model", str(tmp_path), "--dtype", "bfloat16")
    fit = check(rep, "model_fit")
    assert fit["status"] == "fail" and code == 1
    assert fit["fix"].startswith("load with --dtype bfloat16 --weights-dtype int8 --weights-layers linear "
                                 "--encoders-on offload (11.")
    assert fit["fix"].endswith(" GiB while prompts are encoded)")
    assert fit["details"]["plan"][0].split()[:4] == ["transformer", "device", "bfloat16", "22.17"]
    flags = ("--model", str(tmp_path), "--dtype", "bfloat16", "--weights-dtype", "int8", "--weights-layers", "linear")
    code, rep = machine.run(*flags, "--encoders-on", "offload")
    fit = check(rep, "model_fit")
    assert fit["status"] == "ok", fit
    t5 = fit["details"]["offloaded"]["text_encoder_2"]
    block = 4096 * 4096 * 2 * 4 + 3 * 4096 * 10240 * 2  # one T5-XXL block in bfloat16: attention and gated FF
    embedding = 32128 * 4096 * 2
    streamed = fit["details"]["peak"] - fit["details"]["total"]
    assert t5 > 8 * 2**30 and embedding + 2 * block < streamed < embedding + 3 * block  # CLIP-L's two layers beside
    assert any("streamed while prompts are encoded" in line for line in fit["details"]["plan"])
    code, rep = machine.run(*flags, "--encoders-on", "host")
    fit = check(rep, "model_fit")
    assert fit["status"] == "ok", fit
    assert "of text encoders run on the host" in fit["finding"]
    assert any(line.startswith("host memory: ") for line in fit["details"]["plan"])
