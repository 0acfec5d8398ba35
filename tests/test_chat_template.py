"""The chat template's sandbox bounds its work (jax_oc128.chat_template): loops, calls, sizes, format widths
and powers past the budget, and any error the template raises while it renders, are a ValueError naming
the template's file, quickly; what real templates do still renders."""

from __future__ import annotations

import time

import pytest

from jax_oc128 import chat_template
from jax_oc128.chat_template import compile_template

FILE = "ckpt/chat_template.jinja"
MESSAGES = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"}]

#: (a hostile template, what the error says after the file)
HOSTILE = {
    "nested loops": (
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        r"more than 250000 loop iterations and calls",
    ),
    "recursive macro": (
        "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}",
        r"more than 250000 loop iterations and calls",
    ),
    "string times 10**10": ("{{ 'x' * 10**10 }}", r"a sequence of 1 \* 10000000000 items"),
    "list times 10**6": ("{{ (range(100) | list) * 10**6 }}", r"a sequence of 100 \* 1000000 items"),
    "doubling with ~": (
        "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
        r"a string of 67108864 characters from ~",
    ),
    "doubling with +": (
        "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
        r"a sequence of 67108864 items from \+",
    ),
    "range(10**9)": ("{{ range(10**9) | list }}", r"a call: an int argument of 10 digits"),
    "center filter": ("{{ 'x' | center(10**10) }}", r"filter center: an int argument of 11 digits"),
    "center method": ("{{ 'x'.center(10**10) }}", r"a call: an int argument of 11 digits"),
    "% width": ("{{ '%10000000000s' % 'x' }}", r"a format string with the number 10000000000"),
    "format width": ("{{ '{:10000000000}'.format('x') }}", r"a format string with the number 10000000000"),
    "format filter width": ("{{ '%10000000000s' | format('x') }}", r"a format string with the number"),
    "replace": ("{{ ('x' * 1000000) | replace('x', 'y' * 1000) }}", r"filter replace: up to 1000000 \* 1000"),
    "power": ("{{ 10 ** (10 ** 8) }}", r"\*\* of more than 65536 bits"),
    "float power": ("{{ 2.0 ** 5000 }}", r"OverflowError"),
    "1/0": ("{{ 1 / 0 }}", r"ZeroDivisionError: division by zero"),
    "'a' + 1": ("{{ 'a' + 1 }}", r"TypeError: can only concatenate str"),
    "include": ("{% include 'other.jinja' %}", r"TypeError: no loader"),
    "import": ("{% import 'other.jinja' as other %}", r"TypeError: no loader"),
    "recursion": ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", r"RecursionError"),
    "raise_exception": ("{{ raise_exception('no system role') }}", r"no system role\)$"),
}


@pytest.mark.parametrize("source, match", HOSTILE.values(), ids=HOSTILE.keys())
def test_hostile_templates_are_refused_by_name_quickly(source, match):
    template = compile_template(source, FILE)
    start = time.monotonic()
    with pytest.raises(ValueError, match=rf"^chat: the chat template of {FILE} failed \(.*{match}"):
        template.render(messages=MESSAGES)
    assert time.monotonic() - start < chat_template.MAX_SECONDS


def test_output_and_time_are_bounded(monkeypatch):
    """The output's length, and the deadline (a budget of 0 s: the first check refuses)."""
    monkeypatch.setattr(chat_template, "MAX_CHARS", 1000)
    big = compile_template("{% for m in range(30) %}{{ 'x' * 50 }}{% endfor %}", FILE)
    with pytest.raises(ValueError, match=r"more than 1000 characters of output"):
        big.render()
    monkeypatch.setattr(chat_template, "MAX_SECONDS", 0.0)
    with pytest.raises(ValueError, match=r"rendering took more than 0.0 s"):
        compile_template("{% for m in messages %}{{ m.content }}{% endfor %}", FILE).render(messages=MESSAGES)


def test_what_templates_do_still_renders():
    """Loops with ``loop``, filters, ``%``, ``~``, ``tojson``, namespaces, macros, string methods: as
    jinja2's sandbox renders them."""
    source = (
        "{% set ns = namespace(n=0) %}{% macro tag(r) %}<{{ r | upper }}>{% endmacro %}"
        "{% for m in messages if m.role != 'system' %}{% set ns.n = ns.n + 1 %}"
        "{{ tag(m['role']) }}{{ m.content ~ '!' }}{{ '%d/%d' % (loop.index, loop.length) }}"
        "{% if loop.last %}{{ messages | tojson }}{% endif %}{% endfor %}"
        "{{ ns.n }}{{ 'a-b'.split('-') | join(',') }}{{ 'ab' | replace('a', 'c') }}{{ '{:>3}'.format(7) }}"
    )
    rendered = compile_template(source, FILE).render(messages=MESSAGES)
    json = '[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"}]'
    assert rendered == f"<USER>hi!1/2<ASSISTANT>yes!2/2{json}2a,bcb  7"
