"""The settings' one declaration (``preheat.settings.ServeSettings``): every surface's view of
a setting comes from its field: the click options of ``serve``, ``warm`` and ``sample``, the
``PREHEAT_*`` table and parser Runpod and Ray read, and the serving limits."""

from __future__ import annotations

import click
import pytest

from preheat.cli import main
from preheat.errors import InvalidArgumentError
from preheat.settings import ENV_SETTINGS, LIMITS, SETTINGS, ServeSettings, typed_setting


def _params(name: str) -> dict[str, click.Parameter]:
    command = main.get_command(click.Context(main), name)
    assert command is not None
    return {p.name: p for p in command.params if p.name is not None}


@pytest.mark.parametrize("command, surface", [("serve", "serve"), ("warm", "warm")])
def test_each_command_takes_the_settings_of_its_surface_as_declared(command, surface):
    params = _params(command)
    declared = [name for name, s in SETTINGS.items() if surface in s.surfaces]
    assert [name for name in params if name in SETTINGS] == declared  # all of them, in the declared order
    for name in declared:
        s, param = SETTINGS[name], params[name]
        if isinstance(param, click.Option):
            assert s.option in param.opts and param.help == (s.help or None), name
            if not (s.is_flag or s.multiple):  # (click keeps a flag's absent default as its own sentinel)
                assert param.default == s.default, name


def test_sample_loads_with_the_declared_load_options():
    params = _params("sample")
    assert all(name in params for name, s in SETTINGS.items() if "load" in s.surfaces)


def test_the_environment_table_and_the_limits_come_from_the_fields():
    assert ENV_SETTINGS == tuple(name for name, s in SETTINGS.items() if s.parse is not None)
    assert set(LIMITS) <= set(ENV_SETTINGS)  # every limit can be set from a platform's environment
    assert typed_setting("sizes", "512x512,768x512", "PREHEAT_SIZES") == ((512, 512), (768, 512))
    assert typed_setting("retune_idle_s", "off") is None and typed_setting("max_queue", "5") == 5
    with pytest.raises(InvalidArgumentError, match="^PREHEAT_MAX_QUEUE 'x' must be an int$"):
        typed_setting("max_queue", "x", "PREHEAT_MAX_QUEUE")


def test_the_object_gives_the_warm_set_and_refuses_in_one_line_naming_the_setting():
    assert ServeSettings(sizes="64x32", fsdp=2).warm_set().sizes == ((64, 32),)
    with pytest.raises(InvalidArgumentError, match="^PREHEAT_GUIDANCE 'maybe' must be off, on or off,on$"):
        ServeSettings(guidance="maybe").warm_set(lambda s: "PREHEAT_" + s.upper())
    with pytest.raises(InvalidArgumentError, match="^--header-timeout-s 0.0 must be > 0$"):
        ServeSettings(header_timeout_s=0.0).check_serving()
    from preheat.server.config import fetch_config

    with pytest.raises(InvalidArgumentError, match="^--fetch-per-host "):
        fetch_config(ServeSettings(fetch_per_host=0))


def test_ray_replicas_serve_what_the_command_line_declared():
    pytest.importorskip("ray.serve")
    from preheat.integrations.ray import RayOptions
    from preheat.server.config import CoreConfig
    from preheat.warm import SettingNames

    settings = ServeSettings(max_queue=5, sizes="64x32")
    config = CoreConfig.from_settings(settings, settings.warm_set(), SettingNames())
    options = RayOptions.from_core(config, num_replicas=2)
    assert options.core_config().warm_set() == config.warm_set() and options.core_config().max_queue == 5
    assert set(options.replica_args()) <= set(RayOptions.args())
    replica = RayOptions.from_args(options.replica_args())  # what each replica is constructed from
    assert replica.core_config() == options.core_config()


def test_a_servers_config_takes_every_serving_setting_it_has_a_field_for():
    from preheat.server.config import CoreConfig
    from preheat.warm import SettingNames

    settings = ServeSettings(backend="torch", compile="aot", batch_wait_ms=2.5, max_queue=3, max_steps=9, max_loras=2,
                             push_grace_s=1.0, max_image_pixels=64, retune_idle_s="off")
    config = CoreConfig.from_settings(settings, settings.warm_set(), SettingNames())
    assert (config.backend, config.compile, config.batch_wait_ms, config.max_queue, config.max_steps, config.max_loras,
            config.push_grace_s, config.max_image_pixels, config.retune_idle_s) == (
        "torch", "aot", 2.5, 3, 9, 2, 1.0, 64, None)
