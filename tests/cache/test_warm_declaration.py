"""One warm declaration for `preheat warm` and `preheat serve`: devices and fsdp included (issue 17)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from preheat.cache.executables import Executables
from preheat.warm import WarmSet
from preheat.settings import ServeSettings
from preheat.server.core import CoreConfig


@pytest.mark.parametrize("text, devices", [(None, None), ("all", "all"), ("2", 2), ("0,3", [0, 3])])
def test_devices_are_part_of_the_declaration(text, devices):
    warm_set = ServeSettings(max_batch_size=4, devices=text, fsdp=2).warm_set()
    assert warm_set.devices == devices and warm_set.fsdp == 2
    config = CoreConfig.from_warm_set(warm_set, batch_wait_ms=5.0)
    assert config.devices == devices and config.fsdp == 2
    assert config.warm_set() == warm_set  # the server warms what warm compiled


def test_bad_devices_fail_in_one_line_on_both_commands():
    from preheat.cli import main

    for command in ("warm", "serve"):
        result = CliRunner().invoke(main, [command, "--devices", "two", "--dry-run"] if command == "warm"
                                    else [command, "--devices", "two"])
        assert result.exit_code != 0 and "--devices 'two'" in result.output, result.output


def test_a_server_may_still_choose_its_own_devices():
    config = CoreConfig.from_warm_set(WarmSet(devices=2), devices=1)
    assert config.devices == 1


@pytest.fixture(scope="module")
def sd_pipe(tmp_path_factory):
    import preheat
    from tests._support.sd_fixtures import save_tiny_sd

    return preheat.load(save_tiny_sd(tmp_path_factory.mktemp("sd") / "sd1", kind="sd1"))


def test_dry_run_lists_every_program_of_a_text_family_and_compiles_nothing(sd_pipe):
    """The listed keys are the keys a real call then compiles (encoders, denoise, decode). One
    real call of the tiny SD pipeline (three small compiles, ~15 s on 2 shared cores): the only
    independent reference for keys is the compile cache itself."""
    from preheat import warm as warming

    pipe = sd_pipe
    sig = warming.signatures(pipe, warming.resolve(pipe, WarmSet(max_batch_size=1, guidance=("off",))))[0]
    listed = warming.programs(pipe, sig)
    assert [p["stage"] for p in listed] == ["encode", "denoise", "decode"]
    assert not pipe.compiler.events and not any(p["local"] for p in listed)  # nothing compiled, nothing cached
    warming.run_signature(pipe, sig)
    compiled = [(e["stage"], e["key"]) for e in pipe.compiler.events]
    assert compiled == [(p["stage"], p["key"]) for p in listed]
    assert all(p["local"] for p in warming.programs(pipe, sig))


# --inputs: the optional data inputs a set offers (WarmSet.inputs). SD 1.x declares three (a
# negative prompt, of guided programs only; an image; a mask, which needs the image).
OFFERED = [
    (None, [(), ("image", "strength"), ("image", "mask_image", "strength"), (), ("image", "strength"),
            ("image", "mask_image", "strength"), ("negative_prompt",), ("image", "negative_prompt", "strength"),
            ("image", "mask_image", "negative_prompt", "strength")]),
    ((), [(), ()]),
    (("negative_prompt",), [(), (), ("negative_prompt",)]),
    (("image",), [(), ("image", "strength"), (), ("image", "strength")]),
    (("mask_image", "image"), [(), ("image", "strength"), ("image", "mask_image", "strength"), (),
                               ("image", "strength"), ("image", "mask_image", "strength")]),
]


@pytest.mark.parametrize("inputs, variants", OFFERED)
def test_the_offered_inputs_select_the_warmed_variants(sd_pipe, inputs, variants):
    """Unguided programs first, then guided ones (a negative prompt only there); nothing compiles."""
    from preheat import warm as warming

    resolved = warming.resolve(sd_pipe, WarmSet(max_batch_size=1, sizes=((32, 32),), inputs=inputs))
    sigs = warming.signatures(sd_pipe, resolved)
    assert [s.variant for s in sigs] == variants
    guided = [s.guidance != 1.0 for s in sigs]
    assert guided == sorted(guided) and all(g for s, g in zip(sigs, guided) if "negative_prompt" in s.variant)
    everything = warming.signatures(sd_pipe, warming.resolve(sd_pipe, WarmSet(max_batch_size=1, sizes=((32, 32),))))
    assert all(s in everything for s in sigs)  # a subset of the default set, program for program
    assert resolved.inputs == tuple(n for n in ("negative_prompt", "image", "mask_image")
                                    if inputs is None or n in inputs)  # in declaration order


@pytest.mark.parametrize("inputs, message", [
    (("foo",), "--inputs 'foo' is not an optional input of a stable-diffusion model: its optional inputs are "
               "negative_prompt, image, mask_image (or none); prompt always offered"),
    (("strength",), "--inputs 'strength' is not an optional input"),  # it goes with the image
    (("prompt",), "--inputs 'prompt' is not an optional input"),  # always offered
    (("mask_image",), "--inputs mask_image needs image; offer both"),
    (("none", "image"), "--inputs none stands alone: it offers only the required inputs; prompt always offered"),
])
def test_inputs_the_family_does_not_declare_fail_in_one_line(sd_pipe, inputs, message):
    from preheat import warm as warming
    from preheat.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError) as err:
        warming.resolve(sd_pipe, WarmSet(max_batch_size=1, sizes=((32, 32),), inputs=inputs))
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_the_inputs_flag_is_one_declaration_for_warm_and_serve():
    from preheat.families.offer import parse_offered

    assert parse_offered(None) is None and parse_offered("none") == () and parse_offered(" image, mask_image,") == (
        "image", "mask_image")
    warm_set = ServeSettings(max_batch_size=4, inputs="negative_prompt").warm_set()
    assert warm_set.inputs == ("negative_prompt",)
    config = CoreConfig.from_warm_set(warm_set)
    assert config.inputs == ("negative_prompt",) and config.warm_set() == warm_set
    assert CoreConfig().warm_set().inputs is None  # the default: every input the family declares


def test_the_inputs_flag_names_what_the_model_declares_in_one_line():
    """The built-in digits model (a pixel model) has no optional inputs."""
    from preheat.cli import main

    result = CliRunner().invoke(main, ["warm", "--inputs", "image", "--dry-run"])
    assert result.exit_code != 0
    assert result.output.strip().splitlines() == [
        "error: --inputs 'image' is not an optional input of a pixel model: it has no optional inputs (give none, "
        "or leave --inputs out)"], result.output


def test_a_malformed_sizes_flag_is_named_as_the_cli_gives_it():
    """The command line names its flag (Runpod's worker names PREHEAT_SIZES: tests/integrations/test_runpod.py)."""
    from preheat.cli import main

    result = CliRunner().invoke(main, ["warm", "--sizes", "512", "--dry-run"])
    assert result.exit_code != 0
    assert result.output.strip().splitlines() == ["error: --sizes '512' must be WIDTHxHEIGHT, e.g. 512x512"], result.output


def test_dry_run_lists_the_offered_inputs_and_their_programs(sd_pipe, monkeypatch, tmp_path):
    import json

    import preheat
    from preheat.cli import main

    monkeypatch.setattr(preheat, "load", lambda model, **options: sd_pipe)
    result = CliRunner().invoke(main, ["warm", str(tmp_path), "--inputs", "negative_prompt", "--guidance", "on",
                                       "--max-batch-size", "1", "--sizes", "32x32", "--dry-run", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output[result.output.index("{"):])
    assert out["inputs"] == {"required": ["prompt"], "optional": ["negative_prompt"],
                             "not_offered": ["image", "mask_image"]}
    assert [row["signature"] for row in out["signatures"]] == ["ddim batch 1 32x32 guidance 7.5",
                                                                "ddim batch 1 32x32 +negative_prompt guidance 7.5"]
    text = CliRunner().invoke(main, ["warm", str(tmp_path), "--inputs", "negative_prompt", "--guidance", "on",
                                     "--max-batch-size", "1", "--sizes", "32x32", "--dry-run"])
    assert "inputs offered: prompt, negative_prompt (not offered: image, mask_image)" in text.output.splitlines()


def test_cache_explain_takes_the_offered_inputs_as_warm_does(sd_pipe, monkeypatch, tmp_path):
    """`cache explain --inputs`: a declaration offering none (a text-only server or warm job) has no
    image program, so a call with --image is refused naming the --inputs that would offer it; a
    text call is explained as before; a bad --inputs is warm's one line."""
    import dataclasses

    import numpy as np

    import preheat
    from preheat.cache.compile import JaxCompiler
    from preheat.cli import main
    from tests._support.image_files import png

    # the module's pipeline, with a compiler and executables of its own: explain compiles the
    # encoders to reach the denoiser's key, which the dry-run test above must not find done
    pipe = dataclasses.replace(sd_pipe, executables=Executables(), compiler=JaxCompiler(root=tmp_path / "root", remote=None))
    monkeypatch.setattr(preheat, "load", lambda model, **options: pipe)
    image, mask = tmp_path / "grey.png", tmp_path / "mask.png"
    image.write_bytes(png(np.full((32, 32, 3), 128, np.uint8)))
    mask.write_bytes(png(np.full((32, 32), 255, np.uint8)))
    call = ["cache", "explain", str(tmp_path), "--prompt", "a fox", "--width", "32", "--height", "32", "--n", "1"]

    def explain(*args: str):
        return CliRunner().invoke(main, [*call, *args])

    text = explain("--inputs", "none")
    assert text.exit_code == 0 and text.output.startswith("miss: key "), text.output
    assert text.output == explain().output  # the text call is the same program whatever else is offered
    for args, line in [
        (["--inputs", "none", "--image", str(image)],
         "error: --image: --inputs none does not offer image: a server or warm job declared so has no program for "
         "this call (--inputs image offers it)"),
        (["--inputs", "negative_prompt,image", "--image", str(image), "--mask", str(mask)],
         "error: --mask: --inputs negative_prompt,image does not offer mask_image: a server or warm job declared so "
         "has no program for this call (--inputs negative_prompt,image,mask_image offers it)"),
        (["--inputs", "class_label"],  # warm's own line (tests above: the same resolve)
         "error: --inputs 'class_label' is not an optional input of a stable-diffusion model: its optional inputs "
         "are negative_prompt, image, mask_image (or none); prompt always offered"),
        (["--inputs", "mask_image"], "error: --inputs mask_image needs image; offer both"),
    ]:
        result = explain(*args)
        assert result.exit_code == 2 and result.output.strip().splitlines() == [line], result.output
    offered = explain("--inputs", "image", "--image", str(image), "--strength", "0.5")
    assert offered.exit_code == 0 and offered.output.startswith("miss: key "), offered.output
