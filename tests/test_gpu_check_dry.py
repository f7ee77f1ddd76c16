"""scripts/gpu_check.sh cannot rot between GPU draws: its dry run (same script, CPU devices, tiny
sizes) passes in a clean venv that looks like the GPU machine (this environment's packages minus
preheat, diffusers and FastAPI) with installs from the network off -- issue 29's rows (the
executables compiled here for the H200 by ``prepare``, autotune-and-replace, SDXL / FLUX.1 /
Kontext against torch) as well as the older ones; its preflight stops with one line naming what
is missing; a row that does not fit the budget is named; and its FLOP count agrees with XLA's."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

from tests._support.clean_env import clean_venv, offline_env

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
# What the GPU image lacks (docs/gpu.md): preheat and diffusers are carried as wheels.
NOT_ON_GPU = {"preheat", "diffusers", "fastapi", "importlib-metadata", "lazy-importer"}


def _load(name: str):
    if f"scripts.{name}" in sys.modules:
        return sys.modules[f"scripts.{name}"]
    spec = importlib.util.spec_from_file_location(f"scripts.{name}", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up while the class is built)
    spec.loader.exec_module(module)
    return module


def _fake_wheel(folder: Path, name: str, version: str, requires: list[str],
                files: dict[str, bytes] | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}-{version}-py3-none-any.whl"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{name}-{version}.dist-info/METADATA", meta)
        for n, data in (files or {}).items():
            zf.writestr(n, data)
    return path


def test_matrix_flops_match_xla_cost_analysis():
    """Valid (unpadded) convolutions, grouped and strided, and batched matmuls, also inside a
    nested jit: the count is exact against XLA's own cost analysis of each."""
    import jax
    import jax.numpy as jnp

    measure = _load("gpu_measure")
    rng = np.random.default_rng(0)  # (numpy inputs: nothing here compiles)
    x = rng.standard_normal((2, 11, 9, 8), np.float32)
    k = rng.standard_normal((3, 3, 8, 12), np.float32)
    kg = rng.standard_normal((3, 2, 2, 8), np.float32)  # 4 groups of 2 input channels
    a, b = rng.standard_normal((3, 5, 6), np.float32), rng.standard_normal((3, 6, 7), np.float32)
    dn = ("NHWC", "HWIO", "NHWC")
    cases = [
        lambda: jax.lax.conv_general_dilated(x, k, (1, 1), "VALID", dimension_numbers=dn),
        lambda: jax.lax.conv_general_dilated(x, kg, (2, 1), "VALID", dimension_numbers=dn, feature_group_count=4),
        lambda: jnp.einsum("bij,bjk->bik", a, b),
    ]
    total = 0
    for fn in cases:
        ours = measure.matrix_flops(jax.make_jaxpr(fn)().jaxpr)
        assert ours == jax.jit(fn).lower().cost_analysis()["flops"] > 0
        total += ours
    nested = jax.jit(lambda: [jax.jit(fn)() for fn in cases])
    assert measure.matrix_flops(jax.make_jaxpr(nested)().jaxpr) == total


def test_fp8unet_decision_follows_the_documented_rule():
    """Row 7's decision (docs/gpu.md): keep the GEMM path iff it won every round on both UNets and
    the outputs agree; a UNet without a measurement leaves it undecided."""
    measure = _load("gpu_measure")
    from preheat.bench.fp8_unet import verdict

    assert verdict([0.97, 0.99, 0.98]) == "faster" and verdict([1.01, 1.02]) == "slower"
    assert verdict([0.97, 1.01, 0.98]) == "within noise" and verdict([]) == "within noise"
    ok = {"ok": True}
    faster, noise = {"verdict": "faster", "agreement": ok}, {"verdict": "within noise", "agreement": ok}
    assert measure.fp8unet_decision({"sd15": faster, "sdxl": faster}).startswith("keep: ")
    assert measure.fp8unet_decision({"sd15": faster, "sdxl": noise}) == "revert: sd15 faster, sdxl within noise"
    assert measure.fp8unet_decision({"sd15": faster, "sdxl": {"skipped": "budget"}}).startswith(
        "undecided: no measurement of sdxl")
    assert measure.fp8unet_decision({"sd15": noise, "sdxl": {"error": "x"}}).startswith("revert: sd15 within noise")
    bad = {"verdict": "faster", "agreement": {"ok": False}}
    assert measure.fp8unet_decision({"sd15": bad, "sdxl": faster}).startswith("revert: an fp8 way is further")


