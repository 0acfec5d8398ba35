"""The parameter rules of jax_oc128.nn.sharding on the full DeepSeek-V4 decoder (MoE, hyper-connections, CSA)
and its MTP head, shapes only: what the model axis splits, what stays whole."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from hf_fixtures import fixture
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from jax_oc128.loading.names import parameter_paths
from jax_oc128.nn import ModelConfig, SpeculativeModel, sharding, weights
from jax_oc128.nn.functional import build_abstract
from jax_oc128.nn.quant import FP4, FP8, QuantizedArray


def specs(model_size):
    config = ModelConfig.from_hf(fixture("small_window")[0])  # 4 heads, 2 o-groups, 4 experts
    model = nnx.eval_shape(lambda: SpeculativeModel(config, rngs=nnx.Rngs(0)))
    specs = sharding.param_specs(nnx.state(model), AbstractMesh((2, model_size), ("data", "model")))
    flat = jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: isinstance(x, P))[0]
    return {sharding.path_names(path): spec for path, spec in flat}


def test_the_model_axis_splits_heads_groups_experts_hidden_and_vocabulary():
    by_path = specs(2)
    block = ("target", "blocks", "1")  # a CSA layer with a top-k MoE
    assert by_path[(*block, "attn", "q_b_proj")] == P("model", None)
    assert by_path[(*block, "attn", "sinks")] == P("model")
    assert by_path[(*block, "attn", "o_a_proj")] == P("model", None)
    assert by_path[(*block, "attn", "o_b_proj")] == P(None, "model")
    assert by_path[(*block, "moe", "experts_gate_up")] == P("model", None, None)
    assert by_path[(*block, "moe", "experts_down")] == P("model", None, None)
    assert by_path[(*block, "moe", "shared_down")] == P(None, "model")
    # the MTP layer's MoE
    assert by_path[("mtp", "block", "moe", "experts_gate_up")] == P("model", None, None)
    assert by_path[("mtp", "block", "moe", "shared_down")] == P(None, "model")
    assert by_path[("mtp", "lm_head")] == P("model", None)  # shared with the target
    for whole in (
        (*block, "attn", "kv_proj"),  # one KV head
        (*block, "attn", "compressor", "kv_proj"),
        (*block, "moe", "router_weight"),
        (*block, "attn_hc", "fn"),
        ("target", "blocks", "2", "attn", "compressor", "kv_proj"),  # the HCA (C128) compressor
        ("mtp", "embed"),
    ):
        assert by_path[whole] == P(), whole


def test_a_dimension_the_model_axis_does_not_divide_stays_whole():
    by_path = specs(3)  # 4 heads, 4 experts: not divisible by 3
    assert by_path[("target", "blocks", "1", "attn", "sinks")] == P(None)
    assert by_path[("target", "blocks", "1", "moe", "experts_gate_up")] == P(None, None, None)


def test_quantized_parameters_split_their_scales_with_their_codes():
    """A QuantizedArray's codes split by its rule, its per-row scales alike along rows and leading axes, and
    along columns only where each device's columns are whole scale groups (else whole); its path names drop
    the codes' and scales' own."""
    mesh = AbstractMesh((1, 4), ("data", "model"))

    def spec(names, codes, scales, fmt, codes_dtype=jnp.float8_e4m3fn):
        x = QuantizedArray(
            jax.ShapeDtypeStruct(codes, codes_dtype), jax.ShapeDtypeStruct(scales, jnp.uint8), fmt, "float32"
        )
        got = sharding.param_spec(names, x, mesh)
        return got.codes, got.scales

    attn = ("target", "blocks", "1", "attn")
    assert spec((*attn, "q_b_proj"), (128, 136), (128, 2), FP8) == (P("model", None), P("model", None))
    assert spec((*attn, "o_b_proj"), (32, 512), (32, 4), FP8) == (P(None, "model"), P(None, "model"))
    assert spec((*attn, "o_b_proj"), (32, 64), (32, 1), FP8) == (P(None, "model"), P(None, None))
    experts = ("target", "blocks", "1", "moe", "experts_down")
    fp4 = spec(experts, (4, 32, 16), (4, 32, 1), FP4, jnp.uint8)
    assert fp4 == (P("model", None, None), P("model", None, None))
    path = (
        jax.tree_util.DictKey("o_b_proj"),
        jax.tree_util.GetAttrKey("value"),
        jax.tree_util.GetAttrKey("scales"),
    )
    assert sharding.path_names(path) == ("o_b_proj",)


def test_each_parameter_is_declared_once():
    """Every parameter of the full DeepSeek-V4 model and its MTP layer has exactly one declaration in
    jax_oc128.nn.weights (one transformers name each, and each name one parameter), and each rule of
    PARAM_RULES is a declared parameter's logical axes."""
    config = ModelConfig.from_hf(fixture("small_window")[0])
    model = build_abstract(lambda rngs: SpeculativeModel(config, rngs=rngs))
    state = nnx.state(model)
    declared = parameter_paths(model)
    shared = {("mtp", "embed"): ("target", "embed"), ("mtp", "lm_head"): ("target", "lm_head")}  # (the
    # MTP layer shares the target's embedding and head; the state keeps each under its first path)
    params = {
        shared.get(names, names)
        for names in (
            tuple(str(step) for step in sharding.path_names(path))
            for path, _ in jax.tree_util.tree_flatten_with_path(state)[0]
        )
    }
    paths = [tuple(str(step) for step in path) for path in declared.values()]
    assert len(set(paths)) == len(paths) and set(paths) == params
    scopes = (weights.TOP, weights.LAYER, weights.MTP)
    for scope in scopes:
        names = [w.hf for w in scope if w.hf is not None] + [n for w in scope for n in w.deepseek]
        attributes = [w.path for w in scope]
        assert len(set(attributes)) == len(attributes)
        assert len({w.hf for w in scope if w.hf is not None}) == sum(w.hf is not None for w in scope), names
    rules = {tail for tail, _ in sharding.PARAM_RULES}
    assert rules == {w.path for scope in scopes for w in scope if w.axes}
