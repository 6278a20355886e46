"""A bundle's chat template, rendered in Jinja's immutable sandbox under time and size budgets.

The template comes from the bundle (untrusted data), the messages from the caller. The
sandbox already keeps a template away from Python internals; this module also bounds what
one render may cost, so a template cannot freeze a server or exhaust its memory:

* **time**: a per-thread trace function follows the template's own compiled frames (and
  every Python call made while it renders) and stops the render once it has run
  ``RENDER_TIME_BUDGET_S``. Nested loops, filters, macros: all run Python frames;
* **size**: every operation that can build a large value in one step is checked *before*
  it runs (``*``, ``**``, ``+``, ``~``, ``%``-formatting, widths passed to methods and
  filters, ``str.replace``), and the rendered output is capped while it is produced;
* **structure**: ``{% include %}``, ``{% import %}`` and ``{% extends %}`` are refused when
  the template is compiled: a bundle's template is one self-contained file.

Errors: the template's own ``raise_exception("...")`` means the *messages* broke the
model's rules (:class:`InvalidParameterError`, a 400 through the server); anything else
that goes wrong inside the template (a budget, a syntax error, ``1 // 0``, ``range(10**9)``)
is the bundle's fault (:class:`ChatTemplateError`).
"""

from __future__ import annotations

import contextlib
import json
import re
import sys
import threading
import time
from typing import Any, Callable

from ..errors import ChatTemplateError, InvalidParameterError

# A chat template formats a few messages: real ones (ChatML, Llama 3, Qwen, SmolLM2) render
# in well under 10 ms. 2 s is two orders of magnitude of headroom on a slow edge CPU, and
# short enough that a hostile template cannot hold a request slot for long.
RENDER_TIME_BUDGET_S = 2.0
# The rendered prompt and every string built while rendering: the messages themselves plus
# this much markup. A template adds tens of characters per message; 1 Mi chars of markup
# is far beyond any real one, and bounds memory to a few MB per render.
RENDER_MARKUP_BUDGET_CHARS = 1 << 20
# Largest integer a template may build with ``*`` or ``**``: counts and indices, never
# cryptography; big-int arithmetic past this is how ``2**10**9`` would freeze the loop.
_MAX_INT_BITS = 256
# How often (in trace events) the clock is read: perf_counter costs ~50 ns, a trace event
# ~200 ns, so checking every 64th event keeps the overhead of the budget itself small.
_CLOCK_EVERY = 64
_TEMPLATE_FILENAME = "<template>"  # the filename Jinja gives code compiled from a string
# Deepest nesting of calls (macros, methods, filters called from the template) a render may reach.
# Real chat templates nest a macro call or two inside a loop; 100 is far beyond them. The bound is
# the sandbox's own, not Python's recursion limit: each level runs ~6 Python frames through C-level
# calls, and a process may have raised that limit (hypothesis does inside its tests, torch's
# compilers do), so a template that recursed without end overflowed the C stack and crashed the
# process (a segfault in a full test run) before any RecursionError.
_MAX_CALL_DEPTH = 100


class _MessagesRejected(Exception):
    """Raised by the template's own ``raise_exception(message)``: the messages broke its rules."""


class _BudgetExceeded(Exception):
    """A render went past its time or size budget."""


class _Budget:
    """The limits of one render, checked by the sandbox hooks and the trace function."""

    def __init__(self, chars: int, seconds: float) -> None:
        self.chars = chars
        self.deadline = time.perf_counter() + seconds
        self.seconds = seconds
        self.events = 0
        self.depth = 0  # calls from the template now running, nested

    def size(self, n: int, what: str) -> None:
        if n > self.chars:
            raise _BudgetExceeded(f"{what} would build {n} characters or items, more than the render budget of "
                                  f"{self.chars}")

    def tick(self) -> None:
        self.events += 1
        if self.events % _CLOCK_EVERY == 0 and time.perf_counter() > self.deadline:
            raise _BudgetExceeded(f"rendering took longer than the time budget of {self.seconds:g} s")


_local = threading.local()  # the budget of the render running on this thread, if any


def _budget() -> _Budget | None:
    return getattr(_local, "budget", None)


def _check_width_args(args: tuple, kwargs: dict, what: str) -> None:
    """Refuse integer arguments larger than the size budget (``center(10**9)``, ``indent(10**9)``...)."""
    budget = _budget()
    if budget is None:
        return
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > budget.chars:
            budget.size(abs(value), what)


def _check_result(value: Any, what: str) -> Any:
    budget = _budget()
    if budget is not None and isinstance(value, (str, list, tuple)):
        budget.size(len(value), what)
    return value


