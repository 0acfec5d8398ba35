"""Imports the native modules of jax_oc128 and registers their XLA FFI targets with jax.

The modules form their own top-level package, ``jax_oc128_native`` (``cpu`` always, ``cuda`` where nvcc was
found), which only ``pip install .`` creates: no source directory can shadow it, so the Python of a source
tree (``python -m jax_oc128`` from the repository root) finds the installed modules, and loading them does not
import :mod:`jax_oc128`. Such a tree may differ from the installed build, so :func:`check_operands` refuses
modules whose bindings take other operands than the Python passes.
"""

from __future__ import annotations

from typing import NamedTuple

import jax

REINSTALL = "reinstall with pip install . (from the repository root)"

try:
    from jax_oc128_native import cpu as _cpu
except ImportError as error:  # a source tree whose package was never installed
    raise ImportError(
        "jax_oc128's native CPU module (jax_oc128_native.cpu) is not installed: run pip install . "
        "from the repository root"
    ) from error

try:
    from jax_oc128_native import cuda as _cuda
except ImportError:  # built without nvcc, or JAX_OC128_CUDA=OFF
    _cuda = None


class Operands(NamedTuple):
    """The operand names of a target's binding, each kind in binding order."""

    args: tuple[str, ...]
    rets: tuple[str, ...]
    attrs: tuple[str, ...]


#: platform name (as in ``jax.lax.platform_dependent``) -> its native module
MODULES = {platform: module for platform, module in (("cpu", _cpu), ("cuda", _cuda)) if module is not None}

#: platform name -> names of the targets registered for it
TARGETS: dict[str, tuple[str, ...]] = {}

# (platform_dependent's name, XLA's platform name: jax >= 0.11 matches the latter case-sensitively)
for _platform, _xla_platform in (("cpu", "cpu"), ("cuda", "CUDA")):
    if _platform not in MODULES:
        continue
    _registrations = MODULES[_platform].registrations()
    for _name, _capsule in _registrations.items():
        jax.ffi.register_ffi_target(_name, _capsule, platform=_xla_platform)
    TARGETS[_platform] = tuple(sorted(_registrations))


def reported_operands(module) -> dict[str, Operands] | None:
    """``module.operands()`` as target name -> :class:`Operands`; None for a module that reports none."""
    if not hasattr(module, "operands"):
        return None
    return {
        target: Operands(**{kind: tuple(names) for kind, names in kinds.items()})
        for target, kinds in module.operands().items()
    }


def check_operands(expected: dict[str, Operands]) -> None:
    """Raise ImportError unless every loaded native module reports exactly ``expected``: the operand names of
    each target as this source's ops pass them."""
    for module in MODULES.values():
        reported = reported_operands(module)
        if reported != expected:
            raise ImportError(
                f"the installed native module of jax_oc128 does not match this source: {REINSTALL}\n"
                f"  {module.__name__} ({module.__file__}) takes {reported}\n  this source passes {expected}"
            )
