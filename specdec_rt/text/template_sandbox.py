"""The bounded Jinja sandbox that chat templates (untrusted: they come from the model folder)
render in (docs/security.md).

Jinja's immutable sandbox stops attribute tricks; this adds bounds on size and time: loop
iterations and calls are counted, string and list sizes are checked before an operation can build
a huge one (``'a' * 10**8``, ``10**10**8``, ``'%0999999999d' % 1``, ``'%*d' % (10**9, 1)``,
``'{:{}}'.format(1, '999999999')``, ``' '.join(...)``, ``|center(10**9)``, a list holding one
big string 1000 times), integers are bounded in bits before a ``*``, ``**``, ``+`` or ``-``
computes them (one huge multiplication cannot be interrupted by the deadline), the output has a
character budget, and rendering has a deadline. Going over any of them raises
:class:`TemplateBudgetError`. Use :func:`new_environment` +
:func:`compile_template` to build a template and :func:`render_bounded` to render it.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence, Sized
from typing import Any

from ..errors import InvalidInputError

__all__ = [
    "TemplateBudgetError",
    "TemplateMethodError",
    "STR_METHODS",
    "new_environment",
    "compile_template",
    "render_bounded",
    "TEMPLATE_TIMEOUT_S",
    "TEMPLATE_MIN_CHARS",
    "TEMPLATE_MAX_STEPS",
    "TEMPLATE_MAX_INT_BITS",
    "TEMPLATE_MAX_SORT_ITEMS",
]

TEMPLATE_TIMEOUT_S = 2.0  # default deadline of one chat template rendering
TEMPLATE_MIN_CHARS = 1 << 20  # output budget: this, plus 4 x the characters of the messages
TEMPLATE_MAX_STEPS = 1_000_000  # loop iterations + calls, plus 64 per message
TEMPLATE_MAX_INT_BITS = 4096  # integers a template computes or parses (about 1233 decimal digits)
TEMPLATE_MAX_SORT_ITEMS = 1 << 16  # items sort, dictsort, unique and groupby may take (~10 MB of keys)
_CHECK_EVERY = 64  # steps between two looks at the clock (one step: a loop item, a call, a filter)
_SEQUENCES = (str, bytes, bytearray, list, tuple)
_CONTAINERS = (list, tuple, dict, set, frozenset)


class _ThreadBudget(threading.local):
    """The budget of the rendering running in this thread (None: none runs)."""

    value: _Budget | None = None


_budget = _ThreadBudget()


class TemplateBudgetError(InvalidInputError):
    """A template went over its budget (the message says which)."""


class TemplateMethodError(TemplateBudgetError):
    """A template used a method of a string that the sandbox does not offer (the message names it)."""


# the str methods a template may use: each runs in time linear in its input, and those that can
# build a bigger string are sized first (_precheck_call); a codec (str.encode: 'punycode' and
# 'idna' are quadratic, one call the deadline cannot stop) and anything not listed are refused
STR_METHODS = frozenset(
    {
        *("capitalize", "casefold", "center", "count", "endswith", "expandtabs", "find", "format", "format_map"),
        *("index", "isalnum", "isalpha", "isascii", "isdecimal", "isdigit", "isidentifier", "islower"),
        *("isnumeric", "isprintable", "isspace", "istitle", "isupper", "join", "ljust", "lower", "lstrip"),
        *("partition", "removeprefix", "removesuffix", "replace", "rfind", "rindex", "rjust", "rpartition"),
        *("rsplit", "rstrip", "split", "splitlines", "startswith", "strip", "swapcase", "title", "translate"),
        *("upper", "zfill", "escape", "striptags", "unescape"),  # (the last three: markupsafe's Markup)
    }
)


class _Budget:
    def __init__(self, chars: int, steps: int, seconds: float) -> None:
        self.chars, self.steps, self.deadline = chars, steps, time.monotonic() + seconds
        self.seconds = seconds
        self.used = 0

    def tick(self, n: int = 1) -> None:
        """``n`` more steps; the clock is read whenever they cross a multiple of
        :data:`_CHECK_EVERY` (so always before a filter charged for many items does its work)."""
        before, self.used = self.used, self.used + n
        if self.used > self.steps:
            raise TemplateBudgetError(f"ran more than {self.steps} loop iterations and calls")
        if before // _CHECK_EVERY != self.used // _CHECK_EVERY and time.monotonic() > self.deadline:
            raise TemplateBudgetError(f"ran longer than {self.seconds:g} s")

    def size(self, value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool):
            self.bits(value.bit_length(), "an integer")
        elif isinstance(value, (str, bytes, bytearray)) and len(value) > self.chars:
            raise TemplateBudgetError(f"built a value of {len(value)} items, over its budget of {self.chars}")
        elif isinstance(value, _CONTAINERS):
            n = _text_length(value, self.chars)  # a list may hold one big string many times
            if n > self.chars:
                raise TemplateBudgetError(
                    f"built a value of at least {n} characters (as text), over its budget of {self.chars}"
                )
        return value

    def bits(self, n: int, what: str) -> None:
        if n > TEMPLATE_MAX_INT_BITS:
            raise TemplateBudgetError(f"{what} would have about {n} bits, over the limit of {TEMPLATE_MAX_INT_BITS}")

    def need(self, n: int, what: str) -> None:
        if n > self.chars:
            raise TemplateBudgetError(f"{what} would build about {n} characters, over its budget of {self.chars}")


def _current() -> _Budget:
    b = _budget.value
    if b is None:  # rendering outside TextCodec.render_chat: the defaults
        b = _budget.value = _Budget(TEMPLATE_MIN_CHARS, TEMPLATE_MAX_STEPS, TEMPLATE_TIMEOUT_S)
    return b


def _text_length(x: Any, limit: int, depth: int = 0) -> int:
    """About how many characters ``str(x)`` has (counting stops once past ``limit``): a list,
    tuple or dict counts what it holds, so ``[big] * 1000`` is as long as its text."""
    if isinstance(x, str):
        return len(x)
    if isinstance(x, (bytes, bytearray)):
        return len(x) + 3
    if isinstance(x, bool) or x is None:
        return 5
    if isinstance(x, int):
        return x.bit_length() * 10 // 33 + 2  # decimal digits, sign
    if isinstance(x, float):
        return 24
    if isinstance(x, _CONTAINERS):
        if depth > 64:
            return len(x) + 2
        total = 2
        for item in x.items() if isinstance(x, dict) else x:
            total += 2 + (
                _text_length(item[0], limit - total, depth + 1) + 2 + _text_length(item[1], limit - total, depth + 1)
                if isinstance(x, dict)
                else _text_length(item, limit - total, depth + 1)
            )
            if total > limit:
                break
        return total
    return 16


def _length(x: Any) -> int:
    return len(x) if isinstance(x, (str, bytes, bytearray)) else _text_length(x, 1 << 62)


def _spec_number(digits: str) -> int:
    return int(digits) if len(digits) <= 18 else 10**18


# one %-conversion: (mapping key), flags, width, .precision, length modifier, type
_PERCENT = re.compile(r"%(?:\(([^)]*)\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d*))?[hlL]?(.?)", re.S)


def _check_percent(fmt: str, args: Any, budget: _Budget, what: str) -> None:
    """``fmt % args``: refused before it is built if its widths and precisions (written in the
    format, or taken by ``*`` from ``args``) and the text of its arguments add up to more than
    the budget."""
    items = list(args) if isinstance(args, tuple) else [args]
    mapping = args if isinstance(args, dict) else None
    at, total = 0, len(fmt)
    for m in _PERCENT.finditer(fmt):
        key, width, precision, kind = m.groups()
        if kind == "%":
            continue
        for n in (width, precision):
            if n == "*":
                arg = items[at] if at < len(items) else 0
                at += 1
                total += abs(arg) if isinstance(arg, int) else 0
            elif n:
                total += _spec_number(n)
        if key is not None:
            value = mapping.get(key) if mapping is not None else None
        else:
            value = items[at] if at < len(items) else None
            at += 1
        total += _text_length(value, budget.chars) + (310 if kind and kind in "fF" else 0)  # '%f' % 1e308
        budget.need(total, what)
    budget.need(total, what)


_SPEC_NUMBER = re.compile(r"\d+")


def _format_field_mixin(base: Any) -> Any:
    """``base`` (Jinja's sandboxed ``str.format`` formatter) with each field checked before it is
    formatted: its width and precision (after ``{:{}}`` fields are filled in) and its value's
    text, added to what the format has built so far."""

    class Bounded(base):  # type: ignore[misc, unused-ignore]  # strict: a Jinja class chosen at run time (Any)
        _built: int

        def vformat(self, format_string: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
            self._built = len(format_string)
            return str(super().vformat(format_string, args, kwargs))

        def format_field(self, value: Any, format_spec: str) -> str:
            b = _current()
            b.tick()
            widths = sum(_spec_number(n) for n in _SPEC_NUMBER.findall(format_spec))
            b.need(self._built + widths + _text_length(value, b.chars), "str.format")
            out = str(super().format_field(value, format_spec))
            self._built += len(out)
            return out

    return Bounded


# calls whose integer arguments size what they build (a width, a count of pieces): those are
# checked against the budget; any other call may take any integer (a tool call's {"amount": 2500000})
_SIZING_FILTERS = frozenset({"center", "indent", "wordwrap", "slice", "batch"})
_SIZING_METHODS = frozenset({"center", "ljust", "rjust", "zfill", "expandtabs"})


def _precheck_call(
    obj: Any, args: tuple[Any, ...], kwargs: dict[str, Any], budget: _Budget, *, filter_name: str | None = None
) -> None:
    """Refuse a call whose result could exceed the budget before it is made."""
    inner = getattr(obj, "__wrapped__", obj)  # the sandbox wraps str.format
    name = getattr(inner, "__name__", "")
    owner = getattr(inner, "__self__", None)
    if filter_name in _SIZING_FILTERS or (isinstance(owner, (str, bytes, bytearray)) and name in _SIZING_METHODS):
        ints = [a for a in (*args, *kwargs.values()) if isinstance(a, int) and not isinstance(a, bool)]
        if any(abs(i) > budget.chars for i in ints):
            budget.need(max(abs(i) for i in ints), f"a call with the argument {max(ints, key=abs)}")
    if isinstance(owner, (str, bytes, bytearray)):
        if name == "replace" and len(args) >= 2:
            budget.need((len(owner) + 1) * (_length(args[1]) + 1), "str.replace")
        elif name == "join" and args and isinstance(args[0], Sized):
            joined: Any = args[0]
            budget.need(len(owner) * len(joined) + sum(_length(x) for x in joined), "str.join")
        elif name == "expandtabs":
            tab = args[0] if args else kwargs.get("tabsize", 8)
            budget.need(len(owner) * max(1, tab if isinstance(tab, int) else 8), "str.expandtabs")
        elif name == "translate" and args and isinstance(args[0], dict):
            longest = max((_length(v) for v in args[0].values() if v is not None), default=1)
            budget.need(len(owner) * max(longest, 1), "str.translate")


def _bounded_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    """A filter that checks its int arguments and known amplifiers first, its result after."""
    from functools import update_wrapper

    from jinja2 import Environment
    from jinja2.nodes import EvalContext
    from jinja2.runtime import Context

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        b = _current()
        b.tick()
        values = [a for a in args if not isinstance(a, (Environment, EvalContext, Context))]
        _precheck_call(None, tuple(values[1:]), kwargs, b, filter_name=name)
        if values and name in _CONSUMING:  # an iterator: counted as it is consumed
            args, values = _replace_first(args, values, _charge_items(values[0], b, name))
        if values and name == "join" and not isinstance(values[0], Sized):  # a generator (map, select...)
            items = list(itertools.islice(values[0], b.chars + 1))  # counted first
            b.need(len(items), "the join filter")
            args, values = _replace_first(args, values, items)
        if values:
            if isinstance(values[0], _CONTAINERS) and name in _STRINGIFYING:
                b.need(_text_length(values[0], b.chars), f"the {name} filter")
            check = _FILTER_CHECKS.get(name)
            if check is not None:
                check(values, kwargs, b)
        return b.size(func(*args, **kwargs))

    return update_wrapper(wrapper, func)


def _replace_first(args: tuple[Any, ...], values: list[Any], new: Any) -> tuple[tuple[Any, ...], list[Any]]:
    """``args`` and ``values`` with the filter's input (``values[0]``) replaced by ``new``."""
    if new is values[0]:
        return args, values
    at = next(i for i, a in enumerate(args) if a is values[0])
    return (*args[:at], new, *args[at + 1 :]), [new, *values[1:]]


def _check_join(values: list[Any], kwargs: dict[str, Any], budget: _Budget) -> None:
    value = values[0]
    sep = values[1] if len(values) > 1 else kwargs.get("d", "")
    budget.need(_length(sep) * len(value) + _text_length(value, budget.chars), "the join filter")


def _check_replace(values: list[Any], kwargs: dict[str, Any], budget: _Budget) -> None:
    if len(values) >= 3:
        budget.need((_length(values[0]) + 1) * (_length(values[2]) + 1), "the replace filter")


def _check_indent(values: list[Any], kwargs: dict[str, Any], budget: _Budget) -> None:
    width = values[1] if len(values) > 1 else kwargs.get("width", 4)
    lines = str(values[0]).count("\n") + 1
    budget.need(
        lines * _length(width if isinstance(width, str) else " " * min(int(width), budget.chars + 1)),
        "the indent filter",
    )


def _check_format(values: list[Any], kwargs: dict[str, Any], budget: _Budget) -> None:
    if isinstance(values[0], str):
        _check_percent(values[0], kwargs or tuple(values[1:]), budget, "the format filter")


def _check_int(values: list[Any], kwargs: dict[str, Any], budget: _Budget) -> None:
    value = values[0]
    if isinstance(value, str) and len(value) > 5000 and value.strip().lstrip("+-").replace("_", "").isdigit():
        # Python 3.11+ refuse over 4300 digits; 3.10 would parse them in quadratic time
        budget.bits(len(value), "the int filter's result")


def _check_wordwrap(values: list[Any], kwargs: dict[str, Any], budget: _Budget) -> None:
    width = values[1] if len(values) > 1 else kwargs.get("width", 79)
    wrap = values[3] if len(values) > 3 else kwargs.get("wrapstring") or "\n"
    text = str(values[0])
    lines = 2 * len(text) // max(width if isinstance(width, int) else 1, 1) + text.count("\n") + 2
    budget.need(len(text) + min(lines, len(text) + 2) * _length(wrap), "the wordwrap filter")


def _check_tojson(values: list[Any], kwargs: dict[str, Any], budget: _Budget) -> None:
    indent = values[1] if len(values) > 1 else kwargs.get("indent")
    if isinstance(indent, int) and indent > 64:
        budget.need(indent * 10**6, "tojson's indent")


# what a filter's input and arguments would build, checked before it runs
_FILTER_CHECKS: dict[str, Callable[[list[Any], dict[str, Any], _Budget], None]] = {
    "join": _check_join,
    "replace": _check_replace,
    "indent": _check_indent,
    "format": _check_format,
    "int": _check_int,
    "wordwrap": _check_wordwrap,
    "tojson": _check_tojson,
}


# filters that go through all of their input in one call (in C or in a Python loop the budget does
# not see): each item is charged as a step first, so the clock is read before the work; those that
# sort or collect their input take at most TEMPLATE_MAX_SORT_ITEMS items
_COLLECTING = frozenset({"sort", "dictsort", "unique", "groupby"})
_CONSUMING = _COLLECTING | {"list", "sum", "min", "max"}


def _charge_items(value: Any, budget: _Budget, name: str) -> Any:
    """``value`` for the filter ``name`` (in :data:`_CONSUMING`), its items charged as steps: all
    at once when it has a length (refused over :data:`TEMPLATE_MAX_SORT_ITEMS` for a sorting or
    collecting filter, before anything is built), else one by one as they are taken."""
    cap = TEMPLATE_MAX_SORT_ITEMS if name in _COLLECTING else None
    try:
        n = len(value)
    except TypeError:  # an iterator (map, select...)
        return _counted(iter(value), budget, cap, name) if isinstance(value, Iterable) else value
    if cap is not None and n > cap:
        raise TemplateBudgetError(f"the {name} filter was given {n} items, over its limit of {cap}")
    budget.tick(max(n, 1))
    return value


def _counted(items: Iterator[Any], budget: _Budget, cap: int | None, name: str) -> Iterator[Any]:
    for n, item in enumerate(items, 1):
        if cap is not None and n > cap:
            raise TemplateBudgetError(f"the {name} filter was given more than {cap} items, over its limit")
        budget.tick()
        yield item


# filters that turn their input into text: a list given to them is sized as text first
_STRINGIFYING = frozenset(
    {
        "string",
        "tojson",
        "pprint",
        "upper",
        "lower",
        "title",
        "capitalize",
        "trim",
        "striptags",
        "escape",
        "e",
        "forceescape",
        "urlize",
        "center",
        "indent",
        "replace",
        "truncate",
        "wordwrap",
        "wordcount",
        "format",
        "safe",
        "urlencode",
    }
)


def _sandbox_class() -> type[Any]:
    from functools import update_wrapper

    from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedEscapeFormatter, SandboxedFormatter
    from markupsafe import Markup

    formatter, escape_formatter = _format_field_mixin(SandboxedFormatter), _format_field_mixin(SandboxedEscapeFormatter)

    class _BoundedSandbox(ImmutableSandboxedEnvironment):
        """The immutable sandbox, with every operation that can amplify size or time bounded."""

        intercepted_binops = frozenset({"*", "**", "+", "-", "%", "//"})

        def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
            _check_str_method(obj, attr)
            return bool(super().is_safe_attribute(obj, attr, value))

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            b = _current()
            b.tick()
            _check_binop(b, operator, left, right)
            try:
                return b.size(super().call_binop(context, operator, left, right))
            except OverflowError as exc:  # float ** float, an int too large for a float
                raise TemplateBudgetError(f"overflowed ({exc})") from None

        def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
            """Jinja's own sandboxed ``str.format`` / ``format_map``, through a formatter that
            checks each field before formatting it (see :func:`_format_field_mixin`)."""
            import types

            if (
                not isinstance(value, (types.MethodType, types.BuiltinMethodType))
                or value.__name__ not in ("format", "format_map")
                or not isinstance(value.__self__, str)
            ):
                return None
            f_self = value.__self__
            fmt = escape_formatter(self, escape=f_self.escape) if isinstance(f_self, Markup) else formatter(self)
            return update_wrapper(_format_call(fmt, f_self, format_map=value.__name__ == "format_map"), value)

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 - jinja's
            b = _current()
            b.tick()
            _precheck_call(__obj, args, kwargs, b)
            return b.size(super().call(__context, __obj, *args, **kwargs))

    return _BoundedSandbox


def _check_str_method(obj: Any, attr: str) -> None:
    """A :class:`TemplateMethodError` for a str (or bytes) method chat templates may not call."""
    if isinstance(obj, (str, bytes, bytearray)) and attr not in STR_METHODS:
        kind = type(obj).__name__ if isinstance(obj, (bytes, bytearray)) else "str"
        raise TemplateMethodError(
            f"used {kind}.{attr}, which chat templates may not call (the sandbox offers only "
            "the str methods that run in linear time: strip, split, replace, startswith...)"
        )


def _check_binop(budget: _Budget, operator: str, left: Any, right: Any) -> None:
    """Refuse a binary operation whose result could exceed the budget, before it runs: an int
    result's bits are bounded BEFORE computing it (one huge multiplication or power runs in C
    and cannot be stopped by the deadline), a repetition's and a %-format's length."""
    if isinstance(left, int) and isinstance(right, int):
        bl, br = left.bit_length(), right.bit_length()
        if operator == "*":
            budget.bits(bl + br, "a product")
        elif operator == "**" and right > 0 and abs(left) > 1:
            budget.bits(int(right * math.log2(abs(left))) + 1 if br < 64 else 1 << 64, "a power")
        elif operator in ("+", "-"):
            budget.bits(max(bl, br) + 1, "a sum")
    elif operator == "*":
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, _SEQUENCES) and isinstance(n, int):
                budget.need(_length(seq) * max(n, 0), "a repetition")
    elif operator == "%" and isinstance(left, str):
        _check_percent(left, right, budget, "a %-format")


