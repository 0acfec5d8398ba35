"""The three ops on their own: prefill two requests, then one speculative round (verify 4 tokens, keep some),
inside jit with the state donated, checked against the jnp reference.

Run: python examples/online_c128_ops.py
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import jax_oc128 as oc

LAYERS, SLOTS, DIM, MAX_DRAFT = 3, 4, 512, 4


@functools.partial(jax.jit, donate_argnames="state")
def prefill(state, kv_score, lengths, slots, ape):
    zeros = jnp.zeros_like(lengths)
    return oc.compress(state, kv_score, zeros, lengths, slots, ape)  # all layers in one launch


@functools.partial(jax.jit, donate_argnames="state")
def speculative_round(state, kv_score, seq_lens, slots, ape, accept_lens):
    state, entries, entry_blocks = oc.verify(state, kv_score, seq_lens, slots, ape)
    # ... the model's verify forward would attend to `entries` here and decide the accept lengths ...
    return oc.commit(state, seq_lens, accept_lens, slots), entries, entry_blocks


def main():
    rng = np.random.default_rng(0)
    ape = jnp.asarray(rng.normal(size=(LAYERS, 128, DIM)), jnp.float32)
    prompt = jnp.asarray(rng.normal(size=(LAYERS, 2, 300, 2 * DIM)), jnp.float32)  # [kv | score] per token
    lengths, slots = jnp.asarray([300, 126], jnp.int32), jnp.asarray([2, 0], jnp.int32)

    state = oc.init_state(LAYERS, SLOTS, DIM, MAX_DRAFT)
    expected = oc.reference.compress(state, prompt, jnp.zeros(2, jnp.int32), lengths, slots, ape)
    state, entries, entry_blocks = prefill(state, prompt, lengths, slots, ape)
    print("prefill closed blocks:", np.asarray(entry_blocks).tolist())
    print("max |native - reference| of the entries:", float(jnp.max(jnp.abs(entries - expected[1]))))

    drafts = jnp.asarray(rng.normal(size=(LAYERS, 2, MAX_DRAFT, 2 * DIM)), jnp.float32)
    accept = jnp.asarray([3, 4], jnp.int32)  # request 1 keeps all 4 tokens: its block closes at position 127
    state, entries, entry_blocks = speculative_round(state, drafts, lengths, slots, ape, accept)
    print(
        "verify closed blocks:",
        np.asarray(entry_blocks)[:, 0].tolist(),
        " new lengths:",
        (lengths + accept).tolist(),
    )


if __name__ == "__main__":
    main()
