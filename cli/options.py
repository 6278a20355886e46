"""Click options derived from the one options source (runtime/options.py).

Each GenerationConfig field's Option gives the flag, the type with its bounds (shown in
``--help``), the choices and the help text; :func:`config_from` turns the parsed values
back into a GenerationConfig. A new option is declared in runtime/options.py only.
"""

from __future__ import annotations

from typing import Callable

import click


def _click_option(name: str, opt, default):
    from ..runtime.options import interval

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
    # A plain number type: the bound is checked by GenerationConfig, so an out-of-range value
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


def config_from(kw: dict, **fixed):
    """The GenerationConfig for parsed click values ``kw`` (extra keys are ignored), with ``fixed`` on top."""
    from ..runtime.options import OPTIONS, GenerationConfig

    values = {}
    for name, opt in OPTIONS.items():
        if name in kw:
            value = kw[name]
            values[name] = None if opt.zero_is_none and value == 0 else value
    return GenerationConfig(**{**values, **fixed})
