"""hf:// pulls only what the pipeline needs: against a stand-in Hub on 127.0.0.1 serving a
repository laid out like the published SD 1.5 one (two variants and non-EMA weights, ``.bin``
copies of everything, top-level single-file checkpoints and their ``.ckpt`` twins)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from preheat.errors import InvalidArgumentError, ModelFormatError, ModelNotFoundError
from preheat.store import parse_source, plan_pull, pull, source_id
from preheat.store._hf import RepoFile, select
from tests._support.store_fixtures import files_of
from tests._support.hub_server import FakeHub, pointed_at

REPO = "sd-legacy/stable-diffusion-v1-5"
INDEX = {"_class_name": "StableDiffusionPipeline", "_diffusers_version": "0.6.0",
         "feature_extractor": ["transformers", "CLIPImageProcessor"],
         "safety_checker": ["stable_diffusion", "StableDiffusionSafetyChecker"],
         "scheduler": ["diffusers", "PNDMScheduler"], "text_encoder": ["transformers", "CLIPTextModel"],
         "tokenizer": ["transformers", "CLIPTokenizer"], "unet": ["diffusers", "UNet2DConditionModel"],
         "vae": ["diffusers", "AutoencoderKL"], "image_encoder": [None, None]}
# component -> (safetensors stem, .bin stem), as published
WEIGHTS = {"safety_checker": ("model", "pytorch_model"), "text_encoder": ("model", "pytorch_model"),
           "unet": ("diffusion_pytorch_model",) * 2, "vae": ("diffusion_pytorch_model",) * 2}


def _sd15_files() -> dict[str, bytes]:
    """The published SD 1.5 layout, with small random bodies of distinct sizes."""
    rng = np.random.default_rng(0)
    names = ["README.md", ".gitattributes", "v1-inference.yaml", "v1-5-pruned.ckpt", "v1-5-pruned.safetensors",
             "v1-5-pruned-emaonly.ckpt", "v1-5-pruned-emaonly.safetensors", "feature_extractor/preprocessor_config.json",
             "scheduler/scheduler_config.json", "tokenizer/merges.txt", "tokenizer/special_tokens_map.json",
             "tokenizer/tokenizer_config.json", "tokenizer/vocab.json", "image_encoder/config.json"]
    for comp, (st, pt) in WEIGHTS.items():
        names += [f"{comp}/config.json", f"{comp}/{st}.safetensors", f"{comp}/{st}.fp16.safetensors",
                  f"{comp}/{pt}.bin", f"{comp}/{pt}.fp16.bin"]
    names += ["unet/diffusion_pytorch_model.non_ema.safetensors", "unet/diffusion_pytorch_model.non_ema.bin"]
    files = {n: rng.bytes(1000 + 37 * i) for i, n in enumerate(sorted(names))}
    files["model_index.json"] = json.dumps(INDEX).encode()
    return files


FILES = _sd15_files()
CONFIGS = sorted(n for n in FILES if n.split("/")[0] in WEIGHTS or n.startswith(("scheduler/", "tokenizer/",
                                                                                   "feature_extractor/"))
                 if n.endswith((".json", ".txt"))) + ["model_index.json"]
DEFAULT = sorted(CONFIGS + ["safety_checker/model.safetensors", "text_encoder/model.safetensors",
                            "unet/diffusion_pytorch_model.safetensors", "vae/diffusion_pytorch_model.safetensors"])
FP16 = sorted(CONFIGS + [n.replace(".safetensors", ".fp16.safetensors") for n in DEFAULT if n.endswith(".safetensors")])


@pytest.fixture
def hub(monkeypatch):
    srv = FakeHub(REPO, FILES).start()
    pointed_at(monkeypatch, srv.base)
    try:
        yield srv
    finally:
        srv.stop()


def test_default_pull_fetches_only_the_pipeline(root, hub):
    snap = pull(f"hf://{REPO}", root=root, progress=False)
    got = hub.downloaded()
    # model_index.json is read first; nothing from image_encoder (null in the index), no .bin, no
    # ckpt, no top-level single files, no fp16 or non_ema weights.
    assert sorted(got) == DEFAULT
    assert got == {n: len(FILES[n]) for n in DEFAULT}  # every byte fetched is a byte kept
    assert files_of(snap) == {n: FILES[n] for n in DEFAULT}
    ref = json.loads((root / "models" / "refs" / source_id(f"hf://{REPO}")).read_text())
    assert ref["commit"] == hub.commit and ref["kind"] == "hf" and "variant" not in ref

    hub.hits.clear()
    assert pull(f"hf://{REPO}", root=root, progress=False) == snap and hub.hits == []  # stored: no request


def test_fp16_variant_is_another_pull_of_other_files(root, hub):
    default = pull(f"hf://{REPO}", root=root, progress=False)
    hub.hits.clear()
    snap = pull(f"hf://{REPO}", root=root, progress=False, variant="fp16")
    assert snap != default
    assert sorted(files_of(snap)) == FP16
    # the configs are in huggingface_hub's cache already: only the fp16 weights' bodies are sent
    assert sorted(hub.downloaded()) == sorted(n for n in FP16 if n.endswith(".fp16.safetensors"))
    sid = parse_source(f"hf://{REPO}", variant="fp16").id
    assert sid != source_id(f"hf://{REPO}")
    ref = json.loads((root / "models" / "refs" / sid).read_text())
    assert ref["variant"] == "fp16" and ref["source"] == f"hf://{REPO}#variant=fp16"


def test_missing_variant_is_one_line_and_fetches_no_weights(root, hub):
    with pytest.raises(ModelFormatError) as err:
        pull(f"hf://{REPO}", root=root, progress=False, variant="bf16")
    msg = str(err.value)
    assert "\n" not in msg and "'bf16'" in msg and "fp16" in msg and "non_ema" in msg
    assert [n for n in hub.downloaded() if n.endswith(".safetensors")] == []
    assert os.listdir(root / "models" / "refs") == []


def test_one_file(root, hub):
    name = "unet/diffusion_pytorch_model.fp16.safetensors"
    snap = pull(f"hf://{REPO}/{name}", root=root, progress=False)
    assert hub.downloaded() == {name: len(FILES[name])}
    assert files_of(snap) == {name: FILES[name]}
    with pytest.raises(ModelNotFoundError, match="no file unet/nope.safetensors"):
        pull(f"hf://{REPO}/unet/nope.safetensors", root=root, progress=False)


def test_plan_lists_files_and_bytes_without_downloading(root, hub):
    plan = plan_pull(f"hf://{REPO}", root=root, variant="fp16")
    assert [f.path for f in plan.files] == FP16
    assert plan.bytes == sum(len(FILES[n]) for n in FP16)
    assert plan.repo_bytes == sum(map(len, FILES.values())) and len(plan.repo_files) == len(FILES)
    # only model_index.json's body was sent (it is read to choose the folders)
    assert hub.downloaded() == {"model_index.json": len(FILES["model_index.json"])}


def test_cli_dry_run_through_hf_endpoint(root, hub, monkeypatch):
    """`preheat pull --dry-run` in this process (click's CliRunner), the stand-in Hub named the way
    the other tests here name it (``pointed_at``). HF_ENDPOINT and HF_HUB_OFFLINE read by a fresh
    process at its start: tests/store/test_store_local_hf.py's CLI test."""
    from click.testing import CliRunner

    from preheat.cli.pull import pull_command

    monkeypatch.setenv("PREHEAT_HOME", str(root))
    out = CliRunner().invoke(pull_command, [f"hf://{REPO}", "--dry-run", "--variant", "fp16"])
    assert out.exit_code == 0, out.output
    lines = out.stdout.splitlines()
    listed = {ln.split()[1]: int(ln.split()[0].replace(",", "")) for ln in lines[:-1]}
    assert listed == {n: len(FILES[n]) for n in FP16}
    total = sum(len(FILES[n]) for n in FP16)
    assert lines[-1].split()[0] == f"{total:,d}" and f"{len(FP16)} files" in lines[-1]
    assert [n for n in hub.downloaded() if n.endswith(".safetensors")] == []
    assert not (root / "models" / "refs").exists() or os.listdir(root / "models" / "refs") == []

    bad = CliRunner().invoke(pull_command, [f"hf://{REPO}", "--dry-run", "--variant", "bf16"])
    assert bad.exit_code == 1 and bad.stderr.startswith("error: ") and bad.stderr.count("\n") == 1, bad.output


def test_select_rules():
    """Shards of one variant, a component lacking the variant, and a repo without model_index.json."""
    idx = {"_class_name": "FluxPipeline", "transformer": ["diffusers", "FluxTransformer2DModel"],
           "vae": ["diffusers", "AutoencoderKL"]}
    listing = tuple(RepoFile(p, 10) for p in sorted([
        "model_index.json", "flux1-dev.safetensors", "ae.safetensors", "transformer/config.json",
        "transformer/diffusion_pytorch_model-00001-of-00002.safetensors",
        "transformer/diffusion_pytorch_model-00002-of-00002.safetensors",
        "transformer/diffusion_pytorch_model.safetensors.index.json",
        "transformer/diffusion_pytorch_model.bf16-00001-of-00001.safetensors",
        "vae/config.json", "vae/diffusion_pytorch_model.safetensors"]))
    src = parse_source("hf://o/r")
    assert [f.path for f in select(src, listing, idx)] == [
        "model_index.json", "transformer/config.json",
        "transformer/diffusion_pytorch_model-00001-of-00002.safetensors",
        "transformer/diffusion_pytorch_model-00002-of-00002.safetensors",
        "transformer/diffusion_pytorch_model.safetensors.index.json",
        "vae/config.json", "vae/diffusion_pytorch_model.safetensors"]
    with pytest.raises(ModelFormatError, match=r"not every component has 'bf16' weights \(vae has only default\)"):
        select(parse_source("hf://o/r", variant="bf16"), listing, idx)
    lora = (RepoFile("README.md", 1), RepoFile("pytorch_lora_weights.safetensors", 5), RepoFile("x.bin", 9))
    assert [f.path for f in select(src, lora, None)] == ["README.md", "pytorch_lora_weights.safetensors"]


def test_components_pull_only_those_folders(root, hub):
    """What a single file lacks (``components=``): those folders' configs, tokenizer files and
    default weights; no model_index.json, no other folder; another pull than the whole pipeline's."""
    snap = pull(f"hf://{REPO}", root=root, progress=False, components=["tokenizer", "text_encoder"])
    wanted = sorted(n for n in DEFAULT if n.startswith(("tokenizer/", "text_encoder/")))
    assert sorted(hub.downloaded()) == wanted and sorted(files_of(snap)) == wanted
    src = parse_source(f"hf://{REPO}", components=["tokenizer", "text_encoder"])
    assert src.key == f"hf://{REPO}#components=text_encoder,tokenizer" and src.id != source_id(f"hf://{REPO}")
    assert parse_source(f"hf://{REPO}", variant="fp16", components=["vae"]).key == f"hf://{REPO}#variant=fp16&components=vae"
    ref = json.loads((root / "models" / "refs" / src.id).read_text())
    assert ref["components"] == ["text_encoder", "tokenizer"]

    plan = plan_pull(f"hf://{REPO}", root=root, components=["tokenizer"], variant="fp16")
    assert [f.path for f in plan.files] == [n for n in FP16 if n.startswith("tokenizer/")]
    with pytest.raises(ModelNotFoundError, match=r"stable-diffusion-v1-5 has no tokenizer_2/ folder$"):
        plan_pull(f"hf://{REPO}", root=root, components=["tokenizer_2", "tokenizer"])
    with pytest.raises(InvalidArgumentError, match="components of .*: '../x' is not a component folder name"):
        parse_source(f"hf://{REPO}", components=["../x"])
    with pytest.raises(InvalidArgumentError, match="components apply only to hf:// pipelines"):
        parse_source("/tmp/folder", components=["tokenizer"])


def test_lora_from_hf_pulls_only_its_file(root, hub, monkeypatch):
    from preheat.lora.files import local_file

    monkeypatch.setenv("PREHEAT_HOME", str(root))
    name = "unet/diffusion_pytorch_model.non_ema.safetensors"  # any one safetensors file of a repository
    path = local_file(f"hf://{REPO}/{name}")
    assert path.read_bytes() == FILES[name] and path.is_relative_to(root)
    assert hub.downloaded() == {name: len(FILES[name])}