def test_fp8unet_agreement_singles_out_the_path_that_is_off():
    """Row 7's agreement: each fp8 way against a float32 reference, bounded by the bf16 control's
    own error. Three ways ~9% apart from each other, each as far from float32 as the control (the
    H200's round-11 case), agree; a way as far off as unrelated weights does not."""
    from preheat.bench.fp8_unet import AGREE_FLOOR, AGREE_RATIO, agreement

    rng = np.random.default_rng(0)
    reference = rng.standard_normal((1, 8, 8, 4)).astype(np.float32)
    near = {way: reference + 0.06 * rng.standard_normal(reference.shape).astype(np.float32)
            for way in ("gemm", "conv", "bf16")}  # each ~5% from float32, ~7% from each other
    got = agreement(near, reference)
    assert got["ok"] and got["bound"] == AGREE_RATIO * got["error_vs_float32"]["bf16"]["mean"] + AGREE_FLOOR
    assert not agreement({**near, "gemm": rng.standard_normal(reference.shape).astype(np.float32)}, reference)["ok"]
    assert not agreement({**near, "conv": np.full_like(reference, np.nan)}, reference)["ok"]
    exact = {way: reference.copy() for way in ("gemm", "conv", "bf16")}  # the CPU's bit-identical case
    assert agreement(exact, reference)["ok"] and agreement({**exact, "gemm": reference * 1.02}, reference)["ok"] is False


def test_row_2_gives_a_carried_ratio_only_when_the_carried_entry_served():
    """After a miss the carried root serves its own on-device compile, so its images/s say nothing
    about the entry compiled on the CPU (both H200 runs of round 11 printed such a ratio)."""
    measure = _load("gpu_measure")

    def line(layer: str) -> str:
        ips = {"carried": {"images_per_s": 2.0, "first_call_layer": layer},
               "device": {"images_per_s": 4.0, "first_call_layer": "none"}}
        (row,) = [r for r in measure._target_rows({"images_per_s": ips}) if ": images/s |" in r]
        return row

    assert "carried / on-device 0.500×" in line("aot")
    assert "carried / on-device" not in line("none") and "no carried ratio: the carried root served its own " \
        "compile (layer none)" in line("none")


def test_xlaser_decision_follows_the_documented_rule():
    """Row 8's decision (docs/gpu.md): add the platform to XLA_SERIALISE_SAFE_PLATFORMS iff the
    entry JAX's cache served (guard off) runs its first time in a new process with the "xla" run's
    pixels; a miss JAX's cache did not serve tested nothing."""
    measure = _load("gpu_measure")
    fill = {"layer": "none", "cache_events": [{"layer": "none"}]}
    miss = {"layer": "xla", "cache_events": [{"miss": "no entries yet", "store": "written", "layer": "xla"}]}
    ran = {"layer": "aot", "cache_events": [{"layer": "aot"}], "pixels_vs_fill": {"identical": True}}

    def verdict(**off) -> str:
        return measure.xlaser_verdict({"platform": "gpu", "off": {"fill": fill, "miss": miss, "hit": ran, **off}})

    assert verdict().startswith("add 'gpu' to XLA_SERIALISE_SAFE_PLATFORMS")
    error = "failed on its first run: NOT_FOUND: Function multiply_exponential_fusion not found (type id: 1)"
    failed = {"layer": "xla", "cache_events": [{"layer": "aot"}, {"quarantined": error}, {"layer": "xla"}],
              "pixels_vs_fill": {"identical": True}}  # recompiled after the quarantine: same pixels
    assert verdict(hit=failed) == f"keep 'gpu' out of XLA_SERIALISE_SAFE_PLATFORMS: the bug is there: {error}"
    assert verdict(hit={**ran, "pixels_vs_fill": {"identical": False, "max_abs": 3}}).startswith("keep 'gpu'")
    compiled = {"layer": "none", "cache_events": [{"store": "written", "layer": "none"}]}
    assert verdict(miss=compiled).startswith("undecided: the guard-off aot miss was not served by JAX's cache")
    assert verdict(hit={"error": "exit 1: boom"}) == "undecided: the guard-off hit process: exit 1: boom"


