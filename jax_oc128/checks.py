"""Checks of Python (static) arguments, shared by the ops and the engine: one rule and one wording."""

from __future__ import annotations

import argparse

import numpy as np


class NamedError(Exception):
    """An error of one argument: ``argument`` names it and the message starts with ``"{argument}: "``, so a
    caller can say it in its own words (the server's field, the command line's flag) without parsing the
    message. Raised as one of its subclasses, each also the builtin error it refines."""

    def __init__(self, argument: str, message: str):
        super().__init__(f"{argument}: {message}")
        self.argument = argument


class ArgumentError(NamedError, ValueError):
    """A bad value of the argument ``argument`` (a ValueError)."""


class ArgumentTypeError(NamedError, TypeError):
    """An argument ``argument`` of the wrong type (a TypeError)."""


class ArgumentNotSupported(NamedError, NotImplementedError):
    """A value of the argument ``argument`` that this model or build does not support (a
    NotImplementedError)."""


def is_int(value) -> bool:
    """An integer (Python or numpy), not a bool."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def check_int(name: str, value, low: int, high: int | None = None, bound: str = "") -> int:
    """``value`` as an int: :class:`ArgumentTypeError` unless an int (bools refused), :class:`ArgumentError`
    below ``low`` or above ``high`` (None: no upper bound; ``bound`` says what ``high`` is, e.g.
    " = max_draft"), both naming ``name``."""
    if not is_int(value):
        raise ArgumentTypeError(name, f"must be an int, got {value!r}")
    if high is None and value < low:
        raise ArgumentError(name, f"must be >= {low}, got {value}")
    if high is not None and not low <= value <= high:
        raise ArgumentError(name, f"must be in [{low}, {high}{bound}], got {value}")
    return int(value)


def check_scale(scale) -> None:
    """:class:`ArgumentTypeError` (``scale``) unless ``scale`` is a finite Python number (an op's static
    attribute)."""
    if not isinstance(scale, (int, float)) or not np.isfinite(scale):
        raise ArgumentTypeError("scale", f"must be a finite Python number, got {scale!r}")


def check_token_ids(value, vocab: int, where: str) -> tuple[int, ...]:
    """A config's token ids (``value``: an int or a list of ints, JSON's) in [0, ``vocab``), as a tuple
    without repeats; ValueError starting with ``where`` (the file and the field) otherwise."""
    ids = value if isinstance(value, list) else [value]
    for i in ids:
        if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < vocab:
            raise ValueError(f"{where}: must be a token id in [0, {vocab}) or a list of them, got {value!r}")
    return tuple(dict.fromkeys(ids))


def int_argument(low: int, high: int | None = None):
    """An argparse type: the text as an int in ``[low, high]`` (``high`` None: no upper bound), refused with
    :func:`check_int`'s wording (``argparse.ArgumentTypeError``; argparse names the flag)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an int, got {text!r}") from None
        if value < low or (high is not None and value > high):
            bound = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value

    return parse


def add_backend_argument(parser: argparse.ArgumentParser) -> None:
    """A command's ``--backend``: the C128 compressor state (a name of
    :data:`~jax_oc128.controller.BACKENDS`), online by default; :func:`check_backend` its rule."""
    from jax_oc128.controller import BACKENDS, ONLINE

    help_ = "the C128 compressor state (offline: the baseline, which verifies chains only)"
    parser.add_argument("--backend", choices=list(BACKENDS), default=ONLINE.name, help=help_)


def check_backend(parser: argparse.ArgumentParser, backend: str, trees: bool) -> None:
    """Refuse with ``parser`` (argparse's error naming ``--tree`` and ``--backend``) tree speculation
    (``trees``) on the offline C128 state ``backend``, which verifies chains only."""
    if trees and backend == "offline":
        parser.error(
            "argument --tree: tree speculation runs on the online C128 state only (--backend online)"
        )


#: the most characters of a file's or a user's string that a message shows (:func:`shown`)
MAX_SHOWN = 200


def shown(text: str, limit: int = MAX_SHOWN) -> str:
    """``text`` (a string from a file or a user: a tensor name, a field) as a message shows it: every
    character that is not printable (NUL, ESC, a newline, a right-to-left mark, a lone surrogate) and the
    backslash escaped as Python writes them (``\\x1b``, ``\\n``, ``\\u202e``), so that it cannot forge a line
    or hide itself; at most ``limit`` characters, then ``...`` and its length."""
    escaped = "".join(
        c if c.isprintable() and c != "\\" else c.encode("unicode_escape", "backslashreplace").decode("ascii")
        for c in text[:limit]
    )
    return escaped + (f"... ({len(text)} characters)" if len(text) > limit else "")
