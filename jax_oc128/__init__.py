"""jax_oc128: DeepSeek-V4 online C128 KV compression that survives speculative (MTP/EAGLE) decoding.

Ops (native XLA FFI handlers on CPU and CUDA, jnp twins in :mod:`jax_oc128.reference`): :func:`compress`,
:func:`verify`, :func:`commit`, and :func:`init_state` for a zeroed state. The functional controller:
:class:`Controller` over :class:`CompressState` (and the offline baseline, :class:`OfflineController` over
:class:`OfflineState`), both the :class:`CompressController` protocol; the two backends as objects,
:data:`ONLINE` and :data:`OFFLINE`. The slot and bank rules in :mod:`jax_oc128.rules`. Flax NNX modules in
:mod:`jax_oc128.nn` (:class:`ModelConfig`, :class:`SpeculativeModel`); generation in :mod:`jax_oc128.engine`
(:class:`Engine`), driving any :class:`Model` (:mod:`jax_oc128.protocols`: :class:`Model`, :class:`Drafter`)
with speculation over a :class:`Tree`; models by architecture in :mod:`jax_oc128.registry`
(:func:`register_model`, :func:`model_class`, :func:`register_drafter`, :func:`drafter_class`); a
DeepSeek-V4 checkpoint in Hugging Face format by :func:`load_pretrained`, its tokenizer by
:func:`load_tokenizer` (:mod:`jax_oc128.text`).
"""

from jax_oc128 import reference
from jax_oc128.controller import (
    OFFLINE,
    ONLINE,
    Backend,
    CompressController,
    Controller,
    ForwardMode,
    OfflineController,
)
from jax_oc128.engine import Engine
from jax_oc128.nn import ModelConfig, RuntimeConfig, SpeculativeModel
from jax_oc128.ops import commit, compress, init_state, verify
from jax_oc128.pretrained import load_pretrained
from jax_oc128.protocols import Drafter, Model
from jax_oc128.registry import drafter_class, model_class, register_drafter, register_model
from jax_oc128.state import CompressState, OfflineState
from jax_oc128.text import TextTokenizer, load_tokenizer
from jax_oc128.tree import Tree

__all__ = [
    "OFFLINE",
    "ONLINE",
    "Backend",
    "CompressController",
    "CompressState",
    "Controller",
    "Drafter",
    "Engine",
    "ForwardMode",
    "Model",
    "ModelConfig",
    "OfflineController",
    "OfflineState",
    "RuntimeConfig",
    "SpeculativeModel",
    "TextTokenizer",
    "Tree",
    "commit",
    "compress",
    "drafter_class",
    "init_state",
    "load_pretrained",
    "load_tokenizer",
    "model_class",
    "reference",
    "register_drafter",
    "register_model",
    "verify",
]
__version__ = "0.1.0"
