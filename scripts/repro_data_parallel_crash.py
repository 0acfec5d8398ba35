"""The data-parallel segfault of issue 26, reduced to jax alone: on jax 0.11.2 (Shardy, the default
partitioner) XLA crashes compiling a ``shard_map`` that is manual over the mesh's ``"data"`` axis only
(``"model"`` left to the partitioner) when one of its operands is a zero-sized array (here ``f32[4, 0, 32]``,
as the engine's state holds for the compressed caches of its sliding-attention layers) and another is not. It
runs on jax 0.10.2, on a ``data`` axis of 1 (the 1x4 mesh), with ``JAX_USE_SHARDY_PARTITIONER=0`` (GSPMD), and
when the zero-sized operand is alone.

The HLO XLA dumps (``XLA_FLAGS=--xla_dump_to=/tmp/dump --xla_dump_hlo_pass_re=.*``) shows where: its last
module before the crash is ``spmd-partitioner.after_zero_sized_hlo_elimination``, where the zero-sized operand
of the shard_map's ``xla.sdy.GlobalToLocalShape`` custom call has become an unsharded constant (its ``"data"``
split gone, sharding ``[{?}, {?}, {?}]`` next to ``[{'data', ?}, {?}]`` of the other operand); the partitioner
then crashes on it.

Run (a segmentation fault, exit status 139, on jax 0.11.2; "OK" on jax 0.10.2)::

    python scripts/repro_data_parallel_crash.py            # mesh data=4, model=1
    python scripts/repro_data_parallel_crash.py 2 2        # data=2, model=2: crashes too
    python scripts/repro_data_parallel_crash.py 1 4        # data=1: OK
    JAX_USE_SHARDY_PARTITIONER=0 python scripts/repro_data_parallel_crash.py   # GSPMD: OK
"""

import os
import sys

os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4"

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

jax.config.update("jax_platforms", "cpu")
data, model = (int(n) for n in sys.argv[1:3]) if len(sys.argv) > 2 else (4, 1)
mesh = jax.make_mesh((data, model), ("data", "model"))
identity = jax.shard_map(
    lambda empty, full: (empty, full),
    mesh=mesh,
    in_specs=P("data"),
    out_specs=P("data"),
    axis_names={"data"},
)
empty, full = np.zeros((4, 0, 32), np.float32), np.ones((4, 8), np.float32)
jax.jit(identity).lower(empty, full).compile()
print(f"OK: jax {jax.__version__}, mesh data={data}, model={model}")
