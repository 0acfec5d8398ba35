"""A checkpoint's Jinja chat template, compiled and rendered with bounded work (:func:`compile_template`).

A template is rendered as transformers renders it (jinja2's immutable sandbox, ``trim_blocks`` and
``lstrip_blocks``, ``loopcontrols``, the ``raise_exception`` and ``strftime_now`` globals, a ``tojson`` that
does not escape HTML), within a budget: at most :data:`MAX_STEPS` steps (each loop iteration and each call
is one), :data:`MAX_SECONDS` seconds and :data:`MAX_CHARS` characters of output, of any string or list the
operators ``*``, ``+``, ``~`` and ``%`` or a call make, and of any int a call or a filter takes (a width, a
count); ``**`` at most :data:`MAX_POWER_BITS` bits; ``range`` jinja2's 100000 items. What the budget
refuses, and any error the template raises while it renders (``1/0``, ``'a' + 1``, ``{% include %}``:
templates have no loader), is a ValueError naming the template's file.
"""

from __future__ import annotations

import contextvars
import datetime
import json
import re
import time

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.visitor

#: the most loop iterations and calls one rendering takes
MAX_STEPS = 250_000
#: the most seconds one rendering takes (checked at each step, operator and piece of output)
MAX_SECONDS = 10.0
#: the longest output, string or list one rendering makes, and the largest int a call or filter takes
MAX_CHARS = 1 << 25
#: the largest result of ``**``, in bits
MAX_POWER_BITS = 1 << 16

_STEPS_FILTER = "__oc128_steps"
_CONCAT_FILTER = "__oc128_concat"
_budget: contextvars.ContextVar[_Budget] = contextvars.ContextVar("chat_template_budget")


class BudgetExceeded(jinja2.sandbox.SecurityError):
    """A rendering went past its budget (the message says which)."""


class _Budget:
    """One rendering's steps left and its deadline."""

    def __init__(self):
        self.steps = MAX_STEPS
        self.deadline = time.monotonic() + MAX_SECONDS

    def step(self) -> None:
        self.steps -= 1
        if self.steps < 0:
            raise BudgetExceeded(f"more than {MAX_STEPS} loop iterations and calls")
        self.check_time()

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise BudgetExceeded(f"rendering took more than {MAX_SECONDS} s")


def _check_size(value, what: str):
    """``value`` if it is no string, list or tuple longer than :data:`MAX_CHARS`."""
    if isinstance(value, str | list | tuple) and len(value) > MAX_CHARS:
        raise BudgetExceeded(f"{what} of {len(value)} items, more than {MAX_CHARS}")
    return value


def _check_ints(args, kwargs, what: str) -> None:
    """Refuse an int argument (a width, a count, a repetition) past :data:`MAX_CHARS`."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and abs(value) > MAX_CHARS:
            raise BudgetExceeded(
                f"{what}: an int argument of {len(str(abs(value)))} digits, past {MAX_CHARS}"
            )


def _check_format(spec: str) -> None:
    """Refuse a format string (``%``, ``str.format``) with a width or precision past :data:`MAX_CHARS`."""
    for digits in re.findall(r"\d+", spec):
        if len(digits) > 9 or int(digits) > MAX_CHARS:
            raise BudgetExceeded(f"a format string with the number {digits[:12]}, at most {MAX_CHARS}")


def _steps(iterable):
    """A loop's items, each one step of the budget."""
    budget = _budget.get()
    for item in iterable:
        budget.step()
        yield item


def _concat(pieces) -> str:
    """Jinja's ``~``, bounded."""
    total = sum(len(str(piece)) for piece in pieces)
    if total > MAX_CHARS:
        raise BudgetExceeded(f"a string of {total} characters from ~, more than {MAX_CHARS}")
    return "".join(map(str, pieces))


class _Bounded(jinja2.visitor.NodeTransformer):
    """Each ``for`` loop's items through :func:`_steps`, each ``~`` through :func:`_concat`."""

    def visit_For(self, node):
        node = self.generic_visit(node)
        node.iter = jinja2.nodes.Filter(node.iter, _STEPS_FILTER, [], [], None, None, lineno=node.lineno)
        return node

    def visit_Concat(self, node):
        node = self.generic_visit(node)
        pieces = jinja2.nodes.List(node.nodes, lineno=node.lineno)
        return jinja2.nodes.Filter(pieces, _CONCAT_FILTER, [], [], None, None, lineno=node.lineno)


