"""``load_pretrained(path, mesh=...)`` on meshes of 4 CPU devices (data x model: 1x4, 2x2): a float checkpoint
(transformers' names, the experts stacked) and one in DeepSeek's released format (FP8 linears, FP4 experts
one tensor per expert, :mod:`jax_oc128.released`) load straight into the engine's layout, each device
holding exactly its share of every parameter (measured per device), with the logits of the one-device load;
an engine on that mesh takes the parameters as they are (no transfer)."""

from __future__ import annotations

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checkpoints import checkpoint, shares
from flax import nnx
from hf_fixtures import fixture
from jax.sharding import PartitionSpec as P
from oracle import rel_err

from jax_oc128 import load_pretrained
from jax_oc128.engine import Engine
from jax_oc128.nn import sharding
from jax_oc128.nn.quant import QuantizedArray

MESHES = [(1, 4), (2, 2)]
KINDS = ["float", "released"]
PROMPT_LENGTH = 136  # a closed C128 block, and CSA blocks


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("sharded_load"))


@functools.partial(jax.jit, static_argnames="graphdef")
def prefill_logits(graphdef, params, tokens):
    model = nnx.merge(graphdef, params)
    batch, length = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    return model(tokens, positions, model.init_cache(batch))[0]


def logits(model) -> np.ndarray:
    """The target's float32 logits of a prefill of the fixture's prompts (136 tokens)."""
    tokens = jnp.asarray(fixture("small_window")[2]["prompt"][:, :PROMPT_LENGTH])
    graphdef, params = nnx.split(model.target)
    return np.asarray(prefill_logits(graphdef, params, tokens))


@functools.cache
def one_device(kind: str, root: str) -> np.ndarray:
    return logits(load_pretrained(checkpoint(kind, root), dtype="float32", max_len=512, max_draft=4))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", MESHES, ids=[f"{d}x{m}" for d, m in MESHES])
def test_sharded_load_gives_one_devices_logits_and_each_device_its_share(root, kind, shape):
    mesh = sharding.make_mesh(*shape)
    model = load_pretrained(checkpoint(kind, root), dtype="float32", max_len=512, max_draft=4, mesh=mesh)
    state = nnx.state(model)
    placement = sharding.named(sharding.param_specs(state, mesh), mesh)
    for leaf, want in zip(jax.tree.leaves(state), jax.tree.leaves(placement), strict=True):
        assert leaf.sharding == want
    experts = model.target.blocks[1].moe.experts_gate_up[...]
    if kind == "released":
        assert isinstance(experts, QuantizedArray)
        o_b = model.target.blocks[1].attn.o_b_proj[...]
        assert o_b.scales.sharding.spec == P(None, "model")  # 4 whole blocks of columns: split with its codes
        experts = experts.codes
    assert experts.sharding.spec == P("model", None, None)
    held = collections.Counter()
    for leaf in jax.tree.leaves(state):
        for shard in leaf.addressable_shards:
            held[shard.device] += shard.data.nbytes
    share, total = shares(model, mesh)
    print(f"\n{kind} on {shape[0]}x{shape[1]}: {share} bytes per device of {total} ({share / total:.1%})")
    assert set(held) == set(mesh.devices.flat) and set(held.values()) == {share}
    assert share < total
    error = rel_err(logits(model), one_device(kind, root))
    print(f"logits vs one device: rel. error {error:.1e}")
    assert error < 1e-5
    engine = Engine(model, slots=shape[0], mesh=mesh)  # the parameters as loaded: nothing moved
    for leaf, placed in zip(jax.tree.leaves(state), jax.tree.leaves(engine.params), strict=True):
        assert placed.sharding == leaf.sharding
        assert [s.data.unsafe_buffer_pointer() for s in placed.addressable_shards] == [
            s.data.unsafe_buffer_pointer() for s in leaf.addressable_shards
        ]
