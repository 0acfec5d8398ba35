"""Prints, as JSON, what the Bazel build takes from the Python that runs it (bazel/configure.bzl): the
interpreter, its C headers and extension suffix, nanobind's directory (sources and headers, from its wheel)
and the XLA FFI headers shipped with jaxlib."""

import json
import pathlib
import sys
import sysconfig

try:
    import nanobind
    from jax import ffi
except ImportError as error:
    sys.exit(f"{sys.executable}: {error}; the Bazel build needs jax and nanobind installed in this Python")

print(
    json.dumps(
        {
            "python": sys.executable,
            "python_include": sysconfig.get_paths()["include"],
            "ext_suffix": sysconfig.get_config_var("EXT_SUFFIX"),
            "nanobind": str(pathlib.Path(nanobind.include_dir()).parent),
            "xla_ffi_include": ffi.include_dir(),
        }
    )
)
