"""Click options derived from the one options source (runtime/options.py).

Each GenerationConfig and LoadConfig field's Option gives the flag, the type with its bounds
(shown in ``--help``), the choices and the help text; :func:`config_from` and :func:`load_from`
turn the parsed values back into the configs. A new option is declared in runtime/options.py
only. A command that needs another default (bench prefill times 2 threads, every bench
subcommand its own reply length) says so with :class:`Local`, not with a second declaration.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

import click


@dataclass(frozen=True)
class Local:
    """One command's take on a shared option: its own default (None: the shared one), a tighter range
    (checked by click), a sentence appended to the shared help."""

    default: Any = None
    low: int | None = None
    high: int | None = None
    note: str = ""


def _click_option(name: str, opt, default, local: Local | None = None):
    from ..runtime.options import interval

    if local is not None:
        default = default if local.default is None else local.default
        opt = replace(opt, help=f"{opt.help} {local.note}".strip())
        if local.low is not None or local.high is not None:  # the command's own range, checked by click
            return click.option(*(opt.cli or ("--" + name.replace("_", "-"),)), name,
                                type=click.IntRange(local.low, local.high), default=default,
                                show_default=default is not None, help=opt.help)
    decls = opt.cli or ("--" + name.replace("_", "-"),)
    if opt.kind is bool:
        if opt.invert:  # a flag that turns a default-True field off: --no-speculation, --raw
            return click.option(*decls, name, flag_value=False, default=True, help=opt.help)
        if opt.nullable:  # --x/--no-x, unset = the bundle's default
            return click.option(*decls, name, default=None, help=opt.help)
        return click.option(*decls, name, is_flag=True, default=default, help=opt.help)
    if opt.kind is tuple:
        return click.option(*decls, name, multiple=True, help=opt.help)
    if opt.kind is str:
        return click.option(*decls, name, type=click.Choice(opt.choices), default=default,
                            show_default=default is not None, help=opt.help)
    # A plain number type: the bound is checked by the config, so an out-of-range value
    # gets the same one-line "error: ..." (exit 2) from the CLI as from the API and the server.
    shown = 0 if default is None and opt.zero_is_none else default
    return click.option(*decls, name, type=opt.kind, default=shown, show_default=shown is not None,
                        help=f"{opt.help} Range: {interval(opt)}" + (" or 0." if opt.zero_is_none else "."))


def generation_options(exclude: tuple[str, ...] = ()) -> Callable:
    """Decorator adding a click option per GenerationConfig field (but those in ``exclude``)."""
    from ..runtime.options import OPTIONS, GenerationConfig

    defaults = GenerationConfig()

    def decorate(fn):
        for name in reversed([n for n, o in OPTIONS.items() if o.cli is not None and n not in exclude]):
            fn = _click_option(name, OPTIONS[name], getattr(defaults, name))(fn)
        return fn

    return decorate


def load_options(*names: str, **local: Local) -> Callable:
    """Decorator adding a click option per named LoadConfig field (threads, provider,
    verify_checksums, cache_slots), in that order; ``local`` maps a name to its :class:`Local`."""
    from ..runtime.options import LOAD_OPTIONS, LoadConfig

    defaults = LoadConfig()
    unknown = set(names) - set(LOAD_OPTIONS)
    assert not unknown and set(local) <= set(names), (unknown, local)

    def decorate(fn):
        for name in reversed([n for n in LOAD_OPTIONS if n in names]):
            fn = _click_option(name, LOAD_OPTIONS[name], getattr(defaults, name), local.get(name))(fn)
        return fn

    return decorate


def load_from(kw: dict):
    """The LoadConfig for parsed click values ``kw`` (fields a command does not offer keep their default)."""
    from ..runtime.options import LOAD_OPTIONS, LoadConfig

    return LoadConfig(**{name: kw[name] for name in LOAD_OPTIONS if name in kw})


def shared_option(name: str, local: Local | None = None) -> Callable:
    """One GenerationConfig option for a command that takes it alone, with its :class:`Local`
    default, range and note: the bench subcommands' and demo's ``--max-new-tokens``."""
    from ..runtime.options import OPTIONS

    return _click_option(name, OPTIONS[name], None, local)


def config_from(kw: dict, **fixed):
    """The GenerationConfig for parsed click values ``kw`` (extra keys are ignored), with ``fixed`` on top."""
    from ..runtime.options import OPTIONS, GenerationConfig

    values = {}
    for name, opt in OPTIONS.items():
        if name in kw:
            value = kw[name]
            values[name] = None if opt.zero_is_none and value == 0 else value
    return GenerationConfig(**{**values, **fixed})
