import os

import jax
import pytest


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
