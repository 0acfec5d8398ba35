"""One of the two processes of test_two_processes.py: ``python two_processes_worker.py PROCESS_ID PORT N
[CHECKPOINT]``.

Joins the other through ``jax.distributed`` on localhost (CPU collectives, gloo), with 2 CPU devices of its
own. Without CHECKPOINT: the engine tests' model on a 2 x 2 mesh whose data axis spans the processes. With
CHECKPOINT (a directory): ``load_pretrained`` of it on a 1 x 4 mesh whose model axis spans the processes (each
process reads and places only its own devices' pieces), its bytes per local device printed as a JSON line
``HELD``. Generates with speculative steps of N tokens on the mesh and prints the tokens as a JSON line
``TOKENS``. jax's backend starts at ``initialize``: nothing is imported before that could start it."""

from __future__ import annotations

import collections
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

from engines import LOADED, NEW_TOKENS, SLOTS  # noqa: E402
from flax import nnx  # noqa: E402
from models import make_model, prompts  # noqa: E402

from jax_oc128 import load_pretrained  # noqa: E402
from jax_oc128.controller import ONLINE  # noqa: E402
from jax_oc128.engine import Engine  # noqa: E402
from jax_oc128.nn import sharding  # noqa: E402

assert jax.process_count() == 2 and jax.device_count() == 4 and jax.local_device_count() == 2
if len(sys.argv) > 4:
    mesh = sharding.make_mesh(1, 4)  # model: the 2 devices of process 0, then process 1's
    model = load_pretrained(sys.argv[4], mesh=mesh, **LOADED)
    held = collections.Counter()
    for leaf in jax.tree.leaves(nnx.state(model)):
        for shard in leaf.addressable_shards:
            held[shard.device.id] += shard.data.nbytes
    print("HELD", json.dumps(held), flush=True)
    requests = prompts(vocab=model.config.vocab_size)
else:
    mesh = sharding.make_mesh(2, 2)  # data: one row of devices per process; model: a process's 2 devices
    assert [{d.process_index for d in row} for row in mesh.devices] == [{0}, {1}]
    model, requests = make_model(ONLINE), prompts()
engine = Engine(model, SLOTS, prompt_bucket=256, mesh=mesh)
result = engine.generate(requests, NEW_TOKENS, num_tokens=int(sys.argv[3]))
print("TOKENS", json.dumps(result.tokens), flush=True)
jax.distributed.shutdown()
