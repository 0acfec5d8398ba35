import os

import jax
import pytest

# tests/multidevice needs 4 CPU devices from the start of its process: tests/test_multidevice.py runs it so
collect_ignore = ["multidevice"]


def pytest_collection_modifyitems(config, items):
    """`gpu` tests need a CUDA device; JAX_OC128_REQUIRE_GPU=1 makes a missing GPU a failure."""
    if jax.default_backend() == "gpu":
        return
    if os.environ.get("JAX_OC128_REQUIRE_GPU") == "1":
        raise pytest.UsageError("JAX_OC128_REQUIRE_GPU=1 but jax has no GPU backend")
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
