"""Registers the native XLA FFI targets with jax, for every platform whose module imports."""

from __future__ import annotations

import jax

try:
    from jax_oc128 import _oc128_cpu
except ImportError as error:  # pragma: no cover - a source checkout that was never built
    raise ImportError(
        "jax_oc128's native CPU module is missing: install the package (pip install .) instead of "
        "importing it from the source tree"
    ) from error

try:
    from jax_oc128 import _oc128_cuda
except ImportError:  # built without nvcc, or JAX_OC128_CUDA=OFF
    _oc128_cuda = None

#: platform name (as in ``jax.lax.platform_dependent``) -> names of the targets registered for it
TARGETS: dict[str, tuple[str, ...]] = {}

# (platform_dependent's name, XLA's platform name: jax >= 0.11 matches the latter case-sensitively)
for _platform, _xla_platform, _module in (("cpu", "cpu", _oc128_cpu), ("cuda", "CUDA", _oc128_cuda)):
    if _module is None:
        continue
    _registrations = _module.registrations()
    for _name, _capsule in _registrations.items():
        jax.ffi.register_ffi_target(_name, _capsule, platform=_xla_platform)
    TARGETS[_platform] = tuple(sorted(_registrations))
