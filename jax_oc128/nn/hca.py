"""The compressor of DeepSeek-V4's heavily compressed attention (HCA, ratio 128), as transformers'
``DeepseekV4HCACompressor`` (5.24.0) defines it.

Every token projects a value ``kv`` and a gate, each ``head_dim`` wide. Entry b pools the 128 tokens of
block b per channel by the softmax of gate + ``ape[j]`` (j the token's offset in the block); then its
RMSNorm and RoPE at position ``128 b``. It exists once token ``128 b + 127`` has been seen.

State: the pooling of each row's open block is the model's layer-stacked C128 state (online banks or offline
raw rows, :mod:`jax_oc128.controller`); this compressor folds its tokens into its own layer of it through the
state's controller (:func:`~jax_oc128.controller.backend_of`), and returns the entries they close.
Activations, pooling and state are float32; the projections' weights are float32 or bfloat16
(:mod:`~jax_oc128.nn.functional`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jax_oc128.controller import ONLINE, Backend, ForwardMode, State, backend_of
from jax_oc128.nn.forward import ForwardBatch
from jax_oc128.nn.functional import normal_param, ones_param, rms_norm, zeros_param
from jax_oc128.nn.linear import linear
from jax_oc128.rules import BLOCK


class EntriesSeen(NamedTuple):
    """What an HCA layer's T queries carry through its attention's loop over query blocks
    (:func:`~jax_oc128.nn.attend.by_query_blocks`, which slices it by query).

    Attributes:
      visible: ``[batch, T, E]`` bool: which of the layer's E entries (the stored ones, then a tree's nodes')
        each query sees.
    """

    visible: jax.Array


class HCACompressor(nnx.Module):
    """The HCA compressor of one attention layer: its parameters (named in
    :data:`jax_oc128.nn.weights.LAYER`) and its layer ``layer`` of the model's C128 state.

    Args:
      hidden_size, head_dim, rms_norm_eps: the attention layer's.
      rope: the layer's (compress) :class:`~jax_oc128.nn.RopeConfig`, for the entries.
      layer: the layer's index in the model's layer-stacked state (the number of HCA layers before it).
      max_draft: the most tokens a verify may feed (banks of a state made by :meth:`init_state`).
      dtype: the projections' weights' (a name in :data:`~jax_oc128.nn.functional.DTYPES`).
    """

    def __init__(
        self,
        hidden_size,
        head_dim,
        rms_norm_eps,
        rope,
        *,
        layer: int,
        max_draft: int,
        dtype: str = "float32",
        rngs,
    ):
        self.head_dim, self.eps, self.rope = head_dim, rms_norm_eps, rope
        self.layer, self.max_draft = layer, max_draft
        self.kv_proj = normal_param(rngs, head_dim, hidden_size, dtype=dtype)
        self.gate_proj = normal_param(rngs, head_dim, hidden_size, dtype=dtype)
        self.ape = zeros_param(BLOCK, head_dim)
        self.kv_norm = ones_param(head_dim)

    def init_state(self, batch: int, backend: Backend = ONLINE) -> State:
        """A fresh C128 state of ``backend``, ``layer + 1`` layers and ``batch`` slots (for a layer used on
        its own)."""
        return backend.create(self.layer + 1, batch, self.head_dim, self.max_draft)

    def __call__(self, x, compressed: State, forward_batch: ForwardBatch):
        """Fold the new tokens into this layer of the prepared state (``prepare_forward`` ran): compress them,
        or (mode TARGET_VERIFY) write the verify's banks, of the chain or of the record's tree.

        Args:
          x: ``[batch, T, hidden]``; compressed: the layer-stacked state, batch row b its slot b;
            forward_batch: the forward's :class:`~jax_oc128.nn.forward.ForwardBatch`.

        Returns:
          ``(compressed, entries [batch, K, head_dim], blocks [batch, K])``: the normed, rotated entries of
          the blocks the tokens closed and their block indices (-1: no entry). K is ``T // 128 + 1`` for a
          compress, 1 for a chain verify, and for a tree verify T (by node: the block the node closes on its
          path).
        """
        kv_score = jnp.concatenate([linear(x, self.kv_proj[...]), linear(x, self.gate_proj[...])], -1)[None]
        fb, ape = forward_batch, self.ape[...][None]
        seq_lens, slots, controller = fb.positions[:, 0], fb.slots, backend_of(compressed).controller
        if fb.mode is ForwardMode.TARGET_VERIFY:
            compressed, entries, blocks = controller.write_prefix(
                compressed, kv_score, seq_lens, slots, ape, layer=self.layer, tree=fb.tree
            )
        else:
            compressed, entries, blocks = controller.compress(
                compressed, kv_score, seq_lens, fb.lengths, slots, ape, layer=self.layer
            )
        normed = rms_norm(entries[0], self.kv_norm[...], self.eps)
        return compressed, self.rope.apply(normed, jnp.maximum(blocks, 0) * BLOCK), blocks
