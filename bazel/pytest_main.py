"""The main of the Bazel py_tests (bazel/defs.bzl's pytest_test): pytest on the test files given as arguments,
after checking that Python imports jax_oc128 and every native module it loads from this test's runfiles (the
Bazel build of this repository), not from an installed copy."""

import pathlib
import sys

import pytest


def main() -> int:
    repository = pathlib.Path(__file__).parents[1]  # this repository in the runfiles, symlinks unresolved
    import jax_oc128
    from jax_oc128 import _native

    for module in (jax_oc128, *_native.MODULES.values()):
        path = pathlib.Path(module.__file__)
        if repository not in path.parents:
            sys.exit(f"{module.__name__} is imported from {path}, not from the runfiles {repository}")
        print(f"{module.__name__}: {path.relative_to(repository)} (this build)")
    return pytest.main(["-p", "no:cacheprovider", *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(main())
