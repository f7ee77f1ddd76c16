"""``--input-values``: the served values of a model's static inputs besides the size (FLUX.1's and
SD3's ``max_sequence_length``), one declaration for `preheat warm`, `preheat serve`, Runpod and Ray.
Each value is its own programs; the default value's program is the one a set without the
declaration warms. (The server's side, a request's value refused or filled in: tests/server/test_flow_serving.py.)"""

from __future__ import annotations

import pytest
from click.testing import CliRunner

import preheat
from preheat import warm as warming
from preheat.cache.executables import Executables
from preheat.errors import InvalidArgumentError
from preheat.server.config import CoreConfig, typed_setting
from preheat.warm import WarmSet, parse_input_values

LENGTH = "max_sequence_length"


@pytest.fixture(scope="module")
def flux_pipe(tmp_path_factory):
    from tests._support.flow_fixtures import save_tiny_flow_model

    return preheat.load(save_tiny_flow_model(tmp_path_factory.mktemp("values") / "schnell", "flux-schnell"),
                        cache="off")


def _set(**options) -> WarmSet:
    return WarmSet(max_batch_size=1, sizes=((32, 32),), inputs=(), **options)


def test_the_text_form_parses_to_names_and_values():
    assert parse_input_values(None) == () and parse_input_values(" ; ") == ()
    assert parse_input_values(f"{LENGTH}=256, 512,256; other = 1") == ((LENGTH, ("256", "512")), ("other", ("1",)))


@pytest.mark.parametrize("text, message", [
    ("256", f"--input-values '256' must be NAME=VALUE,..., e.g. {LENGTH}=256,512"),
    (f"{LENGTH}=", f"--input-values '{LENGTH}=' must be NAME=VALUE"),
    (f"{LENGTH}=256;{LENGTH}=512", f"--input-values names {LENGTH} twice; list its values once: {LENGTH}=A,B"),
])
def test_a_malformed_text_is_one_line(text, message):
    with pytest.raises(InvalidArgumentError) as err:
        parse_input_values(text)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_each_value_is_its_own_programs_and_the_default_s_is_the_undeclared_set_s(flux_pipe):
    """The texts are typed by the family's declaration (ints); the 512 signature (FluxPipeline's
    default) keys the same program as a set that declares nothing; 256 is another program."""
    resolved = warming.resolve(flux_pipe, _set(input_values=((LENGTH, ("256", "512")),)))
    assert resolved.input_values == ((LENGTH, (256, 512)),)
    sigs = warming.signatures(flux_pipe, resolved)
    assert [s.describe() for s in sigs] == [f"flow_euler batch 1 32x32 +{LENGTH}=256 guidance off",
                                            f"flow_euler batch 1 32x32 +{LENGTH}=512 guidance off"]
    assert [dict(s.given)[LENGTH] for s in sigs] == [256, 512]
    (plain,) = warming.signatures(flux_pipe, warming.resolve(flux_pipe, _set()))
    assert LENGTH not in dict(plain.given)
    keys = [warming.status(flux_pipe, s)["key"] for s in (*sigs, plain)]
    assert keys[1] == keys[2] and keys[0] != keys[1]


@pytest.mark.parametrize("values, message", [
    ((("width", ("64",)),), "--input-values 'width' is not a static input of a flux model (the size is served by "
                            f"--sizes); its static inputs are: {LENGTH}"),
    ((("steps", ("4",)),), f"--input-values 'steps' is not a static input of a flux model; its static inputs are: "
                           f"{LENGTH}"),
    (((LENGTH, ("600",)),), f"--input-values {LENGTH}=600 must be an int in [1, 512]"),
    (((LENGTH, ("long",)),), f"--input-values {LENGTH} 'long' must be an int"),
])
def test_what_the_family_does_not_declare_static_is_one_line(flux_pipe, values, message):
    with pytest.raises(InvalidArgumentError) as err:
        warming.resolve(flux_pipe, _set(input_values=values))
    assert str(err.value) == message


def test_one_declaration_for_warm_serve_runpod_and_ray():
    """The flag, PREHEAT_INPUT_VALUES and Ray's typed args all give the same WarmSet field, and a
    server's config warms what `preheat warm` compiled."""
    from preheat.settings import ServeSettings

    warm_set = ServeSettings(max_batch_size=4, input_values=f"{LENGTH}=256,512").warm_set()
    assert warm_set.input_values == ((LENGTH, ("256", "512")),)
    config = CoreConfig.from_warm_set(warm_set)
    assert config.input_values == warm_set.input_values and config.warm_set() == warm_set
    assert typed_setting("input_values", f"{LENGTH}=256,512", "PREHEAT_INPUT_VALUES") == warm_set.input_values
    assert typed_setting("input_values", {LENGTH: [256, 512]}) == ((LENGTH, (256, 512)),)
    assert WarmSet(input_values={LENGTH: (256, 512, 256)}).input_values == ((LENGTH, (256, 512)),)
    assert WarmSet(input_values=f"{LENGTH}=256").input_values == ((LENGTH, ("256",)),)
    with pytest.raises(InvalidArgumentError, match="^PREHEAT_INPUT_VALUES '256' must be NAME=VALUE"):
        typed_setting("input_values", "256", "PREHEAT_INPUT_VALUES")


