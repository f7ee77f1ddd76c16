"""One warm declaration for `preheat warm` and `preheat serve`: devices included (issue 17)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from preheat.cache.warm import WarmSet
from preheat.cli.warm import warm_set_from_options
from preheat.server.core import CoreConfig


@pytest.mark.parametrize("text, devices", [(None, None), ("all", "all"), ("2", 2), ("0,3", [0, 3])])
def test_devices_are_part_of_the_declaration(text, devices):
    warm_set = warm_set_from_options(None, "float32", 4, None, None, "off,on", text)
    assert warm_set.devices == devices
    config = CoreConfig.from_warm_set(warm_set, batch_wait_ms=5.0)
    assert config.devices == devices and config.warm_set() == warm_set  # the server warms what warm compiled


def test_bad_devices_fail_in_one_line_on_both_commands():
    from preheat.cli import main

    for command in ("warm", "serve"):
        result = CliRunner().invoke(main, [command, "--devices", "two", "--dry-run"] if command == "warm"
                                    else [command, "--devices", "two"])
        assert result.exit_code != 0 and "--devices 'two'" in result.output, result.output


def test_a_server_may_still_choose_its_own_devices():
    config = CoreConfig.from_warm_set(WarmSet(devices=2), devices=1)
    assert config.devices == 1
