"""Two processes on localhost joined by ``jax.distributed`` (CPU collectives: gloo), 2 CPU devices each, one
2 x 2 mesh whose data axis spans the processes: speculative greedy generation gives, in both processes, the
tokens of one process on one device."""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys

from engines import N, one_device

HERE = pathlib.Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_two_processes_match_one():
    port = free_port()
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")]),
    )
    workers = [
        subprocess.Popen(
            [sys.executable, str(HERE / "two_processes_worker.py"), str(i), str(port), str(N)],
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
    tokens = [json.loads(output.split("TOKENS ", 1)[1]) for output in outputs]
    assert tokens[0] == tokens[1] == one_device(N)