def _format_call(fmt: Any, f_self: str, *, format_map: bool) -> Callable[..., str]:
    """``f_self.format`` (or ``format_map``) through the checking formatter ``fmt``."""
    str_type = type(f_self)

    def wrapper(*args: Any, **kwargs: Any) -> str:
        if format_map:
            if kwargs:
                raise TypeError("format_map() takes no keyword arguments")
            if len(args) != 1:
                raise TypeError(f"format_map() takes exactly one argument ({len(args)} given)")
            kwargs, args = args[0], ()
        return str_type(fmt.vformat(f_self, args, kwargs))

    return wrapper


def _guard_iter(iterable: Iterable[Any]) -> Iterator[Any]:
    """Every template loop iterates through this: each item is a step of the budget."""
    b = _current()
    for item in iterable:
        b.tick()
        yield item


def _guard_concat(*parts: Any) -> str:
    """The template's ``~`` operator, sized before it is joined."""
    b = _current()
    b.tick()
    b.need(sum(_text_length(p, b.chars) for p in parts), "a ~ concatenation")
    strs = [p if isinstance(p, str) else str(p) for p in parts]
    b.need(sum(map(len, strs)), "a ~ concatenation")
    return "".join(strs)


def _instrument(ast: Any) -> Any:
    """Route every loop and every ``~`` of a parsed template through the guards above."""
    from jinja2 import nodes
    from jinja2.visitor import NodeTransformer

    class Guard(NodeTransformer):
        def visit_For(self, node: Any) -> Any:
            self.generic_visit(node)
            node.iter = nodes.Call(
                nodes.Name("__specdec_iter", "load", lineno=node.lineno),
                [node.iter],
                [],
                None,
                None,
                lineno=node.lineno,
            )
            return node

        def visit_Concat(self, node: Any) -> Any:
            self.generic_visit(node)
            return nodes.Call(
                nodes.Name("__specdec_concat", "load", lineno=node.lineno),
                list(node.nodes),
                [],
                None,
                None,
                lineno=node.lineno,
            )

    return Guard().visit(ast)


