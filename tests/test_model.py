"""The model owns one compressed state for all its C128 layers: what each forward launches, counted in the
compiled HLO. The speculative model's draft head is the registered head its config calls for, or the one
named."""

from __future__ import annotations

import collections
import dataclasses
import functools
import re

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from models import MODEL_CONFIG, MODEL_RUNTIME

from jax_oc128.controller import OFFLINE, ONLINE, ForwardMode, backend_of
from jax_oc128.nn import (
    CSA,
    HCA,
    SLIDING,
    DeepseekV4Model,
    DeepseekV4MTP,
    ModelConfig,
    MTPHead,
    SpeculativeModel,
    default_draft_head,
)
from jax_oc128.nn.functional import build_abstract
from jax_oc128.nn.moe import MOE
from jax_oc128.registry import drafter_class
from jax_oc128.tree import Tree

TOKENS = {ForwardMode.EXTEND: 8, ForwardMode.DECODE: 1, ForwardMode.TARGET_VERIFY: 4}


def custom_calls(hlo: str) -> collections.Counter:
    """Custom-call targets of a compiled HLO module, counted."""
    return collections.Counter(re.findall(r'custom_call_target="(oc128_\w+)"', hlo))


def compiled_forward(model, mode, batch=3):
    tokens = TOKENS[mode]
    graphdef, params = nnx.split(model)

    def forward(params, cache, tokens, positions):
        return nnx.merge(graphdef, params)(tokens, positions, cache, mode=mode)

    ids = jnp.zeros((batch, tokens), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(tokens, dtype=jnp.int32) + 130, (batch, tokens))
    return jax.jit(forward, donate_argnums=1).lower(params, model.init_cache(batch), ids, positions).compile()


def test_model_holds_one_compressed_state_for_its_c128_layers():
    cache = DeepseekV4Model(MODEL_CONFIG, MODEL_RUNTIME, rngs=nnx.Rngs(0)).init_cache(2)
    assert cache.compressed.layers == 3 and cache.compressed.slots == 2
    assert len(cache.layers) == 4 and all(not hasattr(layer, "compressed") for layer in cache.layers)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", list(TOKENS), ids=[m.value for m in TOKENS])
def test_one_native_call_per_c128_layer_and_at_most_one_commit(mode):
    """Extend and decode: one compress per C128 layer and one commit for all layers (the pending verify,
    if any, in one launch). Verify: one verify per C128 layer, each committing its own layer's pending
    verify inside the kernel, and no commit launch at all."""
    calls = custom_calls(
        compiled_forward(DeepseekV4Model(MODEL_CONFIG, MODEL_RUNTIME, rngs=nnx.Rngs(0)), mode).as_text()
    )
    layers = MODEL_CONFIG.compressed_layers
    if mode is ForwardMode.TARGET_VERIFY:
        assert calls == {"oc128_verify": layers}
    else:
        assert calls == {"oc128_compress": layers, "oc128_commit": 1}


def test_eager_commit_is_one_launch_for_all_layers():
    model = DeepseekV4Model(MODEL_CONFIG, MODEL_RUNTIME, rngs=nnx.Rngs(0))
    batch = 3
    seq_lens = jnp.full((batch,), 130, jnp.int32)
    commit = jax.jit(model.commit, donate_argnums=0).lower(model.init_cache(batch), seq_lens, seq_lens)
    assert custom_calls(commit.compile().as_text()) == {"oc128_commit": 1}


def test_backend_must_be_an_object():
    with pytest.raises(TypeError, match="backend"):
        DeepseekV4Model(MODEL_CONFIG, MODEL_RUNTIME, backend="online", rngs=nnx.Rngs(0))
    assert DeepseekV4Model(MODEL_CONFIG, MODEL_RUNTIME, backend=ONLINE, rngs=nnx.Rngs(0)).backend is ONLINE


@pytest.mark.parametrize("backend", [ONLINE, OFFLINE], ids=["online", "offline"])
def test_the_cache_state_names_its_controller(backend):
    """No layer holds a backend: the model's cache holds its backend's state, whose type names it."""
    model = DeepseekV4Model(MODEL_CONFIG, MODEL_RUNTIME, backend=backend, rngs=nnx.Rngs(0))
    layers = [
        module for block in model.blocks for module in (block.attn, getattr(block.attn, "compressor", None))
    ]
    assert not any(hasattr(module, "backend") for module in layers)
    assert backend_of(model.init_cache(2).compressed) is backend
    with pytest.raises(TypeError, match=r"^compressed: a CompressState or OfflineState"):
        backend_of(model.init_cache(2))


@pytest.mark.parametrize(
    "config, head",
    [(MODEL_CONFIG, MTPHead), (ModelConfig.tiny(hc_mult=2, mlp_layer_types=(MOE,) * 4), DeepseekV4MTP)],
    ids=["one-stream", "hyper-connections"],
)
def test_draft_head_is_the_registered_head_the_config_calls_for(config, head):
    model = nnx.eval_shape(lambda: SpeculativeModel(config, rngs=nnx.Rngs(0)))
    assert type(model.mtp) is drafter_class(default_draft_head(config)) is head
    assert model.drafter is model.mtp
    assert model.mtp.embed is model.target.embed and model.mtp.lm_head is model.target.lm_head
    no_head = ModelConfig.tiny(mtp=False)
    assert (
        default_draft_head(no_head) is None
        and nnx.eval_shape(lambda: SpeculativeModel(no_head, rngs=nnx.Rngs(0))).drafter is None
    )


