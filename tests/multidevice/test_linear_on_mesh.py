"""A quantized linear layer split over the "model" axis (jax_oc128.nn.linear.tensor_parallel) on 4 CPU
devices: the float64 product of its dequantized weight, each device holding and reading only its own part
(the compiled program gathers nothing; a split of the inputs sums the devices' partial products), with the
kernel (interpret mode) or its jnp twin on each device."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from quantization import assert_float32_sum, float64_linear, quantized

from jax_oc128.nn import linear, sharding
from jax_oc128.nn.quant import FP4, FP8

IN, OUT, GROUPS = 512, 256, 4

#: parameter path -> (weight shape, groups): the outputs split, by groups, and the inputs split
CASES = {
    ("attn", "q_b_proj"): ((OUT, IN), None),
    ("attn", "o_a_proj"): ((GROUPS * 64, IN // GROUPS), GROUPS),
    ("attn", "o_b_proj"): ((OUT, IN), None),
}


@pytest.mark.parametrize("fmt", [FP8, FP4])
@pytest.mark.parametrize("name", list(CASES), ids=lambda name: name[-1])
@pytest.mark.parametrize("shape", [(1, 4), (2, 2)], ids=["1x4", "2x2"])
@pytest.mark.parametrize("kernel", [False, True], ids=["jnp", "kernel"])
def test_linear_split_over_model_axis(shape, name, fmt, kernel, monkeypatch):
    if kernel:  # every weight to the kernel, interpreted on the CPU
        monkeypatch.setattr(linear, "LINEAR_KERNEL_PARAMS", 0)
        interpreted = functools.partial(linear.linear_pallas, interpret=True)
        monkeypatch.setattr(linear, "linear_pallas", interpreted)
        monkeypatch.setattr(linear, "per_platform", lambda cuda, default, *a, **k: cuda(*a, **k))
    (out, width), groups = CASES[name]
    rng = np.random.default_rng(0)
    weight = quantized(rng.standard_normal((1, out, width)) / 16, fmt, "e8m0", "float32")[0]
    x = jnp.asarray(rng.standard_normal((2, 3, *((groups,) if groups else ()), width)), jnp.float32)
    want, magnitudes = float64_linear(x, weight, groups, magnitudes=True)

    mesh = sharding.make_mesh(*shape)
    spec = sharding.param_spec(name, weight, mesh)
    placed = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), weight, spec)
    devices = shape[1]
    assert placed.codes.addressable_shards[0].data.size == weight.codes.size // devices  # its part only
    layer = jax.jit(functools.partial(linear.linear, groups=groups, name=name))
    with jax.set_mesh(mesh):
        got = np.asarray(layer(x, placed))
        hlo = layer.lower(x, placed).compile().as_text()
    assert_float32_sum(got, want, magnitudes, width)
    assert "all-gather" not in hlo and "all-to-all" not in hlo
    assert ("all-reduce" in hlo) == (name == ("attn", "o_b_proj"))  # the inputs split: partial sums


@pytest.mark.parametrize("case", ["unnamed", "groups cut"])
def test_splits_the_kernel_cannot_take_are_partitioned_by_xla(case):
    """Without its parameter path the layer cannot know the split, and 2 groups split over 4 devices cut each
    group in two: then XLA partitions the dequantized matmul, the same product."""
    groups = None if case == "unnamed" else 2
    shape = (OUT, IN) if groups is None else (groups * 64, IN // groups)
    weight = quantized(np.random.default_rng(1).standard_normal((1, *shape)) / 16, FP8, "e8m0", "float32")[0]
    name = ("attn", "q_b_proj" if groups is None else "o_a_proj")
    mesh = sharding.make_mesh(1, 4)
    spec = sharding.param_spec(name, weight, mesh)
    assert spec.codes == P("model", None)
    placed = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), weight, spec)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((2, *((groups,) if groups else ()), shape[1])))
    layer = functools.partial(linear.linear, groups=groups, name=None if groups is None else name)
    with jax.set_mesh(mesh):
        got = np.asarray(jax.jit(layer)(x.astype(jnp.float32), placed))
    want, magnitudes = float64_linear(x, weight, groups, magnitudes=True)
    assert_float32_sum(got, want, magnitudes, shape[1])
