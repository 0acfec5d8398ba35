"""The engine drives any model of the :class:`jax_oc128.protocols.Model` protocol: a second, minimal model
registered here (a one-layer dense causal LM with a cache of keys and values by position, and a drafter with a
cache of its own) runs plain and speculative (chains of 2 and 4, a tree of 8) with no edit to the engine
package, greedy speculation giving the plain greedy tokens, which are those of a direct float64
computation. Also: the registry builds it by its architecture, the engine imports no model class, and a
model that breaks the protocol is refused by name.

This file is also the worked example of ``docs/extending.md``, "Adding a model"."""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_oc128
from jax_oc128 import (
    Engine,
    ForwardMode,
    RuntimeConfig,
    Tree,
    drafter_class,
    model_class,
    register_drafter,
    register_model,
)
from jax_oc128.rules import drop_index

ARCHITECTURE, DRAFTER = "TinyDenseForCausalLM", "tiny_bigram"
HIGHEST = jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class TinyConfig:
    """The minimal model's config: ``drafter`` whether it has one, ``trees`` whether it verifies trees."""

    vocab_size: int
    hidden_size: int
    drafter: bool = True
    trees: bool = True


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """The model's cache: ``keys``, ``values`` ``[slots, max_len, D]`` by position; ``tree_keys``,
    ``tree_values`` ``[slots, max_draft, D]`` a verify's nodes, until ``keep_path`` keeps its path."""

    keys: jax.Array
    values: jax.Array
    tree_keys: jax.Array
    tree_values: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenCache:
    """The drafter's cache: ``tokens`` ``[slots, max_len]`` int32 by position (-1: none), ``tree_tokens``
    ``[slots, max_draft]`` int32 the nodes of a tree draft."""

    tokens: jax.Array
    tree_tokens: jax.Array


def _param(rngs, *shape, scale=1.0):
    return nnx.Param(scale * jax.random.normal(rngs.params(), shape, jnp.float32))


def _at_positions(buffer, positions, valid, values):
    """``buffer`` ``[slots, L, ...]`` with ``values`` ``[slots, T, ...]`` at ``positions`` ``[slots, T]``
    where ``valid`` ``[slots, T]`` (elsewhere dropped)."""
    rows = jnp.arange(buffer.shape[0])[:, None]
    return buffer.at[rows, jnp.where(valid, positions, buffer.shape[1])].set(values, mode="drop")


def _keep(buffer, tree_buffer, tree: Tree, first_positions, nodes, written=None):
    """``buffer`` ``[slots, L, ...]`` with each row's path to ``nodes`` (-1: none) copied from
    ``tree_buffer`` ``[slots, N, ...]`` to ``first_positions`` + its depths (the path's nodes in
    ``written`` only, default all)."""
    path = jnp.asarray(tree.paths)[jnp.maximum(nodes, 0)]  # [slots, depth + 1], -1 past the node
    kept = (nodes >= 0)[:, None] & (path >= 0)
    if written is not None:
        kept &= jnp.isin(path, jnp.asarray(written))
    positions = first_positions[:, None] + jnp.arange(path.shape[1])
    return _at_positions(buffer, positions, kept, tree_buffer[jnp.arange(buffer.shape[0])[:, None], path])


def _at_nodes(buffer, nodes, lengths, values):
    """``buffer`` ``[slots, N, ...]`` with ``values`` ``[slots, len(nodes), ...]`` at the static ``nodes``
    of the rows of ``lengths`` > 0."""
    rows = jnp.where(lengths > 0, jnp.arange(buffer.shape[0]), buffer.shape[0])[:, None]
    return buffer.at[rows, jnp.asarray(nodes)[None]].set(values, mode="drop")