class _Environment(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """The immutable sandbox with the budget of the module docstring."""

    intercepted_binops = frozenset({"*", "+", "**", "%"})

    def _parse(self, source, name, filename):
        tree = _Bounded().visit(super()._parse(source, name, filename))
        return tree.set_environment(self)

    def call_binop(self, context, operator, left, right):
        _budget.get().check_time()
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, str | list | tuple) and isinstance(n, int) and len(seq) * n > MAX_CHARS:
                    raise BudgetExceeded(f"a sequence of {len(seq)} * {n} items, more than {MAX_CHARS}")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
            if right > 0 and left.bit_length() * right > MAX_POWER_BITS:
                raise BudgetExceeded(f"** of more than {MAX_POWER_BITS} bits")
        elif operator == "%" and isinstance(left, str):
            _check_format(left)
        elif operator == "+" and all(isinstance(x, str | list | tuple) for x in (left, right)):
            if len(left) + len(right) > MAX_CHARS:
                raise BudgetExceeded(
                    f"a sequence of {len(left) + len(right)} items from +, more than {MAX_CHARS}"
                )
        return _check_size(super().call_binop(context, operator, left, right), f"the result of {operator}")

    def call(__self, __context, __obj, *args, **kwargs):  # jinja2's names: any keyword may be passed
        _budget.get().step()
        _check_ints(args, kwargs, "a call")
        return _check_size(super().call(__context, __obj, *args, **kwargs), "a call's result")

    def wrap_str_format(self, value):
        wrapped = super().wrap_str_format(value)
        if wrapped is not None:
            _check_format(value.__self__)
        return wrapped


def _bounded_filter(name: str, function):
    """``function`` (the filter ``name``) with its int arguments and its result bounded."""

    first = 1 if hasattr(function, "jinja_pass_arg") else 0  # a context or environment comes first

    def bounded(*args, **kwargs):
        _budget.get().step()
        value, rest = args[first], args[first + 1 :]
        _check_ints(rest, kwargs, f"filter {name}")
        if name == "format" and isinstance(value, str):
            _check_format(value)
        new = str(rest[1] if len(rest) > 1 else kwargs.get("new", ""))
        if name == "replace" and len(str(value)) * max(len(new), 1) > MAX_CHARS:
            raise BudgetExceeded(f"filter replace: up to {len(str(value))} * {len(new)} characters")
        return _check_size(function(*args, **kwargs), f"filter {name}")

    if first:
        bounded.jinja_pass_arg = function.jinja_pass_arg
    return bounded


def _environment() -> _Environment:
    def raise_exception(message):
        raise jinja2.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    environment = _Environment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    environment.filters["tojson"] = tojson
    environment.filters = {name: _bounded_filter(name, f) for name, f in environment.filters.items()}
    environment.filters[_STEPS_FILTER] = _steps
    environment.filters[_CONCAT_FILTER] = _concat
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = lambda format: datetime.datetime.now().strftime(format)
    return environment


class ChatTemplate:
    """A chat template (:func:`compile_template`): :meth:`render` within the budget."""

    def __init__(self, template: jinja2.Template, file):
        self._template = template
        self.file = file

    def render(self, **variables) -> str:
        """The template rendered with ``variables``; ValueError naming the file for anything it raises or
        any bound it passes (module docstring)."""
        token = _budget.set(_Budget())
        try:
            pieces, chars = [], 0
            for piece in self._template.generate(**variables):
                chars += len(piece)
                if chars > MAX_CHARS:
                    raise BudgetExceeded(f"more than {MAX_CHARS} characters of output")
                _budget.get().check_time()
                pieces.append(piece)
            return "".join(pieces)
        except Exception as error:  # any error of the template's code, named below
            kind = "" if isinstance(error, jinja2.TemplateError) else f"{type(error).__name__}: "
            raise ValueError(f"chat: the chat template of {self.file} failed ({kind}{error})") from None
        finally:
            _budget.reset(token)


def compile_template(source: str, file) -> ChatTemplate:
    """The chat template ``source`` (read from ``file``, named in errors) compiled in the bounded sandbox;
    ValueError naming ``file`` if it is not a Jinja template."""
    try:
        return ChatTemplate(_environment().from_string(source), file)
    except jinja2.TemplateError as error:
        raise ValueError(f"{file}: chat_template: not a Jinja template ({error})") from None
    except RecursionError:
        raise ValueError(f"{file}: chat_template: nested too deeply") from None