def _finalize(value: Any) -> Any:
    """``{{ value }}``: a list or dict is sized as text before ``str()`` builds it."""
    b = _budget.value
    if b is not None and isinstance(value, _CONTAINERS):
        b.need(_text_length(value, b.chars), "writing a list or dict")
    return value


def _bounded_lipsum(lipsum: Callable[..., Any]) -> Callable[..., Any]:
    """``lipsum(n, html, min, max)`` writes up to n * max words in a Python loop: sized first."""

    def bounded(n: Any = 5, html: Any = True, min: Any = 20, max: Any = 100) -> Any:  # noqa: A002 - Jinja's names
        b = _current()
        if all(isinstance(v, int) for v in (n, min, max)):
            b.need(abs(n) * (abs(min) + abs(max)) * 16, "lipsum")
        return b.size(lipsum(n, html, min, max))

    return bounded


def _generation_tag() -> type[Any]:
    from jinja2.ext import Extension

    class GenerationTag(Extension):
        """``{% generation %}...{% endgeneration %}``: its body, as if the tags were not there."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    return GenerationTag


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:  # transformers' signature: templates may pass them by position
    """``tojson`` as Hugging Face's chat templates call it (transformers' own arguments)."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def new_environment(**options: Any) -> Any:
    """A bounded sandbox environment: every filter checked, the loop and ``~`` guards installed,
    ``tojson`` as Hugging Face templates expect it. ``options`` go to Jinja (``trim_blocks``...)."""
    # as transformers renders chat templates: {% break %} / {% continue %}, and {% generation %}
    # (its marker of the assistant's tokens for training masks, rendered as its body)
    extensions = [*options.pop("extensions", ()), "jinja2.ext.loopcontrols", _generation_tag()]
    env = _sandbox_class()(finalize=_finalize, extensions=extensions, **options)
    env.filters["tojson"] = _tojson
    env.filters = {name: _bounded_filter(name, f) for name, f in env.filters.items()}
    env.globals["lipsum"] = _bounded_lipsum(env.globals["lipsum"])
    env.globals["__specdec_iter"] = _guard_iter
    env.globals["__specdec_concat"] = _guard_concat
    return env


def compile_template(env: Any, text: str) -> Any:
    """``text`` compiled in ``env`` (from :func:`new_environment`) with every loop and ``~``
    routed through the budget. Raises Jinja's ``TemplateError`` (or ``RecursionError``)."""
    return env.from_string(_instrument(env.parse(text)))


def render_bounded(template: Any, *, chars: int, steps: int, seconds: float, **variables: Any) -> str:
    """Render ``template`` with at most ``chars`` characters of output (and of any value built
    on the way), ``steps`` loop iterations and calls, and ``seconds``; over any of them is a
    :class:`TemplateBudgetError`. The budget is per thread, so concurrent renderings in other
    threads keep their own."""
    budget = _Budget(chars, steps, seconds)
    previous, _budget.value = _budget.value, budget
    try:
        parts, total = [], 0
        for chunk in template.generate(**variables):
            total += len(chunk)
            if total > chars:
                raise TemplateBudgetError(f"wrote more than its budget of {chars} characters")
            budget.tick()
            parts.append(chunk)
        return "".join(parts)
    finally:
        _budget.value = previous