@register_drafter(DRAFTER)
class TinyDrafter(nnx.Module):
    """A trivial drafter: the next token from the token's embedding and the token before it (from its own
    cache), through the target's embedding and LM head. It ignores the hidden state it is given."""

    def __init__(self, target: TinyDense, *, rngs: nnx.Rngs):
        config = target.config
        self.embed, self.lm_head = target.embed, target.lm_head
        self.before = _param(rngs, config.vocab_size, config.hidden_size, scale=0.1)
        self.shape = (target.runtime.max_len, target.runtime.max_draft)

    def init_cache(self, slots):
        max_len, max_draft = self.shape
        return TokenCache(
            jnp.full((slots, max_len), -1, jnp.int32), jnp.full((slots, max_draft), -1, jnp.int32)
        )

    def clear(self, cache, slots):
        index = drop_index(slots, cache.tokens.shape[0])
        return TokenCache(cache.tokens.at[index].set(-1, mode="drop"), cache.tree_tokens)

    def __call__(self, tokens, hidden, positions, cache, *, lengths=None, tree=None, nodes=None):
        batch, width = tokens.shape
        lengths = jnp.full((batch,), width, jnp.int32) if lengths is None else lengths
        start = positions[:, 0]
        behind = jnp.where(start > 0, cache.tokens[jnp.arange(batch), jnp.maximum(start - 1, 0)], -1)
        if tree is None:  # consecutive tokens
            before = jnp.concatenate([behind[:, None], tokens[:, :-1]], axis=1)
        elif nodes == (0,):  # the root
            before = behind[:, None]
        else:  # a deeper level: each node's parent, drafted at the level before
            before = cache.tree_tokens[:, [tree.parents[node] for node in nodes]]
        x = self.embed[...][tokens] + jnp.where(before[..., None] >= 0, self.before[...][before], 0.0)
        logits = jnp.matmul(x, self.lm_head[...], precision=HIGHEST)
        if tree is None:
            valid = jnp.arange(width)[None] < lengths[:, None]
            cache = dataclasses.replace(cache, tokens=_at_positions(cache.tokens, positions, valid, tokens))
        else:
            cache = dataclasses.replace(
                cache, tree_tokens=_at_nodes(cache.tree_tokens, nodes, lengths, tokens)
            )
        return logits, x, cache

    def keep_path(self, cache, tree, first_positions, nodes, written):
        tokens = _keep(cache.tokens, cache.tree_tokens, tree, first_positions, nodes, written)
        return dataclasses.replace(cache, tokens=tokens)


@register_model(ARCHITECTURE)
class TinyDense(nnx.Module):
    """A one-layer causal LM with one attention head and no normalisation: ``h = x + attention(x) wo``,
    ``logits = h lm_head``, ``x`` the token's embedding; dense caches only (no pages). It takes the runtime's
    ``max_len`` and ``max_draft`` (its other fields do not apply)."""

    def __init__(self, config: TinyConfig, runtime: RuntimeConfig, *, rngs: nnx.Rngs):
        self.config, self.runtime = config, runtime
        vocab, size = config.vocab_size, config.hidden_size
        self.embed = _param(rngs, vocab, size)
        self.wq, self.wk, self.wv = (_param(rngs, size, size, scale=size**-0.5) for _ in range(3))
        self.wo = _param(rngs, size, size, scale=0.3 * size**-0.5)  # drafts agree often: exercised paths
        self.lm_head = _param(rngs, size, vocab, scale=size**-0.5)
        self.head = drafter_class(DRAFTER)(self, rngs=rngs) if config.drafter else None

    @classmethod
    def config_from_hf(cls, config: dict, **options) -> TinyConfig:
        return TinyConfig(config["vocab_size"], config["hidden_size"], **options)

    vocab_size = property(lambda self: self.config.vocab_size)
    max_len = property(lambda self: self.runtime.max_len)
    max_draft = property(lambda self: self.runtime.max_draft)
    draft_hidden_size = property(lambda self: self.config.hidden_size)
    verifies_trees = property(lambda self: self.config.trees)
    drafter = property(lambda self: self.head)

    def init_cache(self, slots, pages=None, page_size=0):
        if pages is not None:
            raise ValueError(f"pages: {type(self).__name__} has dense caches only, got {pages}")
        by_position, by_node = ((slots, n, self.config.hidden_size) for n in (self.max_len, self.max_draft))
        return KVCache(
            *(jnp.zeros(shape, jnp.float32) for shape in (by_position, by_position, by_node, by_node))
        )

    def clear(self, cache, slots):
        index = drop_index(slots, cache.keys.shape[0])
        return dataclasses.replace(
            cache,
            keys=cache.keys.at[index].set(0, mode="drop"),
            values=cache.values.at[index].set(0, mode="drop"),
        )

    def with_page_table(self, cache, page_table):
        raise ValueError(f"page_table: {type(self).__name__} has dense caches only")

    def __call__(
        self,
        tokens,
        positions,
        cache,
        *,
        lengths=None,
        mode=ForwardMode.EXTEND,
        tree=None,
        context=None,
        logits_at=None,
    ):
        batch, width = tokens.shape
        lengths = jnp.full((batch,), width, jnp.int32) if lengths is None else lengths
        x = self.embed[...][tokens]
        q, k, v = (jnp.matmul(x, w[...], precision=HIGHEST) for w in (self.wq, self.wk, self.wv))
        valid = jnp.arange(width)[None] < lengths[:, None]
        own = jnp.asarray(
            np.tril(np.ones((width, width), bool)) if tree is None else tree.mask
        )  # ancestors, self
        keys, values = cache.keys[:, :context], cache.values[:, :context]  # the context's positions only
        cached = jnp.arange(keys.shape[1])[None, None] < positions[:, :1, None]  # before the call
        mask = jnp.concatenate(
            [jnp.broadcast_to(cached, (batch, width, keys.shape[1])), own[None] & valid[:, None]], axis=-1
        )
        scores = jnp.einsum(
            "btd,bsd->bts", q, jnp.concatenate([keys, k], axis=1), precision=HIGHEST
        ) / np.sqrt(k.shape[-1])
        weights = jax.nn.softmax(jnp.where(mask, scores, -1e30), axis=-1)
        attention = jnp.einsum(
            "bts,bsd->btd", weights, jnp.concatenate([values, v], axis=1), precision=HIGHEST
        )
        h = x + jnp.matmul(attention, self.wo[...], precision=HIGHEST)
        if mode == ForwardMode.TARGET_VERIFY:  # the nodes wait for keep_path
            nodes = tuple(range(width))
            cache = dataclasses.replace(
                cache,
                tree_keys=_at_nodes(cache.tree_keys, nodes, lengths, k),
                tree_values=_at_nodes(cache.tree_values, nodes, lengths, v),
            )
        else:
            cache = dataclasses.replace(
                cache,
                keys=_at_positions(cache.keys, positions, valid, k),
                values=_at_positions(cache.values, positions, valid, v),
            )
        out = h if logits_at is None else h[jnp.arange(batch), logits_at][:, None]
        return jnp.matmul(out, self.lm_head[...], precision=HIGHEST), h, cache

    def keep_path(self, cache, tree, first_positions, nodes):
        return dataclasses.replace(
            cache,
            keys=_keep(cache.keys, cache.tree_keys, tree, first_positions, nodes),
            values=_keep(cache.values, cache.tree_values, tree, first_positions, nodes),
        )


