"""One warm declaration for `preheat warm` and `preheat serve`: devices and fsdp included (issue 17)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from preheat.warm import WarmSet
from preheat.cli.warm import warm_set_from_options
from preheat.server.core import CoreConfig


@pytest.mark.parametrize("text, devices", [(None, None), ("all", "all"), ("2", 2), ("0,3", [0, 3])])
def test_devices_are_part_of_the_declaration(text, devices):
    warm_set = warm_set_from_options(None, "float32", 4, None, None, "off,on", None, text, 2)
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
