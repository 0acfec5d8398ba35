"""Runs tests/multidevice (the ops, the model and the engine on meshes of 4 devices), each module in a process
of its own: the device count is fixed when jax starts its backend, and this process keeps one device. On 4 CPU
devices always (also on a GPU host), and on the GPUs where the host has at least 4. One test per module, so
that pytest-xdist spreads the modules over its workers."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import jax
import pytest

HERE = pathlib.Path(__file__).resolve().parent
DEVICES = 4
MODULES = sorted(path.name for path in (HERE / "multidevice").glob("test_*.py"))


def gpus() -> int:
    try:
        return len(jax.devices("gpu"))
    except RuntimeError:
        return 0


@pytest.mark.parametrize(
    "platform",
    [
        "cpu",
        pytest.param(
            "gpu",
            marks=[
                pytest.mark.cuda,
                pytest.mark.skipif(gpus() < DEVICES, reason=f"needs {DEVICES} GPUs"),
            ],
        ),
    ],
)
@pytest.mark.parametrize("module", MODULES)
def test_multidevice(platform, module):
    # JAX_OC128_REQUIRE_GPU is about this process's devices: the child picks its platform itself
    env = {k: v for k, v in os.environ.items() if k != "JAX_OC128_REQUIRE_GPU"} | {
        "JAX_OC128_MESH_PLATFORM": platform
    }
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE / "multidevice" / module)],
        cwd=HERE.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-20000:] + done.stderr[-5000:]