HF_CONFIG = {
    "architectures": [ARCHITECTURE],
    "vocab_size": 64,
    "hidden_size": 32,
    "max_position_embeddings": 128,
}


def make_tiny(**options) -> TinyDense:
    """The minimal model as a loader builds it: its class by the architecture, its config from a
    ``config.json`` dict, its runtime (``max_len`` its ``max_position_embeddings``), random weights."""
    cls = model_class(HF_CONFIG["architectures"][0])
    runtime = RuntimeConfig(max_len=HF_CONFIG["max_position_embeddings"], max_draft=8)
    return cls(cls.config_from_hf(HF_CONFIG, **options), runtime, rngs=nnx.Rngs(0))


def direct_greedy(model: TinyDense, prompt, count: int) -> list[int]:
    """``count`` greedy tokens after ``prompt``, each from a float64 forward of the whole sequence."""
    weights = {
        name: np.asarray(getattr(model, name)[...], np.float64)
        for name in ("embed", "wq", "wk", "wv", "wo", "lm_head")
    }
    sequence = list(prompt)
    for _ in range(count):
        x = weights["embed"][sequence]
        q, k, v = (x @ weights[name] for name in ("wq", "wk", "wv"))
        scores = np.where(np.tril(np.ones((len(x), len(x)), bool)), q @ k.T / np.sqrt(k.shape[-1]), -np.inf)
        attention = np.exp(scores - scores.max(axis=-1, keepdims=True))
        h = x + (attention / attention.sum(axis=-1, keepdims=True)) @ v @ weights["wo"]
        sequence.append(int(np.argmax(h[-1] @ weights["lm_head"])))
    return sequence[len(prompt) :]


PROMPTS = [[5, 9, 1, 33, 2], list(range(40, 57)), [7] * 9]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def tiny_engine():
    # 2 slots for 3 requests: a slot is reused
    return Engine(make_tiny(), slots=2, prompt_bucket=16, steps_per_dispatch=4)


def test_plain_greedy_is_the_direct_computation(tiny_engine):
    plain = tiny_engine.generate(PROMPTS, NEW_TOKENS)
    assert plain.tokens == [direct_greedy(tiny_engine.model, prompt, NEW_TOKENS) for prompt in PROMPTS]


