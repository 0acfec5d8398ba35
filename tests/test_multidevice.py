"""Runs tests/multidevice (the ops, the model and the engine on meshes of 4 CPU devices) in a process of its
own: the device count is fixed when jax starts its backend, and this process keeps one device."""

from __future__ import annotations

import pathlib
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent


def test_multidevice():
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE / "multidevice")],
        cwd=HERE.parent,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-20000:] + done.stderr[-5000:]
