"""Two processes on localhost joined by ``jax.distributed`` (CPU collectives: gloo), 2 CPU devices each:
speculative greedy generation on a 2 x 2 mesh whose data axis spans the processes, and from a checkpoint in
DeepSeek's released format loaded onto a 1 x 4 mesh whose model axis spans them (several hosts' loading),
gives in both processes the tokens of one process on one device."""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys

from checkpoints import checkpoint, shares
from engines import LOADED, N, loaded_one_device, one_device

from jax_oc128 import load_pretrained
from jax_oc128.nn import sharding

HERE = pathlib.Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def run_workers(*args: str) -> list[str]:
    """The outputs of the two processes of ``two_processes_worker.py PROCESS_ID PORT *args``, each of
    which must succeed."""
    port = free_port()
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")]),
    )
    workers = [
        subprocess.Popen(
            [sys.executable, str(HERE / "two_processes_worker.py"), str(i), str(port), *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    outputs = [worker.communicate(timeout=300)[0] for worker in workers]
    for worker, output in zip(workers, outputs, strict=True):
        assert worker.returncode == 0, output[-5000:]
    return outputs


def printed(output: str, label: str):
    """The JSON value a worker printed after ``label``."""
    return json.loads(output.split(f"{label} ", 1)[1].splitlines()[0])


def test_two_processes_match_one():
    tokens = [printed(output, "TOKENS") for output in run_workers(str(N))]
    assert tokens[0] == tokens[1] == one_device(N)


def test_two_processes_load_a_released_checkpoint(tmp_path):
    """Each process places only its own devices' shards (the bytes each device must hold, measured per device,
    the model split over the 4 devices of both), and generation gives the one-device tokens."""
    directory = checkpoint("released", str(tmp_path))
    outputs = run_workers(str(N), directory)
    mesh = sharding.make_mesh(1, 4)
    share, total = shares(load_pretrained(directory, mesh=mesh, **LOADED), mesh)
    held = [printed(output, "HELD") for output in outputs]
    assert [len(h) for h in held] == [2, 2] and len({*held[0], *held[1]}) == 4  # 4 devices, 2 a process
    assert {b for h in held for b in h.values()} == {share} and share < total
    tokens = [printed(output, "TOKENS") for output in outputs]
    assert tokens[0] == tokens[1] == loaded_one_device(directory, N)
