"""The click side of the settings' declaration (``preheat.settings.ServeSettings``): each
setting's option, generated from its field (:func:`setting_option`, :func:`settings_options`:
the options of ``serve``, of ``warm`` and the load options of ``sample``), and the environment.

`preheat serve` and `preheat warm` read a deployment's settings from the environment, as
Runpod's worker and Ray's replicas do: one table (``preheat.settings.ENV_SETTINGS``), each
setting as ``PREHEAT_<SETTING>`` (``env_var``), so that a pod template's ``PREHEAT_SIZES`` means
the same to every surface, and a warm job run in the server's environment warms what it serves.

A command built with ``cls=SettingsCommand`` gives each of its parameters that is named after a
setting (MODEL for ``model``, ``--max-batch-size`` for ``max_batch_size``: :func:`flag_of`) the
setting's variable as click's ``envvar``: a flag on the command line wins, the variable stands in
when the flag is absent, and ``--help`` shows it. Which parameters read a variable is derived from
the table, never listed here. A value is parsed as its flag's would be; an error names what the
user wrote: the variable (``PREHEAT_SIZES '512': ...``) when the value came from it, else the flag
(:func:`names_of`, for the command's own checks and set-up messages). A command may read fewer
settings (``env_settings``) and only when a flag is given (``env_gate``): `cache explain` reads a
server's declaration only with ``--as-server``.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import click
from click.core import ParameterSource

from preheat.settings import ENV_SETTINGS, SETTINGS, ServeSettings, env_var, flag_of

__all__ = ["SettingsCommand", "flag_of", "setting_of", "names_of", "setting_option", "settings_options",
           "settings_given"]

Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]


def setting_option(name: str, param: Optional[str] = None) -> Decorator:
    """The click option (MODEL: the argument) of setting ``name``, from its declaration: flag,
    type and range, default, help; ``param``: the command's parameter, where not ``name``."""
    s = SETTINGS[name]
    if s.argument:
        return click.argument(param or name, required=False)
    decls = [s.option if s.negation is None else f"{s.option}/{s.negation}", param or name]
    if s.is_flag:
        return click.option(*decls, is_flag=True, help=s.help or None)
    if s.negation is not None:  # --x/--no-x, absent: None
        return click.option(*decls, default=s.default, help=s.help or None)
    if s.multiple:
        return click.option(*decls, multiple=True, metavar=s.metavar, help=s.help or None)
    kind: Any = s.type
    if s.choices:
        kind = click.Choice(s.choices)
    elif s.bounds is not None:
        kind = click.IntRange(*s.bounds)
    elif s.folder:
        kind = click.Path(file_okay=False, exists=True)
    return click.option(*decls, default=s.default, show_default=s.default is not None, type=kind,
                        metavar=s.metavar, help=s.help or None)


def settings_options(surface: str) -> Decorator:
    """Every setting whose ``surfaces`` hold ``surface`` (``load``, ``warm``, ``serve``), as options
    in their declared order; the command receives them as keywords (:func:`settings_given`)."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        for name in reversed([name for name, s in SETTINGS.items() if surface in s.surfaces]):
            fn = setting_option(name)(fn)
        return fn

    return decorate


def settings_given(values: dict[str, Any]) -> ServeSettings:
    """The command's settings from its keywords (those it does not take keep their defaults)."""
    return ServeSettings(**{name: values.pop(name) for name in list(values) if name in SETTINGS})


def setting_of(param: click.Parameter) -> Optional[str]:
    """The ENV_SETTINGS setting ``param`` sets (MODEL: ``model``; an option: its long flag's), or None."""
    if isinstance(param, click.Argument):
        name = param.name
    else:
        longs = [opt for opt in param.opts if opt.startswith("--")]
        name = longs[0][2:].replace("-", "_") if longs else None
    return name if name in ENV_SETTINGS else None


class SettingsCommand(click.Command):
    """A click command whose setting-named parameters default to ``PREHEAT_<SETTING>`` (see the
    module's docstring). Click converts the variable's text with the option's own type; a value it
    refuses is one line naming the variable (``Invalid value for 'PREHEAT_FSDP': ...``), or the flag
    alone where the command line gave it."""

    #: the settings this command reads (default: every one it has a parameter for)
    env_settings: tuple[str, ...] = ENV_SETTINGS
    #: a flag that must be on the command line for them to be read (None: always read)
    env_gate: Optional[str] = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for param in self.params:
            setting = setting_of(param)
            if setting in self.env_settings:
                param.envvar = env_var(setting)
                if isinstance(param, click.Option):
                    param.show_envvar = self.env_gate is None  # a gated one says so in the gate's help

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if self.env_gate is not None:  # the variables stand in only when the gate is given
            gated = self.env_gate in args
            for param in self.params:
                setting = setting_of(param)
                if setting in self.env_settings:
                    param.envvar = env_var(setting) if gated else None
        try:
            return super().parse_args(ctx, args)
        except click.BadParameter as err:
            param = err.param
            if param is not None and err.param_hint is None and setting_of(param) is not None:
                # what the user wrote: the variable, or the flag alone (not click's "(env var: ...)")
                err.param_hint = f"'{param.envvar}'" if _from_env(ctx, param) else click.Parameter.get_error_hint(param, ctx)
            raise


def _from_env(ctx: click.Context, param: click.Parameter) -> bool:
    return param.name is not None and ctx.get_parameter_source(param.name) is ParameterSource.ENVIRONMENT


def names_of(ctx: Optional[click.Context] = None) -> Callable[[str], str]:
    """``name_of(setting)``: what the user gave ``setting`` by in this invocation: its variable
    when the value came from the environment, else its flag (``preheat.warm.SettingNames.by``
    takes it, as Ray's ``from_args`` does)."""
    ctx = ctx or click.get_current_context()
    by_env = {setting_of(p) for p in ctx.command.params if setting_of(p) is not None and _from_env(ctx, p)}
    return lambda setting: env_var(setting) if setting in by_env else flag_of(setting)
