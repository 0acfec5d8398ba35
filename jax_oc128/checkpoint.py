"""Saving and loading a :class:`~jax_oc128.nn.SpeculativeModel` (config + parameters in one .npz), and the
default model shipped in the package."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_oc128.controller import ONLINE, Backend
from jax_oc128.nn import ModelConfig, SpeculativeModel

DEFAULT_MODEL = pathlib.Path(__file__).parent / "assets" / "default_model.npz"


def _named_leaves(state) -> list[tuple[str, object]]:
    """The state's leaves, each with its path as a string (the key it is stored under)."""
    return [(jax.tree_util.keystr(path), leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(state)]


def save(model: SpeculativeModel, path, **metadata) -> None:
    """Write the model's config, parameters and ``metadata`` (JSON-serialisable) to ``path``."""
    _, state = nnx.split(model)
    meta = {"config": dataclasses.asdict(model.config), **metadata}
    np.savez_compressed(
        path,
        __meta__=np.frombuffer(json.dumps(meta).encode(), np.uint8),
        **{name: np.asarray(leaf) for name, leaf in _named_leaves(state)},
    )


def load(path=DEFAULT_MODEL, *, backend: Backend = ONLINE) -> tuple[SpeculativeModel, dict]:
    """The model stored at ``path`` (default: the shipped one) with the C128 compressor ``backend``, and its
    metadata."""
    data = np.load(path)
    meta = json.loads(bytes(data["__meta__"]).decode())
    config = meta["config"]
    config = ModelConfig(**{**config, "layer_types": tuple(config["layer_types"])})
    model = SpeculativeModel(config, backend=backend, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    stored = {k: v for k, v in data.items() if k != "__meta__"}
    names = [name for name, _ in _named_leaves(state)]
    if set(stored) != set(names):
        raise ValueError(f"{path}: parameters do not match the model built from its config")
    state = jax.tree_util.tree_unflatten(
        jax.tree_util.tree_structure(state), [jnp.asarray(stored[n]) for n in names]
    )
    return nnx.merge(graphdef, state), meta
