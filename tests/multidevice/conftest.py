"""The tests of this directory run on 4 CPU devices, forced here before jax starts its backend: they run in a
process of their own (``tests/test_multidevice.py`` starts it; by hand, ``pytest tests/multidevice``). A plain
``pytest`` does not collect this directory (``tests/conftest.py``)."""

import os

import jax

DEVICES = 4

FLAG = f"--xla_force_host_platform_device_count={DEVICES}"

os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FLAG}"
jax.config.update("jax_platforms", "cpu")
