"""bench/step_kernels.py: a profiled step's kernels attributed to the model's named scopes, through the
op_name metadata of the compiled HLO."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import step_kernels
from flax import nnx

from jax_oc128.controller import ForwardMode
from jax_oc128.nn import SpeculativeModel
from jax_oc128.nn.attention import CSA, HCA, SLIDING
from jax_oc128.nn.config import ModelConfig
from jax_oc128.nn.moe import MOE


def test_scope_of_keeps_the_models_scopes_in_order():
    name = "jit(decode)/while/body/target/attention/compressor/closed_call/dot_general"
    assert step_kernels.scope_of(name) == "target/attention/compressor"
    assert step_kernels.scope_of("jit(decode)/while/body/add") == "-"


def test_decode_forward_kernels_attributed_to_scopes(tmp_path):
    """Every part of a decode forward of a model with each layer type, MoE and hyper-connections is found
    under its scope in the compiled module's op names, kernels (one per instruction here, of 1 us each) are
    summed per scope path, and a copy (a ``MemcpyD2D`` of the trace) is named by its instruction and type."""
    config = ModelConfig.tiny(layer_types=(SLIDING, CSA, HCA), mlp_layer_types=(MOE,) * 3, hc_mult=2)
    target = SpeculativeModel(config, rngs=nnx.Rngs(0)).target
    graphdef, params = nnx.split(target)
    cache = target.init_cache(2)
    tokens, positions = jnp.zeros((2, 1), jnp.int32), jnp.zeros((2, 1), jnp.int32)

    def forward(params, cache):
        with jax.named_scope("target"):
            return nnx.merge(graphdef, params)(tokens, positions, cache, mode=ForwardMode.DECODE)[0]

    text = jax.jit(forward).lower(params, cache).compile().as_text()
    (tmp_path / "module_0001.jit_decode.after_optimizations.txt").write_text(text)
    modules = step_kernels.hlo_op_names(tmp_path)
    (module,) = modules
    events = [dict(name=name, dur=1.0, args=dict(hlo_op=name, hlo_module=module)) for name in modules[module]]
    copied = next(name for name, (op_name, _) in modules[module].items() if "/lm_head/" in op_name)
    events.append(dict(name="MemcpyD2D", dur=1.0, args=dict(hlo_op=copied, hlo_module=module)))
    by_scope, counts, by_kernel, unknown = step_kernels.attribute(events, steps=1, modules=modules)
    label = f"MemcpyD2D {copied} {modules[module][copied][1]}"  # a copy: named by its instruction and type
    assert by_kernel["target/lm_head", label] == 1.0, [key for key in by_kernel if "Memcpy" in key[1]]
    expected = [
        "target/attention",
        "target/attention/compressor",
        "target/mlp/route",
        "target/mlp/routed_experts",
        "target/mlp/shared_expert",
        "target/hyper_connection",
        "target/lm_head",
    ]
    assert all(by_scope[scope] > 0 for scope in expected), by_scope
    assert sum(by_scope.values()) == sum(counts.values()) == len(events) and unknown < len(events)