def test_a_model_without_static_inputs_says_so_as_the_user_named_it(monkeypatch):
    """The built-in model (a pixel model) has none; the line names the variable when it came from there."""
    from preheat.cli import main

    monkeypatch.setenv("PREHEAT_INPUT_VALUES", f"{LENGTH}=256")
    result = CliRunner().invoke(main, ["warm", "--dry-run"])
    assert result.exit_code != 0
    assert result.output.strip().splitlines() == [
        f"error: PREHEAT_INPUT_VALUES '{LENGTH}' is not a static input of a pixel model; it has none besides "
        "the size"], result.output


def test_cache_explain_as_server_takes_the_served_values_as_the_server_does(flux_pipe, monkeypatch, tmp_path):
    """`cache explain --as-server --input-values` (and --sizes, --samplers): a call without
    --max-sequence-length (or a size, a sampler) gets what the server gives it, so its key is the key
    `warm --dry-run` lists for that signature (the default's without the declaration); a length
    (size, sampler) not served is the server's one-line refusal."""
    import dataclasses
    import json

    from preheat.cache.compile import JaxCompiler
    from preheat.cli import main

    pipe = dataclasses.replace(flux_pipe, executables=Executables(), compiler=JaxCompiler(root=tmp_path / "root", remote=None))
    monkeypatch.setattr(preheat, "load", lambda model, **options: pipe)
    declared = ["--input-values", f"{LENGTH}=256"]
    dry = CliRunner().invoke(main, ["warm", str(tmp_path), "--max-batch-size", "1", "--inputs", "none", *declared,
                                    "--dry-run", "--json"])
    assert dry.exit_code == 0, dry.output
    (row,) = json.loads(dry.output[dry.output.index("{"):])["signatures"]
    assert row["signature"].endswith(f"+{LENGTH}=256 guidance off")
    call = ["cache", "explain", str(tmp_path), "--prompt", "a fox", "--n", "1", "--as-server"]

    def key(*args: str) -> str:
        result = CliRunner().invoke(main, [*call, *args])
        assert result.exit_code == 0, result.output
        return result.output.splitlines()[-1].split("key ")[1][:12]

    assert key(*declared) == row["key"][:12] == key(*declared, "--max-sequence-length", "256")
    assert key() != row["key"][:12]  # a server declaring nothing serves 512
    refused = CliRunner().invoke(main, [*call, *declared, "--max-sequence-length", "512"])
    assert refused.exit_code != 0 and refused.output.strip().splitlines()[-1] == (
        f"error: --max-sequence-length 512 is not served here (another program); served: 256 (start the server "
        f"with --input-values {LENGTH}=256,512, or PREHEAT_INPUT_VALUES={LENGTH}=256,512, to serve it)")
    # --sizes: a call without a size is the server's first size (the key of warm's row at the native size
    # only where that is first), and a size the server does not serve is its one-line refusal
    native = "{}x{}".format(*pipe.family.native_size(pipe))
    assert key(*declared, "--sizes", f"{native},64x64") == row["key"][:12]
    small_first = key(*declared, "--sizes", f"64x64,{native}")
    assert small_first != row["key"][:12]
    assert small_first == key(*declared, "--sizes", f"{native},64x64", "--width", "64", "--height", "64")
    refused = CliRunner().invoke(main, [*call, *declared, "--width", "64", "--height", "64"])
    assert refused.exit_code != 0 and refused.output.strip().splitlines()[-1] == (
        f"error: --width: 64x64 is not served here; sizes: {native} (the server's --sizes)")
    # --samplers: a sampler the server does not serve is its refusal (FLUX.1 takes flow_euler alone, so the
    # default's choice among several is test_a_call_s_sampler_is_served_as_the_server_serves_it's)
    own = pipe.defaults["sampler"]
    assert key(*declared, "--samplers", own) == row["key"][:12]
    refused = CliRunner().invoke(main, [*call, *declared, "--sampler", "flow_heun"])
    assert refused.exit_code != 0 and refused.output.strip().splitlines()[-1] == (
        f"error: --sampler 'flow_heun' is not served here; choose one of {own} (the server's --samplers)")
    for server_only in (declared, ["--sizes", native], ["--samplers", own]):
        alone = CliRunner().invoke(main, ["cache", "explain", str(tmp_path), "--prompt", "a fox", *server_only])
        assert alone.output.strip().splitlines()[-1] == ("error: --max-batch-size, --progress, --samplers, "
                                                          "--sizes and --input-values describe a server's call: "
                                                          "pass --as-server")


def test_a_call_s_sampler_is_served_as_the_server_serves_it():
    """``families.offer.served_sampler``, the server's and `cache explain --as-server`'s one rule: a
    call naming none gets the model's own where served, else the first served; () serves every one."""
    from preheat.families.offer import served_sampler

    assert served_sampler(None, "dpmpp_2m", ("euler", "dpmpp_2m")) == ("dpmpp_2m", "")
    assert served_sampler(None, "dpmpp_2m", ("euler", "ddim")) == ("euler", "")
    assert served_sampler("ddim", "dpmpp_2m", ()) == ("ddim", "")
    assert served_sampler("ddim", "dpmpp_2m", ("euler",)) == (
        "ddim", "'ddim' is not served here; choose one of euler")
