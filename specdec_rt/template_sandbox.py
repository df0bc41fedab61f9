"""The bounded Jinja sandbox that chat templates (untrusted: they come from the model folder)
render in (docs/security.md).

Jinja's immutable sandbox stops attribute tricks; this adds bounds on size and time: loop
iterations and calls are counted, string and list sizes are checked before an operation can build
a huge one (``'a' * 10**8``, ``10**10**8``, ``'%0999999999d' % 1``, ``' '.join(...)``,
``|center(10**9)``), the output has a character budget, and rendering has a deadline. Going over
any of them raises :class:`TemplateBudgetError`. Use :func:`new_environment` +
:func:`compile_template` to build a template and :func:`render_bounded` to render it.
"""

from __future__ import annotations

import json
import re
import threading
import time
from typing import Any

from .errors import InvalidInputError

__all__ = ["TemplateBudgetError", "new_environment", "compile_template", "render_bounded",
           "TEMPLATE_TIMEOUT_S", "TEMPLATE_MIN_CHARS", "TEMPLATE_MAX_STEPS"]

TEMPLATE_TIMEOUT_S = 2.0  # default deadline of one chat template rendering
TEMPLATE_MIN_CHARS = 1 << 20  # output budget: this, plus 4 x the characters of the messages
TEMPLATE_MAX_STEPS = 1_000_000  # loop iterations + calls, plus 64 per message
_budget = threading.local()  # the budget of the rendering running in this thread


class TemplateBudgetError(InvalidInputError):
    """A template went over its budget (the message says which)."""


class _Budget:
    def __init__(self, chars: int, steps: int, seconds: float) -> None:
        self.chars, self.steps, self.deadline = chars, steps, time.monotonic() + seconds
        self.seconds = seconds
        self.used = 0

    def tick(self, n: int = 1) -> None:
        self.used += n
        if self.used > self.steps:
            raise TemplateBudgetError(f"ran more than {self.steps} loop iterations and calls")
        if not self.used & 255 and time.monotonic() > self.deadline:
            raise TemplateBudgetError(f"ran longer than {self.seconds:g} s")

    def size(self, value: Any) -> Any:
        if isinstance(value, (str, list, tuple, dict)) and len(value) > self.chars:
            raise TemplateBudgetError(f"built a value of {len(value)} items, over its budget of {self.chars}")
        return value

    def need(self, n: int, what: str) -> None:
        if n > self.chars:
            raise TemplateBudgetError(f"{what} would build about {n} characters, over its budget of {self.chars}")


def _current() -> _Budget:
    b = getattr(_budget, "value", None)
    if b is None:  # rendering outside TextCodec.render_chat: the defaults
        b = _budget.value = _Budget(TEMPLATE_MIN_CHARS, TEMPLATE_MAX_STEPS, TEMPLATE_TIMEOUT_S)
    return b


_WIDTH = re.compile(r"\d+")


def _check_widths(fmt: str, budget: _Budget, what: str) -> None:
    """A %- or {}-format string: no width or precision beyond the budget."""
    for m in _WIDTH.finditer(fmt):
        if len(m.group()) > 9 or int(m.group()) > budget.chars:
            budget.need(10**len(m.group()), what)


def _length(x: Any) -> int:
    return len(x) if isinstance(x, (str, list, tuple, dict)) else len(str(x)) if isinstance(x, (int, float)) else 16


def _precheck_call(obj: Any, args: tuple, kwargs: dict, budget: _Budget) -> None:
    """Refuse a call whose result could exceed the budget before it is made."""
    ints = [a for a in (*args, *kwargs.values()) if isinstance(a, int) and not isinstance(a, bool)]
    if any(abs(i) > budget.chars for i in ints):
        budget.need(max(abs(i) for i in ints), f"a call with the argument {max(ints, key=abs)}")
    inner = getattr(obj, "__wrapped__", obj)  # the sandbox wraps str.format
    name = getattr(inner, "__name__", "")
    owner = getattr(inner, "__self__", None)
    if isinstance(owner, str):
        if name == "replace" and len(args) >= 2:
            budget.need((len(owner) + 1) * (_length(args[1]) + 1), "str.replace")
        elif name == "join" and args and hasattr(args[0], "__len__"):
            budget.need(len(owner) * len(args[0]) + sum(_length(x) for x in args[0]), "str.join")
        elif name == "expandtabs":
            tab = args[0] if args else kwargs.get("tabsize", 8)
            budget.need(len(owner) * max(1, tab if isinstance(tab, int) else 8), "str.expandtabs")
        elif name in ("format", "format_map"):
            _check_widths(owner, budget, "str.format")