@pytest.mark.parametrize(
    "speculation",
    [dict(num_tokens=2), dict(num_tokens=4), dict(tree=Tree.default(8))],
    ids=["N=2", "N=4", "tree-8"],
)
def test_greedy_speculation_is_plain_greedy(tiny_engine, speculation):
    """Drafts are accepted (more than a token per step, fewer steps) and change no token."""
    plain = tiny_engine.generate(PROMPTS, NEW_TOKENS)
    spec = tiny_engine.generate(PROMPTS, NEW_TOKENS, **speculation)
    assert spec.tokens == plain.tokens
    assert spec.mean_accepted > 1.3 and spec.steps < plain.steps, (
        spec.mean_accepted,
        spec.steps,
        plain.steps,
    )


def test_chunked_prefill_of_the_minimal_model(tiny_engine):
    chunked = Engine(tiny_engine.model, slots=2, prompt_bucket=16, prefill_chunk=8, steps_per_dispatch=4)
    assert (
        chunked.generate(PROMPTS, NEW_TOKENS, num_tokens=4).tokens
        == tiny_engine.generate(PROMPTS, NEW_TOKENS).tokens
    )


def test_registry_names_the_unknown_architecture_and_the_known_ones():
    with pytest.raises(
        ValueError, match=r"^architecture: unknown 'Nope'; registered: .*DeepseekV4ForCausalLM.*Tiny"
    ):
        model_class("Nope")
    assert model_class("DeepseekV4ForCausalLM") is jax_oc128.SpeculativeModel
    with pytest.raises(ValueError, match=r"^name: architecture 'TinyDenseForCausalLM' is registered already"):
        register_model(ARCHITECTURE)(type("Other", (), {}))
    assert register_model(ARCHITECTURE)(TinyDense) is TinyDense  # the same class again: nothing changes


def test_the_engine_imports_no_model_class():
    """No module of the engine package imports from :mod:`jax_oc128.nn` but its sharding helper."""
    engine = pathlib.Path(jax_oc128.__file__).parent / "engine"
    imported = set()
    for module in engine.glob("*.py"):
        for node in ast.walk(ast.parse(module.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("jax_oc128.nn"):
                imported |= {f"{node.module}.{alias.name}" for alias in node.names}
            elif isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names if alias.name.startswith("jax_oc128.nn")}
    assert imported == {"jax_oc128.nn.sharding"}


class Bare(nnx.Module):
    """A module with none of the protocol's members."""


class WrongDrafter(TinyDense):
    """The minimal model with a drafter that has none of the drafter protocol's members."""

    drafter = property(lambda self: object())


@pytest.mark.parametrize(
    "build, error, message",
    [
        (
            lambda m: Engine(m, 1, pages=4, page_size=128),
            ValueError,
            "^pages: TinyDense has dense caches only",
        ),
        (
            lambda m: Engine(Bare(), 1),
            TypeError,
            "^model: must implement .*Bare has no vocab_size, .*keep_path$",
        ),
        (
            lambda m: Engine(WrongDrafter(m.config, m.runtime, rngs=nnx.Rngs(0)), 1),
            TypeError,
            "^model.drafter: must implement .*object has no init_cache, clear, __call__, keep_path$",
        ),
        (
            lambda m: Engine(make_tiny(drafter=False), 1).generate(PROMPTS, 4, num_tokens=2),
            ValueError,
            "^num_tokens: this model has no",
        ),
        (
            lambda m: Engine(make_tiny(trees=False), 1).generate(PROMPTS, 4, tree=(-1, 0, 0)),
            NotImplementedError,
            "^tree: this model verifies chains only",
        ),
        (
            lambda m: Engine(m, 1).generate(PROMPTS, 4, num_tokens=9),
            ValueError,
            r"^num_tokens: must be in \[2, 8 = max_draft\]",
        ),
    ],
    ids=["pages", "bare", "drafter", "no drafter", "chains only", "past max_draft"],
)
def test_the_protocol_refusals(tiny_engine, build, error, message):
    with pytest.raises(error, match=message):
        build(tiny_engine.model)


def test_a_model_fact_out_of_range_is_refused_by_name():
    model = make_tiny()
    model.runtime = types.SimpleNamespace(max_len=model.max_len, max_draft=17)  # past RuntimeConfig's check
    with pytest.raises(ValueError, match=r"^model.max_draft: must be in \[1, 16\]"):
        Engine(model, 1)