# Format strings with a width or precision of 7+ digits ("%999999999d", "{:>999999999}") or a
# width taken from the arguments ("%*d") build strings the size check cannot see coming.
_WIDE_FORMAT = re.compile(r"\d{7,}|%[-#0 +]*\*")


def _sandbox_class():
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BudgetedSandbox(ImmutableSandboxedEnvironment):
        """The immutable sandbox with every large-value operation checked against the budget."""

        intercepted_binops = frozenset({"*", "**", "+", "%", "//", "/"})

        def call_binop(self, context, op: str, left: Any, right: Any) -> Any:
            budget = _budget()
            if budget is not None:
                if op == "*":
                    for seq, count in ((left, right), (right, left)):
                        if isinstance(seq, (str, list, tuple)) and isinstance(count, int):
                            budget.size(len(seq) * max(count, 0), "'*' on a sequence")
                    if isinstance(left, int) and isinstance(right, int) and \
                            left.bit_length() + right.bit_length() > _MAX_INT_BITS:
                        raise _BudgetExceeded(f"'*' would build an integer of more than {_MAX_INT_BITS} bits")
                elif op == "**":
                    if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and \
                            right > 0 and left.bit_length() * right > _MAX_INT_BITS:
                        raise _BudgetExceeded(f"'**' would build an integer of more than {_MAX_INT_BITS} bits")
                    if isinstance(left, float) or isinstance(right, float):
                        pass  # floats overflow to an OverflowError, caught as a template failure
                elif op == "+":
                    if isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
                        budget.size(len(left) + len(right), "'+'")
                elif op == "%" and isinstance(left, str) and _WIDE_FORMAT.search(left):
                    raise _BudgetExceeded("a %-format with a width or precision of 7+ digits")
            return super().call_binop(context, op, left, right)

        def wrap_str_format(self, value: Any):
            # Jinja wraps str.format when the method is looked up: check the format string there.
            target = getattr(value, "__self__", None)
            if _budget() is not None and isinstance(target, str) and \
                    getattr(value, "__name__", "") in ("format", "format_map") and _WIDE_FORMAT.search(target):
                raise _BudgetExceeded("a format string with a width or precision of 7+ digits")
            return super().wrap_str_format(value)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - Jinja's own signature
            what = f"calling {getattr(__obj, '__name__', type(__obj).__name__)}"
            _check_width_args(args, kwargs, what)
            budget = _budget()
            if budget is not None:
                target = getattr(__obj, "__self__", None)
                if isinstance(target, str) and getattr(__obj, "__name__", "") == "replace" and len(args) >= 2 \
                        and isinstance(args[0], str) and isinstance(args[1], str):
                    count = len(target) + 1 if not args[0] else target.count(args[0])
                    budget.size(len(target) + count * max(len(args[1]) - len(args[0]), 0), what)
                if budget.depth >= _MAX_CALL_DEPTH:
                    raise RecursionError(f"calls nested {_MAX_CALL_DEPTH} deep")  # render() names it
                budget.depth += 1
            try:
                return _check_result(super().call(__context, __obj, *args, **kwargs), what)
            finally:
                if budget is not None:
                    budget.depth -= 1

    return BudgetedSandbox


def _budgeted_filter(name: str, fn: Callable) -> Callable:
    """Wrap a filter so width-like arguments and its result stay inside the budget."""
    import functools

    from jinja2 import Environment
    from jinja2.nodes import EvalContext
    from jinja2.runtime import Context

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        what = f"filter {name!r}"
        # pass_context / pass_eval_context / pass_environment filters get that object first;
        # then comes the filtered value, then the filter's parameters.
        first = 1 if args and isinstance(args[0], (Context, EvalContext, Environment)) else 0
        value, params = (args[first], args[first + 1:]) if len(args) > first else (None, ())
        _check_width_args(params, kwargs, what)
        budget = _budget()
        if budget is not None and isinstance(value, str):
            if name == "replace" and len(params) >= 2 and isinstance(params[0], str) and isinstance(params[1], str):
                old, new = params[0], params[1]
                count = len(value) + 1 if not old else value.count(old)
                budget.size(len(value) + count * max(len(new) - len(old), 0), what)
            if name == "format" and _WIDE_FORMAT.search(value):
                raise _BudgetExceeded("a format string with a width or precision of 7+ digits")
        return _check_result(fn(*args, **kwargs), what)

    return wrapper


def _bounded_join(join: Callable) -> Callable:
    """Jinja's ``~`` (string concatenation) helper, with the joined length checked first."""

    def joined(seq):
        parts = list(seq)
        budget = _budget()
        if budget is not None:
            budget.size(sum(len(p) if isinstance(p, str) else 0 for p in parts), "'~'")
        return join(parts)

    return joined


