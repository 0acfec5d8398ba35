"""The grouped MoE dispatch, its experts split over the "model" axis (jax_oc128.nn.moe.expert_parallel),
on 4 CPU devices: one device's result, every device reading only its own experts (the compiled program sums
the devices' outputs and gathers nothing), alone under the mesh and inside the engine's per-slot shard_map."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_oc128.nn import moe, sharding

EXPERTS, HIDDEN, INTERMEDIATE, K, LIMIT = 8, 32, 16, 3, 10.0


def inputs(case):
    """``(x, expert_ids, weights, gate_up, down)`` of 2 x 6 tokens, routed at random or all alike."""
    rng = np.random.default_rng(0 if case == "random" else 1)
    x = rng.standard_normal((2, 6, HIDDEN))
    ids = np.stack([rng.permutation(EXPERTS)[:K] for _ in range(12)]).reshape(2, 6, K)
    if case == "skewed":  # every token to experts 0 and 1 (the first device's of the 1x4 mesh) and 5
        ids[:] = [1, 0, 5]
    weights = rng.random((2, 6, K)) + 0.1
    gate_up = rng.standard_normal((EXPERTS, 2 * INTERMEDIATE, HIDDEN)) * HIDDEN**-0.5 * 3
    down = rng.standard_normal((EXPERTS, HIDDEN, INTERMEDIATE)) * INTERMEDIATE**-0.5
    return tuple(
        jnp.asarray(a, jnp.int32 if a is ids else jnp.float32) for a in (x, ids, weights, gate_up, down)
    )


def grouped(*args):
    return moe.DISPATCHES["grouped"](*args, LIMIT)


@pytest.mark.parametrize("case", ["random", "skewed"])
@pytest.mark.parametrize("shape", [(1, 4), (2, 2)], ids=["1x4", "2x2"])
@pytest.mark.parametrize("nested", [False, True], ids=["alone", "per_slot"])
def test_experts_split_over_model_axis_equal_one_device(shape, case, nested):
    args = inputs(case)
    one_device = np.asarray(jax.jit(grouped)(*args))
    mesh = sharding.make_mesh(*shape)
    tokens = P("data") if nested else P()
    specs = (tokens, tokens, tokens, P("model"), P("model"))
    placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs, strict=True)]
    assert placed[3].addressable_shards[0].data.shape[0] == EXPERTS // shape[1]
    fn = grouped
    if nested:  # as the engine runs a step: each device's slots in a shard_map over "data", parameters whole
        fn = jax.shard_map(
            grouped,
            mesh=mesh,
            in_specs=(tokens, tokens, tokens, P(), P()),
            out_specs=tokens,
            axis_names={"data"},
            check_vma=False,
        )
    with jax.set_mesh(mesh):
        step = jax.jit(fn)
        out = np.asarray(step(*placed))
        hlo = step.lower(*placed).compile().as_text()
    np.testing.assert_allclose(out, one_device, rtol=0, atol=2e-6 * np.abs(one_device).max())
    assert "all-reduce" in hlo and "all-gather" not in hlo and "all-to-all" not in hlo