def test_preflight_names_what_is_missing_and_a_stale_wheel(tmp_path):
    preflight = _load("gpu_preflight")
    src = tmp_path / "src" / "preheat"
    src.mkdir(parents=True)
    (src / "__init__.py").write_bytes(b"x = 1\n")
    folder = tmp_path / "wheels"
    _fake_wheel(folder, "preheat", "0.1.0", ["numpy>=1", 'torch>=2.7; extra == "torch"', 'fastapi; extra == "serve"'],
                {"preheat/__init__.py": b"x = 1\n"})
    _fake_wheel(folder, "diffusers", "0.42.1", ["numpy", "importlib_metadata", "no-such-package-here>=1"])

    report = preflight.check(folder, "dry", src, None)
    assert report["problems"] == ["MISSING no-such-package-here (required by diffusers: no-such-package-here>=1); "
                                  "add it to CARRIED in scripts/gpu_wheels.sh and scripts/gpu_preflight.py"]
    assert report["stale_preheat_files"] == []
    assert "torch" in report["requirements"] and "fastapi" not in report["requirements"]  # extras torch, bench only
    assert report["requirements"]["importlib-metadata"]["status"].startswith("not imported")

    (src / "__init__.py").write_bytes(b"x = 2\n")
    (src / "new.py").write_bytes(b"")
    assert preflight.check(folder, "dry", src, None)["stale_preheat_files"] == ["__init__.py", "new.py"]

    _fake_wheel(folder, "diffusers", "0.41.0", ["numpy"])
    problems = preflight.check(folder, "dry", src, None)["problems"]
    assert any(p.startswith("DUPLICATE wheels for diffusers") for p in problems)

    gpu = preflight.check(tmp_path / "no-wheels", "gpu", src, None)
    assert gpu["problems"][0].startswith("MISSING wheel folder")


def test_preflight_on_a_gpu_machine_wants_a_matching_cuda_plugin_and_nvidia_smi(tmp_path, monkeypatch):
    preflight = _load("gpu_preflight")
    folder = tmp_path / "wheels"
    _fake_wheel(folder, "preheat", "0.1.0", ["numpy>=1"])
    _fake_wheel(folder, "diffusers", "0.42.1", ["numpy"])
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA H200, 580.159.04, 143771 MiB, 9.0'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    real = preflight._installed
    versions = {"jax": "0.11.2", "jaxlib": "0.11.2", "jax-cuda13-plugin": "0.11.1", "jax-cuda13-pjrt": "0.11.2",
                "jax-cuda12-plugin": None, "jax-cuda12-pjrt": None}  # the GPU image's, whatever is here
    monkeypatch.setattr(preflight, "_installed", lambda name: versions[name] if name in versions else real(name))

    report = preflight.check(folder, "gpu", None, None)
    assert report["problems"] == [
        "UNSUPPORTED jax-cuda13-plugin 0.11.1 with jaxlib 0.11.2: they must be the same version"]
    assert report["gpus"] == ["NVIDIA H200, 580.159.04, 143771 MiB, 9.0"]
    assert not any("jax" in w for w in report["warnings"])  # 0.11 is a tested version

    versions["jax-cuda13-plugin"] = "0.11.2"
    assert preflight.check(folder, "gpu", None, None)["problems"] == []
    versions.update({"jax": "0.12.0", "jaxlib": "0.12.0", "jax-cuda13-plugin": "0.12.0", "jax-cuda13-pjrt": "0.12.0"})
    newer = preflight.check(folder, "gpu", None, None)
    assert newer["problems"] == []
    assert "jax 0.12.0 is newer than the newest tested (0.11.x); continuing" in newer["warnings"]
    versions.update({"jax-cuda13-plugin": None, "jax-cuda13-pjrt": None})
    assert preflight.check(folder, "gpu", None, None)["problems"][0].startswith("MISSING jax CUDA plugin")


