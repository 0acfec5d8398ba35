"""Checks of Python (static) arguments, shared by the ops and the engine: one rule and one wording."""

from __future__ import annotations

import numpy as np


def is_int(value) -> bool:
    """An integer (Python or numpy), not a bool."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def check_int(name: str, value, low: int, high: int | None = None, bound: str = "") -> int:
    """``value`` as an int: ``TypeError`` unless an int (bools refused), ``ValueError`` below ``low`` or above
    ``high`` (None: no upper bound; ``bound`` says what ``high`` is, e.g. " = max_draft"). The messages
    start with ``name``."""
    if not is_int(value):
        raise TypeError(f"{name}: must be an int, got {value!r}")
    if high is None and value < low:
        raise ValueError(f"{name}: must be >= {low}, got {value}")
    if high is not None and not low <= value <= high:
        raise ValueError(f"{name}: must be in [{low}, {high}{bound}], got {value}")
    return int(value)