def _tracer(budget: _Budget):
    """A sys.settrace function: every call event, and every line of the template's frames, ticks."""

    def local(frame, event, arg):
        budget.tick()
        return local

    def global_trace(frame, event, arg):
        budget.tick()
        # Line events only inside the template's own code: its loops run there; library
        # frames (filters, the sandbox) are counted per call, which is cheaper.
        return local if frame.f_code.co_filename == _TEMPLATE_FILENAME else None

    return global_trace


@contextlib.contextmanager
def _budgeted(budget: _Budget):
    """Run the block under ``budget``: the sandbox hooks see it, and the trace function ticks it."""
    previous_trace = sys.gettrace()
    _local.budget = budget
    sys.settrace(_tracer(budget))
    try:
        yield
    finally:
        sys.settrace(previous_trace)
        _local.budget = None


class ChatTemplate:
    """One compiled chat template. ``render(**context)`` is safe to call from several threads."""

    def __init__(self, source: str) -> None:
        from jinja2 import nodes
        from jinja2.exceptions import TemplateError

        def raise_exception(message: str):
            raise _MessagesRejected(message)

        env = _sandbox_class()(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
            x, indent=indent, ensure_ascii=ensure_ascii)
        env.filters = {name: _budgeted_filter(name, fn) for name, fn in env.filters.items()}
        try:
            # Compiling folds constant expressions, running filters and operators on them
            # ("{{ 'x'|center(10**9) }}"): under the same budgets as a render.
            with _budgeted(_Budget(RENDER_MARKUP_BUDGET_CHARS, RENDER_TIME_BUDGET_S)):
                tree = env.parse(source)
                for node in tree.find_all((nodes.Include, nodes.Import, nodes.FromImport, nodes.Extends)):
                    kind = {"FromImport": "from ... import"}.get(type(node).__name__, type(node).__name__.lower())
                    raise ChatTemplateError(f"the bundle's chat template uses {{% {kind} %}} (line {node.lineno}); "
                                            "a bundle's template must be one self-contained file")
                self._template = env.from_string(tree)
        except _BudgetExceeded as exc:
            raise ChatTemplateError(f"the bundle's chat template exceeded its budget while compiling: {exc}; fix "
                                    "or re-export the bundle") from None
        except TemplateError as exc:
            raise ChatTemplateError(f"the bundle's chat template does not compile: {exc}; fix or re-export the "
                                    "bundle") from None
        except RecursionError:
            raise ChatTemplateError("the bundle's chat template nests too deeply to compile") from None
        # The ``~`` operator compiles to a call of these module-level helpers: bound them here.
        namespace = self._template.root_render_func.__globals__
        for helper in ("str_join", "markup_join"):
            if helper in namespace:
                namespace[helper] = _bounded_join(namespace[helper])

    def render(self, *, input_chars: int, time_budget_s: float = RENDER_TIME_BUDGET_S,
               markup_budget_chars: int = RENDER_MARKUP_BUDGET_CHARS, **context: Any) -> str:
        """Render with ``context``; ``input_chars`` (the messages' length) widens the size budget.

        Raises InvalidParameterError when the template rejects the messages, ChatTemplateError
        for any failure of the template itself.
        """
        budget = _Budget(input_chars + markup_budget_chars, time_budget_s)
        try:
            with _budgeted(budget):
                out: list[str] = []
                size = 0
                for piece in self._template.generate(**context):
                    size += len(piece)
                    budget.size(size, "the rendered prompt")
                    out.append(piece)
            return "".join(out)
        except _MessagesRejected as exc:
            raise InvalidParameterError(f"the chat template rejected these messages: {exc}") from None
        except _BudgetExceeded as exc:
            raise ChatTemplateError(f"the bundle's chat template exceeded its budget: {exc}; fix or re-export the "
                                    "bundle") from None
        except RecursionError:  # a macro that calls itself: the bundle's fault, not the messages'
            raise ChatTemplateError("the bundle's chat template recurses without end; fix or re-export the "
                                    "bundle") from None
        except MemoryError:
            raise ChatTemplateError("the bundle's chat template ran out of memory; fix or re-export the "
                                    "bundle") from None
        except Exception as exc:  # ZeroDivisionError, OverflowError (range(10**9)), TypeError, UndefinedError...
            detail = str(exc).splitlines()[0][:200] if str(exc) else ""
            raise ChatTemplateError(f"the bundle's chat template failed: {type(exc).__name__}"
                                    f"{': ' + detail if detail else ''}; fix or re-export the bundle") from None


