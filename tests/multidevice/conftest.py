"""The tests of this directory run on 4 CPU devices, forced here before jax starts its backend: they run in a
process of their own (``tests/test_multidevice.py`` starts it; by hand, ``pytest tests/multidevice``). A plain
``pytest`` does not collect this directory (``tests/conftest.py``)."""

import os

import jax

DEVICES = 4

# the devices, and a quicker compilation (every comparison of these tests is between programs compiled alike)
FLAGS = (
    f"--xla_force_host_platform_device_count={DEVICES} --xla_backend_optimization_level=0 "
    "--xla_llvm_disable_expensive_passes=true"
)

os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FLAGS}"
jax.config.update("jax_platforms", "cpu")
