"""On a CUDA GPU: the CUDA handlers are the ones used, and they agree with the CPU handlers.

(The rest of the suite runs on the GPU too when it is the default backend: there every native op is
the CUDA handler and every reference op runs through XLA on the GPU.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import (
    NATIVE_VS_REFERENCE_BF16,
    NATIVE_VS_REFERENCE_FP32,
    assert_outputs_match,
    assert_state_close,
    poisoned_state,
)
from oracle import BLOCK, random_ape, random_tokens

import jax_oc128 as oc

pytestmark = pytest.mark.cuda
LAYERS, SLOTS, DIM, MAX_DRAFT = 4, 10, 512, 8


def on(device, *arrays):
    return [jax.device_put(x, device) for x in arrays]


def test_cuda_targets_are_registered_and_used():
    assert set(oc.ops.native_targets("cuda")) == set(oc.ops.OPERANDS)
    state = oc.init_state(1, 2, DIM, 2)
    args = (
        jnp.zeros((1, 2, 2, 2 * DIM)),
        jnp.zeros(2, jnp.int32),
        jnp.zeros(2, jnp.int32),
        jnp.zeros((1, BLOCK, DIM)),
    )
    hlo = jax.jit(oc.verify).lower(state, *args).compile().as_text()
    assert "oc128_verify" in hlo


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_cuda_matches_cpu(dtype):
    """A prefill with ragged and padding rows, a verify with lazy commits and a commit, on both devices."""
    tol = NATIVE_VS_REFERENCE_FP32 if dtype == jnp.float32 else NATIVE_VS_REFERENCE_BF16
    gpu, cpu = jax.devices("gpu")[0], jax.devices("cpu")[0]
    rng = np.random.default_rng(0)
    rows = 7
    state = poisoned_state(rng, LAYERS, SLOTS, DIM, MAX_DRAFT, dtype)
    ape = jnp.asarray(random_ape(rng, LAYERS - 1, DIM))
    kv = jnp.asarray(random_tokens(rng, (LAYERS - 1, rows, 3 * BLOCK + 5), DIM))
    seq = jnp.asarray([0, 5, 127, 128, 300, 0, 64], jnp.int32)
    new = jnp.asarray([389, 123, 1, 256, 0, 389, 300], jnp.int32)
    slots = jnp.asarray([3, 0, 9, -1, 5, 7, 1], jnp.int32)
    outputs = []
    for device in (gpu, cpu):
        s, e1, b1 = oc.compress(*on(device, state, kv, seq, new, slots, ape), layer=1)
        drafts = jnp.asarray(random_tokens(np.random.default_rng(1), (LAYERS - 1, rows, MAX_DRAFT), DIM))
        pending = jnp.asarray([-1, 250, -1, 120, -1, 2, -1, 380, -1, 125], jnp.int32)  # some lazy commits
        s, e2, b2 = oc.verify(*on(device, s, drafts, seq + new, slots, ape), layer=1, pending=pending)
        accept = jnp.asarray([0, 1, 2, 3, 8, 5, 4], jnp.int32)
        s = oc.commit(*on(device, s, seq + new, accept, slots))
        outputs.append([np.asarray(x) for x in (s, e1, b1, e2, b2)])
    (g_state, *g_rest), (c_state, *c_rest) = outputs
    assert_state_close(g_state, c_state, tol)
    assert_outputs_match((g_state, *g_rest[:2]), (c_state, *c_rest[:2]), tol)
    assert_outputs_match((g_state, *g_rest[2:]), (c_state, *c_rest[2:]), tol)
