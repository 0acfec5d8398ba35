"""The tests of this directory run on 4 devices: CPU devices forced here before jax starts its backend, or
with ``JAX_OC128_MESH_PLATFORM=gpu`` the host's first 4 GPUs. They run in a process of their own
(``tests/test_multidevice.py`` starts it; by hand, ``pytest tests/multidevice``). A plain ``pytest`` does not
collect this directory (``tests/conftest.py``)."""

import os

import jax

DEVICES = 4

# the devices, and a quicker compilation (every comparison of these tests is between programs compiled alike)
FLAGS = (
    f"--xla_force_host_platform_device_count={DEVICES} --xla_backend_optimization_level=0 "
    "--xla_llvm_disable_expensive_passes=true"
)

PLATFORM = os.environ.get("JAX_OC128_MESH_PLATFORM", "cpu")
if PLATFORM == "cpu":
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FLAGS}"
elif PLATFORM != "gpu":
    raise ValueError(f"JAX_OC128_MESH_PLATFORM={PLATFORM!r}: must be cpu or gpu")
jax.config.update("jax_platforms", PLATFORM)
if jax.device_count() < DEVICES:
    raise RuntimeError(f"tests/multidevice needs {DEVICES} {PLATFORM} devices, jax has {jax.device_count()}")