def test_gpu_check_stops_at_the_preflight_without_measuring(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(["bash", str(SCRIPTS / "gpu_check.sh")], capture_output=True, text=True, timeout=120,
                          env=offline_env(PYTHON=sys.executable, OUT=str(out), GPU_WHEELS_DIR=str(tmp_path / "none")))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"MISSING wheel folder {tmp_path / 'none'}" in proc.stdout
    assert proc.stdout.rstrip().splitlines()[-1].startswith("gpu_check: STOP after")
    assert not (out / "doctor.json").exists()  # nothing was measured


@pytest.fixture(scope="module")
def env_wheels(tmp_path_factory) -> Path:
    """The wheel folder, filled offline from this environment (the GPU run downloads diffusers)."""
    wheels = tmp_path_factory.mktemp("gpu-wheels") / "wheels"
    fill = subprocess.run(["bash", str(SCRIPTS / "gpu_wheels.sh")], capture_output=True, text=True, timeout=300,
                          env=offline_env(PYTHON=sys.executable, GPU_WHEELS_FROM_ENV="1", GPU_WHEELS_DIR=str(wheels),
                                          GPU_TARGETS="0"))  # (the targets: prepared_targets, below)
    assert fill.returncode == 0, fill.stderr[-3000:]
    assert sorted(p.name.split("-")[0] for p in wheels.glob("*.whl")) == ["diffusers", "preheat"]
    return wheels


def test_a_stale_preheat_wheel_is_rebuilt_and_a_step_that_does_not_fit_the_budget_is_skipped(env_wheels, tmp_path):
    wheels = tmp_path / "wheels"
    shutil.copytree(env_wheels, wheels)
    (old,) = wheels.glob("preheat-*.whl")
    with zipfile.ZipFile(env_wheels / old.name) as zin, zipfile.ZipFile(old, "w") as zout:
        for info in zin.infolist():  # a wheel built before the last change to the tree
            data = zin.read(info.filename)
            zout.writestr(info, data + b"# older\n" if info.filename == "preheat/engine.py" else data)
    out = tmp_path / "out"
    proc = subprocess.run(["bash", str(SCRIPTS / "gpu_check.sh")], capture_output=True, text=True, timeout=300,
                          env=offline_env(PYTHON=sys.executable, OUT=str(out), GPU_WHEELS_DIR=str(wheels),
                                          GPU_CHECK_DRY="1", GPU_CHECK_BUDGET_S="1", TMPDIR=str(tmp_path),
                                          GPU_TARGETS_DIR=str(tmp_path / "no-targets")))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "STALE preheat wheel: 1 file(s) differ from src/preheat (first: engine.py)" in proc.stdout
    pre = json.loads((out / "preflight.json").read_text())
    assert pre["preheat_wheel_rebuilt_from_tree"] and pre["problems"] == []
    table = (out / "summary.md").read_text()
    assert "| doctor | – | skipped (budget) |" in table
    assert (f"| executables compiled on the CPU for h200 | – | skipped: no prepared entries in "
            f"{tmp_path / 'no-targets'}: run `python scripts/gpu_measure.py prepare`") in table
    for title in ("SDXL (tiny) 32², 2 steps, CFG 5", "FLUX.1 (tiny) 32², 2 steps",
                  "FLUX.1 Kontext (tiny) 32² (32² reference), 2 steps"):  # rows 3-5, each named with its reason
        assert f"| {title} | – | skipped: budget: needs at least 10 s (random weights + one cold compile" in table
    assert "| scaled-fp8 Linear vs bf16 GEMM | – | skipped: budget: needs at least 5 s, 0 s left |" in table  # row 6
    for model in ("sd15", "sdxl"):  # row 7, each UNet named with its reason, and no decision without them
        assert (f"| fp8 UNet step ({model}): 1x1 convs as GEMMs on fp8 vs convolutions | – | skipped: budget: "
                "needs at least 5 s, 0 s left |") in table
    assert "| fp8 UNet step: decision (docs/gpu.md) | – | undecided: no measurement of sd15, sdxl" in table
    assert ("| XLA serialisation bug (entry from JAX's cache, new process) | – | skipped: budget: needs at least "
            "15 s, 0 s left |") in table  # row 8
    assert "everything | – | skipped (budget) |" in table
    assert "| bench compare --quick (built-in model) | – | skipped: budget |" in table
    assert proc.stdout.rstrip().endswith(table.strip())
    assert not (out / "doctor.json").exists() and json.loads((out / "models.json").read_text())[0]["runs"] == []


@pytest.fixture(scope="module")
def clean_python(tmp_path_factory) -> Path:
    """A venv like the GPU machine's: this environment's packages minus what is carried there."""
    python = clean_venv(tmp_path_factory.mktemp("clean-venv"), exclude=NOT_ON_GPU)
    for module in ("diffusers", "preheat"):  # the GPU machine's situation: carried, not installed
        assert subprocess.run([str(python), "-c", f"import {module}"], capture_output=True,
                              env=offline_env(), timeout=120).returncode != 0
    return python


def _dry_run(python: Path, wheels: Path, tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path / "out"
    proc = subprocess.run(["bash", str(SCRIPTS / "gpu_check.sh")], capture_output=True, text=True, timeout=900,
                          env=offline_env(PYTHON=str(python), OUT=str(out), GPU_WHEELS_DIR=str(wheels),
                                          GPU_CHECK_DRY="1", PREHEAT_HOME=str(tmp_path / "home"),
                                          TMPDIR=str(tmp_path), **env))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    files = sorted(out.iterdir())
    expected = {"doctor.json", "log.txt", "models.json", "preflight.json", "rows.json", "summary.md"}
    if "compare" in env["GPU_CHECK_ROWS"]:
        expected.add("compare.json")  # 7 at most: the device returns at most 8
    assert [f.name for f in files] == sorted(expected)
    assert all(f.stat().st_size < 16 * 2**20 for f in files)
    assert proc.stdout.rstrip().endswith((out / "summary.md").read_text().strip())  # the table comes last
    pre = json.loads((out / "preflight.json").read_text())
    assert pre["executable"] == str(python)  # the clean venv's interpreter, not this environment's
    assert pre["problems"] == [] and set(pre["wheels"]) == {"preheat", "diffusers"}
    assert json.loads((out / "doctor.json").read_text())["summary"]["fail"] == 0
    assert not any(p.name.startswith("preheat-gpu") for p in tmp_path.iterdir())  # work folders removed
    return proc, out


@pytest.fixture(scope="module")
def prepared_targets(tmp_path_factory) -> Path:
    """Row 2's carried folder, as `gpu_measure.py prepare` writes it on a CPU builder (the dry set:
    one program of the built-in model, compiled for XLA's H200 description)."""
    if not any(k.startswith("jax-cuda") for k in _cuda_versions()):
        pytest.skip("needs the test extra's jax-cuda13-plugin (deviceless GPU compiles)")
    out = tmp_path_factory.mktemp("targets") / ".gpu-targets"
    proc = subprocess.run([sys.executable, str(SCRIPTS / "gpu_measure.py"), "prepare", "--mode", "dry", "--out",
                           str(out)], capture_output=True, text=True, timeout=600, env=offline_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def _cuda_versions() -> dict:
    from preheat.cache.targets import cuda_versions

    return cuda_versions()


@pytest.mark.slow
def test_prepare_compiles_the_h200_set_here(prepared_targets):
    info = json.loads((prepared_targets / "prepare.json").read_text())
    assert info["entries"] == 1 and info["targets"] == ["h200"] and info["autotuned"] == [False]
    assert 0 < info["executable_bytes"] <= info["bytes"] < 64 * 2**20  # inside the device's carry
    manifests = list((prepared_targets / "home" / "compile" / "jax").glob("*/manifest.json"))
    fields = json.loads(manifests[0].read_text())["fields"]
    assert fields["platform"] == "gpu" and fields["gpu"]["compute_capability"] == [9, 0]
    text = info["text"]  # the tiny SD 1.x folder beside it: its six programs, none a GPU would refuse
    assert (prepared_targets / text["folder"] / "model_index.json").is_file()
    assert text["entries"] == 6 and text["unrunnable"] == [], text
    assert text["stages"] == ["decode", "denoise", "denoise", "denoise", "encode", "encode_image"]


@pytest.mark.slow
def test_dry_run_of_issue_29_rows_in_a_clean_venv(clean_python, env_wheels, prepared_targets, tmp_path):
    """Rows 2-7 at tiny sizes: every code path the GPU runs, but the hit (a CPU never loads a GPU
    entry: the row must say so) and torch.compile (torch eager stands in: same children)."""
    proc, out = _dry_run(clean_python, env_wheels, tmp_path, GPU_TARGETS_DIR=str(prepared_targets),
                         GPU_CHECK_ROWS="doctor,target,sdxl,flux,kontext,fp8,fp8unet")
    rows = json.loads((out / "rows.json").read_text())
    assert sorted(rows) == ["flux", "fp8", "fp8unet", "kontext", "sdxl", "target"]
    t = rows["target"]
    assert t["skipped"] == [] and t["prepared"]["targets"] == ["h200"]
    assert t["carried"]["layer"] == "none"  # a CPU process never picks the GPU entry ...
    assert "differs in" in t["carried"]["cache_events"][-1]["miss"]  # ... and names why
    assert t["device_compile"]["layer"] == "none"
    assert t["pixels_vs_device_compile"]["identical"]  # the same program compiled twice here
    assert all(x["images_per_s"] > 0 and x["first_call_layer"] == "aot" for x in t["images_per_s"].values())
    text = t["text"]  # the text model's three stages: the same miss here, the same pixels
    assert text["carried"]["layer"] == "none" and text["device_compile"]["layer"] == "none", text
    assert {e.get("stage") for e in text["carried"]["cache_events"]} >= {"encode", "denoise", "decode"}
    assert text["pixels_vs_device_compile"]["identical"]
    assert t["retune"]["error"] is None and len(t["retune"]["signatures"]) == 1
    assert {e["target"] for e in t["retune"]["entries"]} == {"h200", "local"}
    assert all(e["retune"] is None for e in t["retune"]["entries"])  # nothing autotunes on a CPU
    for name in ("sdxl", "flux", "kontext"):
        row = rows[name]
        assert "error" not in row and "skipped" not in row, row
        assert set(row["paths"]) == {"jax", "torch-eager"}
        assert all(p["s_per_image"] > 0 and not p["errors"] and p["empty_start_s"] > 0 and p["warm_start_s"] > 0
                   for p in row["paths"].values())
        assert row["settings"]["dtype"] == "bfloat16" and row["params"] > 0
        assert row["torch_over_jax_s_per_image"] > 0
    for name in ("sdxl", "flux"):
        flops = rows[name]["flops"]
        assert flops["matrix_flops_per_image"] > 0 and 0 < flops["jax_matrix_fraction_of_peak"]
    assert rows["sdxl"]["flops"]["guided"] and rows["sdxl"]["settings"]["guidance"] == 5.0
    fp8 = rows["fp8"]  # row 6, on the CPU at 256 wide: XLA:CPU leaves the convert a kernel of its own
    assert "error" not in fp8 and fp8["platform"] == "cpu" and (fp8["n"], fp8["tokens"]) == (256, 64)
    assert fp8["fp8"]["one_gemm_on_fp8"] is False and any(k["gemm"] for k in fp8["fp8"]["kernels"])
    assert any(k["reads_fp8"] == "f8e4m3fn[256,256]" for k in fp8["fp8"]["kernels"])
    assert fp8["fp8"]["ms_per_call"] > 0 and fp8["bf16"]["ms_per_call"] > 0 and 0 < fp8["mean_abs_delta"] < 0.02
    table = (out / "summary.md").read_text()
    assert "MISS (expected: a CPU never loads a GPU entry)" in table
    assert "| tiny SD 1.x folder compiled on the CPU for h200 (6 entries: " in table
    (load,) = [line for line in table.splitlines() if line.startswith("| tiny SD 1.x") and "): load |" in line]
    assert "unrunnable: none" in load and "MISS (expected: a CPU never loads a GPU entry); layers encode " in load
    assert "| scaled-fp8 Linear 256² × 64 tokens vs bf16 GEMM (cpu) |" in table
    assert "one GEMM on the fp8 weight: NO (" in table
    assert table.index("FLUX.1 Kontext (tiny)") < table.index("scaled-fp8 Linear")  # after the important rows
    unets = rows["fp8unet"]  # row 7: both tiny UNets, the three ways each, end to end on the CPU
    assert "error" not in unets and "skipped" not in unets, unets
    for model in ("sd15", "sdxl"):
        u = unets[model]
        assert u["platform"] == "cpu" and u["size"] == "tiny" and u["fp8_params"] > 0.9 * u["params"]
        ways = u["ways"]
        assert all(ways[w]["ms_per_step"]["n"] == 3 and ways[w]["ms_per_step"]["median"] > 0 for w in ways)
        # the switch is real: PREHEAT_FP8_1X1=conv traces one convolution more per fp8 1x1 conv
        assert ways["conv"]["traced_convs"] - ways["gemm"]["traced_convs"] == u["fp8_pointwise_convs"] > 0
        assert ways["bf16"]["traced_convs"] == ways["conv"]["traced_convs"]
        assert u["verdict"] in ("faster", "slower", "within noise") and len(u["gemm_over_conv"]) == 3
        agree = u["agreement"]  # the same weights: XLA:CPU computes the three alike, ~bf16's distance from float32
        assert agree["ok"] and agree["finite"] and agree["mean_abs_reference"] > 0
        err = agree["error_vs_float32"]
        assert 0 < err["bf16"]["mean"] < 0.3 and err["gemm"]["mean"] <= agree["bound"], err  # CFG 7.5 amplifies bf16
    assert unets["sd15"]["fp8_pointwise_convs"] > unets["sdxl"]["fp8_pointwise_convs"]  # SDXL's projections are Linear
    assert unets["decision"].startswith(("keep: ", "revert: "))
    assert table.index("scaled-fp8 Linear") < table.index("fp8 UNet step: SD 1.5 UNet (tiny) 64², batch 1 + CFG")
    assert table.index("fp8 UNet step: SDXL UNet (tiny)") < table.index("fp8 UNet step: decision (docs/gpu.md)")
    assert "rows: doctor, target, sdxl, flux, kontext, fp8, fp8unet" in table


@pytest.mark.slow
def test_dry_run_in_a_clean_venv_without_network(clean_python, env_wheels, tmp_path):
    proc, out = _dry_run(clean_python, env_wheels, tmp_path, GPU_CHECK_ROWS="doctor,models,compare,scaling")
    pre = json.loads((out / "preflight.json").read_text())
    assert {"numpy", "torch", "jax", "huggingface-hub"} <= set(pre["requirements"])
    (model,) = json.loads((out / "models.json").read_text())
    assert {name: row["layers"] for name, row in model["rows"].items()} == {
        "empty": ["none"], "full warm": ["aot"], "xla only": ["xla"]}
    assert model["executable_roundtrip"]["layer"] == "aot"
    assert model["executable_roundtrip"]["pixels_vs_compiled_run"]["identical"]  # same program, same bits
    steady = model["steady"]
    assert steady["first_call_layer"] == "aot" and steady["images_per_s"] > 0
    assert steady["matrix_flops_per_call"] > 0 and 0 < steady["matrix_fraction_of_peak"]
    scaling = model["scaling"]["devices"]  # the dry run forces two CPU devices: the step's code runs
    assert sorted(scaling) == ["1", "2"] and scaling["1"]["efficiency"] == 1.0
    assert all(x["images_per_s"] > 0 for x in scaling.values())
    compare = json.loads((out / "compare.json").read_text())
    assert set(compare["paths"]) == {"jax", "torch-eager"}  # torch-eager needs the carried diffusers
    assert all(not p["errors"] and p["steady"] for p in compare["paths"].values())


@pytest.mark.slow
def test_dry_xlaser_row_sees_the_cpu_bug_with_the_guard_off_and_not_with_it_on(tmp_path):
    """Row 8 on the CPU, where XLA's serialisation bug is known, so the dry row is a real check that
    the row detects it: guard off, the entry JAX's cache served is stored and fails its first run
    in the third process (decision: keep "cpu"); guard on, the miss compiles fresh and its entry
    runs. Straight through gpu_measure.py in this environment (the row is what is new; the
    preflight, install and clean venv around it are the two dry runs above)."""
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(SCRIPTS / "gpu_measure.py"), "run", "--out", str(out), "--mode", "dry",
                           "--budget", "900"], capture_output=True, text=True, timeout=960,
                          env=offline_env(GPU_CHECK_ROWS="xlaser", JAX_PLATFORMS="cpu", CUDA_VISIBLE_DEVICES="",
                                          PYTHONPATH=str(ROOT / "src"), TMPDIR=str(tmp_path)))
    assert proc.returncode == 1, proc.stdout + proc.stderr  # 1: doctor was not selected
    row = json.loads((out / "rows.json").read_text())["xlaser"]
    assert "error" not in row and "skipped" not in row and row["platform"] == "cpu", row
    off, on = row["off"], row["on"]
    assert off["fill"]["layer"] == "none"
    assert [(e["layer"], e["store"]) for e in off["miss"]["cache_events"]] == [("xla", "written")]
    (bad,) = [e["quarantined"] for e in off["hit"]["cache_events"] if "quarantined" in e]
    assert bad.startswith("failed on its first run: NOT_FOUND: Function ") and "_fusion not found" in bad
    assert off["hit"]["cache_events"][0]["layer"] == "aot"  # it loaded; its first run failed
    assert [(e["layer"], e["store"]) for e in on["miss"]["cache_events"]] == [("none", "written")]
    assert [e["layer"] for e in on["hit"]["cache_events"]] == ["aot"]
    assert on["hit"]["pixels_vs_fill"]["identical"] and off["hit"]["pixels_vs_fill"]["identical"]
    assert row["verdict"] == f"keep 'cpu' out of XLA_SERIALISE_SAFE_PLATFORMS: the bug is there: {bad}"
    table = (out / "summary.md").read_text()
    assert "| XLA serialisation bug (entry from JAX's cache, new process), cpu: guard off | – | fill none " in table
    assert "hit aot → xla " in table and "QUARANTINED: failed on its first run: NOT_FOUND" in table
    assert ("| XLA serialisation bug (entry from JAX's cache, new process): decision (docs/gpu.md) | – | "
            "keep 'cpu' ") in table