def _bounded_filter(name: str, func):
    """A filter that checks its int arguments and known amplifiers first, its result after."""
    from functools import update_wrapper

    from jinja2 import Environment
    from jinja2.nodes import EvalContext
    from jinja2.runtime import Context

    def wrapper(*args, **kwargs):
        b = _current()
        b.tick()
        values = [a for a in args if not isinstance(a, (Environment, EvalContext, Context))]
        _precheck_call(None, tuple(values[1:]), kwargs, b)
        if values:
            value = values[0]
            if name == "join":
                sep = values[1] if len(values) > 1 else kwargs.get("d", "")
                if hasattr(value, "__len__"):
                    b.need(_length(sep) * len(value), "the join filter")
            elif name == "replace" and len(values) >= 3:
                b.need((_length(value) + 1) * (_length(values[2]) + 1), "the replace filter")
            elif name == "indent":
                width = values[1] if len(values) > 1 else kwargs.get("width", 4)
                lines = str(value).count("\n") + 1
                b.need(lines * _length(width if isinstance(width, str) else " " * min(int(width), b.chars + 1)), "the indent filter")
            elif name == "format" and isinstance(value, str):
                _check_widths(value, b, "the format filter")
            elif name == "tojson":
                indent = values[1] if len(values) > 1 else kwargs.get("indent")
                if isinstance(indent, int) and indent > 64:
                    b.need(indent * 10**6, "tojson's indent")
        return b.size(func(*args, **kwargs))

    return update_wrapper(wrapper, func)


def _sandbox_class():
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _BoundedSandbox(ImmutableSandboxedEnvironment):
        """The immutable sandbox, with every operation that can amplify size or time bounded."""

        intercepted_binops = frozenset({"*", "**", "+", "%", "//"})

        def call_binop(self, context, operator, left, right):
            b = _current()
            b.tick()
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                        b.need(len(seq) * max(n, 0), "a repetition")
            elif operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
                bits = max(abs(left).bit_length(), 1) * right
                if abs(left) > 1 and bits > 1 << 16:
                    raise TemplateBudgetError(f"a power of about {bits} bits")
            elif operator == "%" and isinstance(left, str):
                _check_widths(left, b, "a %-format")
            return b.size(super().call_binop(context, operator, left, right))

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja's signature
            b = _current()
            b.tick()
            _precheck_call(__obj, args, kwargs, b)
            return b.size(super().call(__context, __obj, *args, **kwargs))

    return _BoundedSandbox


def _guard_iter(iterable):
    """Every template loop iterates through this: each item is a step of the budget."""
    b = _current()
    for item in iterable:
        b.tick()
        yield item


def _guard_concat(*parts):
    """The template's ``~`` operator, sized before it is joined."""
    b = _current()
    b.tick()
    strs = [p if isinstance(p, str) else str(p) for p in parts]
    b.need(sum(map(len, strs)), "a ~ concatenation")
    return "".join(strs)


def _instrument(ast):
    """Route every loop and every ``~`` of a parsed template through the guards above."""
    from jinja2 import nodes
    from jinja2.visitor import NodeTransformer

    class Guard(NodeTransformer):
        def visit_For(self, node):
            self.generic_visit(node)
            node.iter = nodes.Call(nodes.Name("__specdec_iter", "load", lineno=node.lineno), [node.iter],
                                   [], None, None, lineno=node.lineno)
            return node

        def visit_Concat(self, node):
            self.generic_visit(node)
            return nodes.Call(nodes.Name("__specdec_concat", "load", lineno=node.lineno), list(node.nodes),
                              [], None, None, lineno=node.lineno)

    return Guard().visit(ast)


def new_environment(**options):
    """A bounded sandbox environment: every filter checked, the loop and ``~`` guards installed,
    ``tojson`` as Hugging Face templates expect it. ``options`` go to Jinja (``trim_blocks``...)."""
    env = _sandbox_class()(**options)
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    env.filters = {name: _bounded_filter(name, f) for name, f in env.filters.items()}
    env.globals["__specdec_iter"] = _guard_iter
    env.globals["__specdec_concat"] = _guard_concat
    return env


def compile_template(env, text: str):
    """``text`` compiled in ``env`` (from :func:`new_environment`) with every loop and ``~``
    routed through the budget. Raises Jinja's ``TemplateError`` (or ``RecursionError``)."""
    return env.from_string(_instrument(env.parse(text)))


def render_bounded(template, *, chars: int, steps: int, seconds: float, **variables) -> str:
    """Render ``template`` with at most ``chars`` characters of output (and of any value built
    on the way), ``steps`` loop iterations and calls, and ``seconds``; over any of them is a
    :class:`TemplateBudgetError`. The budget is per thread, so concurrent renderings in other
    threads keep their own."""
    budget = _Budget(chars, steps, seconds)
    previous, _budget.value = getattr(_budget, "value", None), budget
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
