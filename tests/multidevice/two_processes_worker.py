"""One of the two processes of test_two_processes.py: ``python two_processes_worker.py PROCESS_ID PORT N``.

Joins the other through ``jax.distributed`` on localhost (CPU collectives, gloo), with 2 CPU devices of its
own: a 2 x 2 mesh whose data axis spans the processes. Generates with speculative steps of N tokens on it and
prints the tokens as a JSON line. jax's backend starts at ``initialize``: nothing is imported before that
could start it."""

from __future__ import annotations

import json
import os
import re
import sys

import jax

# the parent's XLA flags (those its reference was compiled with), 2 devices instead of its 4
flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=2"
jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"localhost:{sys.argv[2]}", num_processes=2, process_id=int(sys.argv[1]))

from engines import NEW_TOKENS, SLOTS  # noqa: E402
from models import make_model, prompts  # noqa: E402

from jax_oc128.controller import ONLINE  # noqa: E402
from jax_oc128.engine import Engine  # noqa: E402
from jax_oc128.nn import sharding  # noqa: E402

assert jax.process_count() == 2 and jax.device_count() == 4 and jax.local_device_count() == 2
mesh = sharding.make_mesh(2, 2)  # data: one row of devices per process; model: a process's 2 devices
assert [{d.process_index for d in row} for row in mesh.devices] == [{0}, {1}]
engine = Engine(make_model(ONLINE), SLOTS, prompt_bucket=256, mesh=mesh)
result = engine.generate(prompts(), NEW_TOKENS, num_tokens=int(sys.argv[3]))
print("TOKENS", json.dumps(result.tokens), flush=True)
jax.distributed.shutdown()
