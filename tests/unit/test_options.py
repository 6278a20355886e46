"""The one options source and the drafter registry: everything else derives from them.

Guards: every GenerationConfig field declares its type, help and (for numbers) both
bounds; the CLI's generate options, the server's ``specedge`` extension and the bench's
configuration names are the ones declared there and in the drafter registry, so a new
option or drafter is written once.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specedge.bench.configs import SPEC_DRAFTERS, parse_config_name
from specedge.errors import InvalidParameterError
from specedge.runtime.drafters import DRAFTER_CHOICES, DRAFTERS, NO_DRAFTER, needs_draft_model
from specedge.runtime.options import OPTIONS, GenerationConfig, check
from specedge.server.protocol import SPECEDGE_FIELDS


def test_every_field_declares_its_option_with_an_upper_bound():
    assert set(OPTIONS) == {f.name for f in dataclasses.fields(GenerationConfig)}
    for name, option in OPTIONS.items():
        assert option.help, name
        if option.kind in (int, float):
            assert option.low is not None and option.high is not None, f"{name} needs both bounds"
        if option.kind is str:
            assert option.choices or option.max_chars, name
        if option.kind is tuple:
            assert option.max_items, name


def test_the_cli_offers_exactly_the_declared_options():
    from specedge.cli.main import generate

    params = {p.name for p in generate.params}
    assert {n for n, o in OPTIONS.items() if o.cli is not None} <= params
    drafter = next(p for p in generate.params if p.name == "drafter")
    assert tuple(drafter.type.choices) == DRAFTER_CHOICES


def test_server_extension_and_bench_names_come_from_the_sources():
    assert SPECEDGE_FIELDS == tuple(n for n, o in OPTIONS.items() if o.server)
    assert SPEC_DRAFTERS == tuple(DRAFTERS)
    assert DRAFTER_CHOICES == (NO_DRAFTER, *DRAFTERS)
    for name in DRAFTERS:
        assert parse_config_name(f"{name}-k2").drafter == name
        assert needs_draft_model(name) == DRAFTERS[name].needs_draft_model
    assert not needs_draft_model(NO_DRAFTER)


@pytest.mark.parametrize("name, value, where, match", [
    ("draft_tokens", 99, "specedge.draft_tokens", r"specedge.draft_tokens must be an integer in \[0, 64\] or None"),
    ("speculation", "no", "speculation", r"speculation must be true or false \(a bool\); got 'no'"),
    ("temperature", True, "temperature", r"temperature must be a number in \[0, 2\]; got True"),
])
def test_check_names_where_the_value_came_from(name, value, where, match):
    with pytest.raises(InvalidParameterError, match=match):
        check(name, value, where=where)


def test_check_normalises_a_single_stop_string():
    assert check("stop", "###") == ("###",)
    assert GenerationConfig(stop=["a", "b"]).stop == ("a", "b")


# Any JSON-ish value (and a few Python ones a caller may pass) for any field.
_ANY = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                max_size=2), max_leaves=6)


@settings(max_examples=400, deadline=None)
@given(data=st.data())
def test_random_values_for_every_field_give_a_config_or_a_typed_error(data):
    """Issue 20: every GenerationConfig field, fed anything, is valid or InvalidParameterError."""
    values = {name: data.draw(_ANY, label=name) for name in data.draw(st.sets(st.sampled_from(sorted(OPTIONS)),
                                                                                min_size=1, max_size=3))}
    try:
        config = GenerationConfig(**values)
    except InvalidParameterError:
        return
    for name in values:  # what was accepted has the declared type (ints are valid floats)
        kind = (int, float) if OPTIONS[name].kind is float else OPTIONS[name].kind
        assert getattr(config, name) is None or isinstance(getattr(config, name), kind), name


def test_a_cache_salt_is_a_bounded_non_empty_string():
    from specedge.runtime.options import MAX_CACHE_SALT_CHARS

    assert GenerationConfig(cache_salt="tenant-7").cache_salt == "tenant-7"
    for bad, match in (("", "non-empty string"), (7, "non-empty string"), ("\ud800", "non-empty string"),
                       ("x" * (MAX_CACHE_SALT_CHARS + 1), f"at most {MAX_CACHE_SALT_CHARS}")):
        with pytest.raises(InvalidParameterError, match=match):
            GenerationConfig(cache_salt=bad)


def test_every_load_option_is_declared_once_with_its_bounds():
    from specedge.runtime.options import LOAD_OPTIONS, LoadConfig

    assert set(LOAD_OPTIONS) == {f.name for f in dataclasses.fields(LoadConfig)}
    for name, option in LOAD_OPTIONS.items():
        assert option.help, name
        if option.kind is int:
            assert option.low is not None and option.high is not None, f"{name} needs both bounds"
        if option.kind is str:
            assert option.choices, name


def test_a_load_config_refuses_out_of_range_values_with_the_engines_message_for_threads():
    from specedge.runtime.options import MAX_CACHE_SLOTS, LoadConfig

    assert LoadConfig(threads=1, cache_slots=MAX_CACHE_SLOTS).cache_slots == MAX_CACHE_SLOTS
    with pytest.raises(InvalidParameterError, match=r"thread counts must be integers in \[0, \d+\]"):
        LoadConfig(threads=2**31)
    with pytest.raises(InvalidParameterError, match=r"cache_slots must be an integer in \[1, 256\]; got 0"):
        LoadConfig(cache_slots=0)
    with pytest.raises(InvalidParameterError, match=r"provider must be one of"):
        LoadConfig(provider="gpu")


def _commands(group, path=()):
    import click

    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            yield from _commands(command, (*path, name))
        else:
            yield " ".join((*path, name)), command


def test_every_command_takes_load_options_and_max_new_tokens_from_the_one_declaration():
    """A command's --threads, --provider, --no-verify-checksums, --cache-slots and --max-new-tokens
    carry the shared help (a command may append a note, its own default and a tighter range)."""
    from specedge.cli.main import main
    from specedge.runtime.options import LOAD_OPTIONS

    shared = {**LOAD_OPTIONS, "max_new_tokens": OPTIONS["max_new_tokens"]}
    seen = set()
    for path, command in _commands(main):
        for param in command.params:
            if param.name in shared and not (path == "bench profile" and param.name == "threads"):  # a list
                assert param.help.startswith(shared[param.name].help), (path, param.name)
                seen.add((path, param.name))
    assert {("serve", n) for n in LOAD_OPTIONS} <= seen
    assert {(c, "threads") for c in ("generate", "eval", "tune", "bench run", "bench variants",
                                     "bench conversation", "bench prefill", "bench bound")} <= seen
    assert {(c, "max_new_tokens") for c in ("demo", "bench run", "bench variants", "bench threads",
                                            "bench conversation", "bench bound")} <= seen


def test_options_import_neither_the_loop_nor_a_drafter():
    """The options sit below the loop and the drafters: the constants they need live in options.py."""
    import subprocess
    import sys

    code = ("import sys, specedge.runtime.options; "
            "print(sorted(m for m in sys.modules if m.startswith('specedge.runtime.') and "
            "m.rsplit('.', 1)[1] in ('loop', 'model_drafter', 'generator')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