def test_draft_head_by_name():
    """``drafter=`` picks a registered head over the config's default; an unknown name is refused naming
    the registered ones, a head for a config without one is refused."""
    config = ModelConfig.tiny(hc_mult=2, mlp_layer_types=(MOE,) * 4)
    model = nnx.eval_shape(
        lambda: SpeculativeModel(config, backend=OFFLINE, rngs=nnx.Rngs(0), drafter="mtp_head")
    )
    assert type(model.mtp) is MTPHead
    with pytest.raises(
        ValueError, match=r"^drafter: unknown 'medusa'; registered: .*deepseek_v4_mtp, mtp_head"
    ):
        SpeculativeModel(config, rngs=nnx.Rngs(0), drafter="medusa")
    with pytest.raises(ValueError, match=r"^drafter: None for a config without a draft head"):
        SpeculativeModel(ModelConfig.tiny(mtp=False), rngs=nnx.Rngs(0), drafter="mtp_head")


@pytest.mark.parametrize(
    "config",
    [ModelConfig.tiny(), ModelConfig.deepseek_v4_flash(num_layers=4)],
    ids=["tiny", "flash-4-layers"],  # dense MLP and one stream; sliding, CSA, HCA, hash MoE and MoE
)
def test_built_abstract_is_eval_shape_without_tracing(config):
    """``build_abstract`` gives the model of ``nnx.eval_shape`` (its graph, each variable's shape and dtype)
    and binds no primitive, also for DeepSeek-V4-Pro's 61 layers. load_pretrained's checks of a checkpoint of
    61 layers (tiny dimensions), on the 2-core CPU shared with 5 other jobs: 1.1-2.0 s (0.8-1.0 s of CPU)
    with the construction traced (``nnx.eval_shape``), 0.25-0.6 s (0.2-0.3 s of CPU, most of it flax's
    own module construction, linear in the layers) built abstract."""

    def build(rngs):
        return SpeculativeModel(config, backend=OFFLINE, rngs=rngs)

    def shapes(state):
        return jax.tree.map(lambda x: (x.shape, x.dtype), state)

    traced_graph, traced = nnx.split(nnx.eval_shape(lambda: build(nnx.Rngs(0))))
    graph, built = nnx.split(build_abstract(build))
    assert graph == traced_graph and shapes(built) == shapes(traced)
    binds = []
    original = jax.extend.core.Primitive.bind

    def counted(self, *args, **params):
        binds.append(self.name)
        return original(self, *args, **params)

    pro = ModelConfig.deepseek_v4_pro()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(jax.extend.core.Primitive, "bind", counted)
        build_abstract(lambda rngs: SpeculativeModel(pro, rngs=rngs))
        assert not binds
        nnx.eval_shape(lambda: build(nnx.Rngs(0)))
        assert binds  # (what is counted)


@pytest.mark.parametrize("backend", [ONLINE, OFFLINE], ids=["online", "offline"])
def test_a_chain_given_as_a_tree_is_the_chain(backend):
    """``tree=Tree.chain(N)`` runs the chain's kernels and masks: a verify whose 128-block closes inside it
    gives the chain's logits and caches bit for bit, and keep_path leaves them as the chain does (the verify
    pending, for the next forward to commit)."""
    config = dataclasses.replace(
        MODEL_CONFIG, layer_types=(HCA, SLIDING, CSA, HCA), index_n_heads=2, index_head_dim=16, index_topk=4
    )
    model = DeepseekV4Model(config, MODEL_RUNTIME, backend=backend, rngs=nnx.Rngs(1))
    graphdef, params = nnx.split(model)

    @functools.partial(jax.jit, static_argnames=("mode", "tree"))
    def forward(cache, tokens, positions, mode, tree=None):
        return nnx.merge(graphdef, params)(tokens, positions, cache, mode=mode, tree=tree)

    batch, prefix, n = 2, 126, 4
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, config.vocab_size, (batch, prefix + n)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(prefix + n, dtype=jnp.int32), tokens.shape)
    _, _, cache = forward(
        model.init_cache(batch), tokens[:, :prefix], positions[:, :prefix], ForwardMode.EXTEND
    )
    verify = (tokens[:, prefix : prefix + n], positions[:, prefix : prefix + n], ForwardMode.TARGET_VERIFY)
    chain = forward(cache, *verify)
    tree = Tree.chain(n)
    as_tree = forward(cache, *verify, tree=tree)
    jax.tree.map(np.testing.assert_array_equal, as_tree, chain)
    nodes = jnp.asarray([3, 1], jnp.int32)
    kept = model.keep_path(as_tree[2], tree, positions[:, prefix], nodes)
    jax.tree.map(np.testing.assert_array_equal, kept, chain[2])


def test_hyper_connection_compiles_without_a_loop():
    """The Sinkhorn iterations of a hyper-connection are unrolled, so that XLA fuses them: a while loop runs
    each iteration as several kernels on a GPU (84 kernels a call against 10 at V4-Flash's shapes on the
    H200, bench/RESULTS.md section 11); the projection is still doubly stochastic."""
    from jax_oc128.nn.hyper_connections import HyperConnection

    hc = HyperConnection(4, 64, 20, 1e-6, 1e-6, rngs=nnx.Rngs(0))
    streams = jax.random.normal(jax.random.key(1), (2, 3, 4, 64))
    forward = jax.jit(lambda streams: hc(streams))
    assert " while(" not in forward.lower(streams).compile().as_text()
    _, comb, _ = forward(streams)
    # rows and columns sum to 1 but for the eps (1e-6) in each normalisation's denominator
    for axis in (-1, -2):
        np.testing.assert_allclose(np.sum(comb, axis=axis), 1.0, rtol=0, atol=1e-5)
