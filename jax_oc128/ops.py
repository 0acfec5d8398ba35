"""The public ops: argument checks at trace time, then the native target of the platform.

Every op takes and returns the whole state array and updates it in place through
``input_output_aliases``; jit the caller with the state donated (``donate_argnames``) so that no
copy is made, and never read a state array after passing it to an op.

Shapes, dtypes, ranks and the static ``layer``/``num_layers`` are checked at trace time: a ``ValueError``
(shape, rank, range) or ``TypeError`` (dtype, type) whose message starts with the argument's name. Array
arguments may be any array-like (lists, numpy arrays), converted with ``jnp.asarray``.

On-device policy for values that cannot be checked at trace time: a row is valid if its slot is in
``[0, slots)`` (``-1`` marks padding), its ``seq_lens`` is not negative and (compress) its ``new_lens`` is in
``[0, T]`` or (commit) its ``accept_lens`` in ``[0, max_draft]``. A valid row whose slot an earlier valid
row of the same call already has is skipped, as is every invalid row: nothing is read or written for it,
its entries are zero and its ``entry_blocks`` are -1, as for a padding row. (A valid row with ``new_lens``
0, or ``accept_lens`` 0, changes nothing but still holds its slot.) When the values are concrete (not
traced), an invalid row with a slot other than -1, or two rows with the same slot, raise a ``ValueError``
instead. In ``verify(pending=...)`` a pending commit whose accept ``seq_lens - pending`` is outside
``[1, max_draft]`` commits nothing, as :func:`commit` with that accept. A bank to keep (``commit``'s
``accept_banks``, ``verify``'s ``pending_banks``) outside ``[1, max_draft]`` commits nothing either (0 keeps
bank 0 as it is), but does not make the row invalid: it still holds its slot. Whether ``accept_lens`` is the
depth + 1 of the node whose bank is kept is the caller's to keep (commit does not know the tree).

On a mesh (under ``jax.jit``, the state sharded over its slot axis), each device runs the op on its own slots
and the state is never gathered: :mod:`jax_oc128.partition` gives the layouts, and how rows split like the
slots differ from replicated rows (a row addressing another device's slot is skipped).

Scores (score + ape) are finite or -inf: a -inf score has weight zero, and a block whose scores are all
-inf has the state ``(max, sum, mean) = (-inf, 0, 0)`` and the entry 0. NaN or +inf scores, and non-finite
kv, are outside the domain: that block's state and entry are unspecified, nothing else is affected.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_oc128 import _native, partition, reference
from jax_oc128.checks import check_int
from jax_oc128.rules import BLOCK, MAX_DRAFT
from jax_oc128.tree import Tree, check_parents

STATE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
#: the precision of every float32 matmul (the ops' jnp twins, the model): they stay float32 (on GPUs the
#: default would allow TF32)
FULL = jax.lax.Precision.HIGHEST

#: Per native target, the names of the operands the ops below pass it: arguments, results (a result named like
#: an argument aliases it, in place) and attributes. The order is the C++ binding's (ffi/oc128_ffi.h), the
#: single source of truth: importing this module refuses a native module that reports anything else.
OPERANDS = {
    "oc128_compress": _native.Operands(
        args=("state", "kv_score", "seq_lens", "new_lens", "slots", "ape"),
        rets=("state", "entries", "entry_blocks"),
        attrs=("layer",),
    ),
    "oc128_verify": _native.Operands(
        args=("state", "kv_score", "seq_lens", "slots", "ape", "pending", "pending_banks", "tree"),
        rets=("state", "entries", "entry_blocks"),
        attrs=("layer",),
    ),
    "oc128_commit": _native.Operands(
        args=("state", "seq_lens", "accept_lens", "accept_banks", "slots"),
        rets=("state",),
        attrs=("layer", "num_layers"),
    ),
    "oc128_attention": _native.Operands(  # jax_oc128.attention_op
        args=("q", "kv", "index", "ranges", "sinks"),
        rets=("out", "workspace"),
        attrs=("scale",),
    ),
    "oc128_quant_gmm": _native.Operands(  # jax_oc128.nn.quant_gmm
        args=("x", "codes", "scales", "tile_expert", "tile_rows"),
        rets=("out", "workspace"),
        attrs=("gated", "limit"),
    ),
    "oc128_indexer_scores": _native.Operands(  # jax_oc128.indexer_op
        args=("q", "keys", "weights", "limit"),
        rets=("out",),
        attrs=("scale",),
    ),
}
_native.check_operands(OPERANDS)


def init_state(layers: int, slots: int, head_dim: int, max_draft: int, dtype=jnp.float32) -> jax.Array:
    """A zeroed state ``[layers, 1 + max_draft, slots, 3, head_dim]`` of ``dtype`` (float32 or bfloat16).

    Bank 0 holds the committed ``[max | sum | mean]`` rows of each slot, banks ``1..max_draft`` the
    verify scratch. ``layers`` and ``slots`` are at least 1, ``head_dim`` a positive multiple of 32 and
    ``max_draft`` in ``[0, 16]``.
    """
    dtype = jnp.dtype(dtype)
    if dtype not in STATE_DTYPES:
        raise TypeError(f"dtype: must be float32 or bfloat16, got {dtype}")
    for name, value, low in (("layers", layers, 1), ("slots", slots, 1), ("head_dim", head_dim, 1)):
        check_int(name, value, low)
    check_int("max_draft", max_draft, 0)
    if max_draft > MAX_DRAFT:
        raise ValueError(f"max_draft: at most {MAX_DRAFT}, got {max_draft}")
    if head_dim % 32:
        raise ValueError(f"head_dim: must be a positive multiple of 32, got {head_dim}")
    return jnp.zeros((layers, 1 + max_draft, slots, 3, head_dim), dtype)


def _as_arrays(**arrays):
    """The values of the keyword arguments, in order, as jax arrays: arrays and tracers as they are,
    array-likes (lists, numpy arrays) converted; a TypeError naming the argument for anything else."""
    converted = []
    for name, x in arrays.items():
        try:
            converted.append(jnp.asarray(x))
        except (TypeError, ValueError) as error:
            raise TypeError(f"{name}: expected an array, got {type(x).__name__} ({error})") from error
    return converted


def _check_state(state) -> tuple[int, int, int, int]:
    if state.ndim != 5 or state.shape[3] != 3:
        raise ValueError(
            f"state: expected shape [layers, 1 + max_draft, slots, 3, head_dim], got {tuple(state.shape)}"
        )
    if jnp.dtype(state.dtype) not in STATE_DTYPES:
        raise TypeError(f"state: dtype must be float32 or bfloat16, got {state.dtype}")
    layers, banks, slots, _, dim = state.shape
    if dim <= 0 or dim % 32:
        raise ValueError(f"state: head_dim must be a positive multiple of 32, got {dim}")
    if layers < 1 or slots < 1:
        raise ValueError(f"state: needs at least one layer and one slot, got shape {tuple(state.shape)}")
    return layers, banks, slots, dim


def _check_array(name, x, shape, dtype):
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {list(shape)}, got {list(x.shape)}")
    if jnp.dtype(x.dtype) != jnp.dtype(dtype):
        raise TypeError(f"{name}: expected dtype {jnp.dtype(dtype)}, got {x.dtype}")


def _check_layers(layer, count, state_layers):
    check_int("layer", layer, 0)
    if count < 1 or layer + count > state_layers:
        raise ValueError(
            f"layer: layers [{layer}, {layer + count}) are not inside the state's {state_layers}"
        )


def _concrete(x):
    """``x`` as a numpy array when its value is known at trace time, else None."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def _check_values(name, x, low, high):
    value = _concrete(x)
    if value is not None and value.size and (value.min() < low or value.max() > high):
        raise ValueError(f"{name}: values must be in [{low}, {high}], got [{value.min()}, {value.max()}]")


def _check_rows(state_slots, seq_lens, slots, rows):
    _check_array("seq_lens", seq_lens, (rows,), jnp.int32)
    _check_array("slots", slots, (rows,), jnp.int32)
    _check_values("slots", slots, -1, state_slots - 1)
    slot_values, seq_values = _concrete(slots), _concrete(seq_lens)
    if slot_values is not None and seq_values is not None and np.any(seq_values[slot_values >= 0] < 0):
        raise ValueError("seq_lens: must be >= 0 for rows with a slot")


def _check_distinct_slots(slots):
    """Concrete ``slots``: no slot other than -1 twice (checked last, after every other argument)."""
    values = _concrete(slots)
    if values is None:
        return
    used, counts = np.unique(values[values >= 0], return_counts=True)
    if np.any(counts > 1):
        slot = used[counts > 1][0]
        first, second = np.flatnonzero(values == slot)[:2]
        raise ValueError(
            f"slots: slot {slot} is in rows {first} and {second}; the rows of a call must use distinct slots "
            "(traced, the later row is skipped)"
        )


def native_targets(platform: str) -> tuple[str, ...]:
    """The names of the native targets registered for ``platform`` ("cpu" or "cuda"); an op without one
    there runs its jnp reference."""
    return _native.TARGETS.get(platform, ())


def _dispatch(target, ref_fn, args, results, attrs):
    """Run ``target`` natively where it is registered for the platform, else the jnp reference ``ref_fn``,
    partitioned over the state's slots on a mesh (:func:`jax_oc128.partition.by_slots`).

    ``args``, ``results`` (shapes and dtypes) and ``attrs`` map the names of ``OPERANDS[target]`` to values;
    they reach the target in its binding's order, and ``ref_fn`` by keyword. Returns the results in that
    order: a tuple, or the array where there is one. Where every platform has the target, the custom call is
    emitted directly (XLA picks each platform's handler); otherwise ``platform_dependent`` selects native or
    reference per platform.
    """
    names = OPERANDS[target]
    for kind, given in (("args", args), ("rets", results), ("attrs", attrs)):
        if set(given) != set(getattr(names, kind)):
            raise TypeError(f"{target}: {kind} must be named {getattr(names, kind)}, got {tuple(given)}")
    aliases = {names.args.index(name): i for i, name in enumerate(names.rets) if name in names.args}
    has_native = {p: target in native_targets(p) for p in ("cpu", "cuda")}

    def run(shapes, *operands):
        """The op on ``operands`` (a device's shards), its results of ``shapes``."""

        def native(*operands):
            call = jax.ffi.ffi_call(
                target,
                shapes if len(shapes) > 1 else shapes[0],
                input_output_aliases=aliases,
                vmap_method="sequential",
            )
            return call(*operands, **{name: np.int64(attrs[name]) for name in names.attrs})

        def ref(*operands):
            return ref_fn(**dict(zip(names.args, operands, strict=True)), **attrs)

        if all(has_native.values()):
            return native(*operands)
        branches = {p: native if has else ref for p, has in has_native.items()}
        return jax.lax.platform_dependent(*operands, default=ref, **branches)

    shapes = tuple(results[name] for name in names.rets)

    @jax.custom_jvp
    def op(*operands):
        return partition.by_slots(run, names.args, names.rets, shapes, list(operands))

    @op.defjvp
    def not_differentiable(primals, tangents):
        public = target.removeprefix("oc128_")
        raise NotImplementedError(
            f"jax_oc128.ops.{public} ({target}): the ops are not differentiable (they update the state in "
            f"place, for inference); differentiate its jnp twin jax_oc128.reference.{public} instead"
        )

    return op(*(args[name] for name in names.args))


def compress(state, kv_score, seq_lens, new_lens, slots, ape, *, layer: int = 0):
    """Fold new tokens into bank 0 and emit the entries of the blocks they close (prefill, chunked
    prefill, decode).

    Args:
      state: ``[L, 1 + B, S, 3, D]`` float32 or bfloat16, updated in place (donate it).
      kv_score: ``[Lk, bs, T, 2*D]`` float32, per token ``[kv | score]``, score without ape; the ``Lk``
        layers are ``layer .. layer + Lk - 1`` of the state.
      seq_lens: ``[bs]`` int32, tokens already folded in (the position of the first new token).
      new_lens: ``[bs]`` int32 in ``[0, T]``, valid new tokens of the row; the rest is padding.
      slots: ``[bs]`` int32, the row's state slot, one row per slot; -1 marks a padding row.
      ape: ``[Lk, 128, D]`` float32, the learned position bias of the score.
      layer: first state layer of the call (static).

    Returns:
      ``(state, entries, entry_blocks)``: the updated state; ``entries`` ``[Lk, bs, E, D]`` float32 with
      ``E = T // 128 + 1``, the pre-norm entries of the blocks this call closed, in block order, zero where
      none; ``entry_blocks`` ``[bs, E]`` int32, each entry's block index, -1 where none.
    """
    state, kv_score, seq_lens, new_lens, slots, ape = _as_arrays(
        state=state, kv_score=kv_score, seq_lens=seq_lens, new_lens=new_lens, slots=slots, ape=ape
    )
    layers, _, num_slots, dim = _check_state(state)
    if kv_score.ndim != 4:
        raise ValueError(
            f"kv_score: expected rank 4 [layers, batch, tokens, 2*head_dim], got {kv_score.shape}"
        )
    call_layers, rows, tokens, _ = kv_score.shape
    _check_array("kv_score", kv_score, (call_layers, rows, tokens, 2 * dim), jnp.float32)
    _check_layers(layer, call_layers, layers)
    _check_rows(num_slots, seq_lens, slots, rows)
    _check_array("new_lens", new_lens, (rows,), jnp.int32)
    _check_values("new_lens", new_lens, 0, tokens)
    _check_array("ape", ape, (call_layers, BLOCK, dim), jnp.float32)
    _check_distinct_slots(slots)
    per_row = tokens // BLOCK + 1
    results = dict(
        state=jax.ShapeDtypeStruct(state.shape, state.dtype),
        entries=jax.ShapeDtypeStruct((call_layers, rows, per_row, dim), jnp.float32),
        entry_blocks=jax.ShapeDtypeStruct((rows, per_row), jnp.int32),
    )
    args = dict(state=state, kv_score=kv_score, seq_lens=seq_lens, new_lens=new_lens, slots=slots, ape=ape)
    return _dispatch("oc128_compress", reference.compress, args, results, dict(layer=layer))


def _check_tree(tree, num_tokens: int) -> tuple[int, ...]:
    """``verify``'s static ``tree`` (parents, or a :class:`~jax_oc128.tree.Tree`) checked by the one rule of a
    tree's parents (:func:`jax_oc128.tree.check_parents`) and against the verify's N tokens; returns the
    parents as a tuple of ints."""
    parents = check_parents(tree.parents if isinstance(tree, Tree) else tree, "tree")
    if len(parents) != num_tokens:
        raise ValueError(f"tree: {len(parents)} nodes, but kv_score has num_tokens = {num_tokens}")
    return parents


def _optional_table(name, x, shape):
    """An optional int32 operand: ``x`` checked against ``shape``, or an empty array where it is None."""
    if x is None:
        return jnp.zeros((0,), jnp.int32)
    (x,) = _as_arrays(**{name: x})
    _check_array(name, x, shape, jnp.int32)
    return x


def _constant(values):
    """An int32 vector of ``values``, made by an op (a tracer under ``jax.jit``, which XLA folds into a
    constant): custom_partitioning refuses a concrete array among the operands it traces. No empty constant
    is added (``values`` empty: the zeros alone): jax 0.11.2's partitioner crashes on one inside a
    ``shard_map`` (``scripts/repro_data_parallel_crash.py``)."""
    zeros = jnp.zeros((len(values),), jnp.int32)
    return zeros + np.asarray(values, np.int32) if len(values) else zeros


def verify(
    state, kv_score, seq_lens, slots, ape, *, layer: int = 0, pending=None, pending_banks=None, tree=None
):
    """Fold the N tokens of a verify, a chain or a tree of drafts, and store the state after node k into
    bank k + 1.

    The chain (``tree=None``): starting from bank 0 (empty when ``seq_lens % 128 == 0``), the tokens at
    positions ``seq_lens .. seq_lens + N - 1`` are folded in order; the state after token k goes to bank k + 1
    except where ``(seq_lens + k + 1) % 128 == 0`` (that token closed the block). A tree: node k follows its
    parent ``tree[k]`` and sits at position ``seq_lens + depth(k)`` (the root, node 0, at depth 0, follows the
    committed state); bank k + 1 holds the fold of the path from the root to node k, except where node k
    closed the block (its descendants start a fresh one). Bank 0 is not modified (but by ``pending``).

    Args:
      state: ``[L, 1 + B, S, 3, D]`` float32 or bfloat16, updated in place (donate it).
      kv_score: ``[Lk, bs, N, 2*D]`` float32: the last accepted token and N-1 drafts (the tree's nodes, in
        its order), all valid, ``1 <= N <= min(B, 16)``.
      seq_lens: ``[bs]`` int32, tokens in the state before the verify.
      slots: ``[bs]`` int32, one row per slot, -1 for padding rows.
      ape: ``[Lk, 128, D]`` float32.
      layer: first state layer of the call (static).
      pending: optional ``[S]`` int32, per slot the ``seq_lens`` of its previous verify whose acceptance is
        not committed yet (-1 for none). Each row first commits it, with ``accept = seq_lens - pending``,
        exactly as :func:`commit` would, in the call's layers: the lazy commit and the next verify in one
        launch.
      pending_banks: optional ``[S]`` int32 (with ``pending`` only), per slot the bank that commit keeps, as
        :func:`commit`'s ``accept_banks`` (after a tree verify: the accepted node's k + 1); None: the chain's
        bank, the accept.
      tree: optional static draft tree of N nodes: its parents (a tuple of ints, ``tree[0] == -1`` and
        ``0 <= tree[k] < k``, as :func:`jax_oc128.tree.check_parents` checks them) or a
        :class:`~jax_oc128.tree.Tree`; None is the chain ``(-1, 0, 1, ..., N - 2)``, with its own kernel.

    Returns:
      ``(state, entries, entry_blocks)``. The chain: ``entries`` ``[Lk, bs, 1, D]`` float32 is the pre-norm
      entry of a block that closes inside the window (zero if none), ``entry_blocks`` ``[bs, 1]`` int32 its
      block index, -1 if none. A tree: per node, ``entries`` ``[Lk, bs, N, D]`` float32, the entry of the
      block node k closes (zero if none), ``entry_blocks`` ``[bs, N]`` int32 its index (-1 if none). An entry
      is only meaningful if the closing token is later accepted.
    """
    state, kv_score, seq_lens, slots, ape = _as_arrays(
        state=state, kv_score=kv_score, seq_lens=seq_lens, slots=slots, ape=ape
    )
    layers, banks, num_slots, dim = _check_state(state)
    if kv_score.ndim != 4:
        raise ValueError(f"kv_score: expected rank 4 [layers, batch, N, 2*head_dim], got {kv_score.shape}")
    call_layers, rows, tokens, _ = kv_score.shape
    _check_array("kv_score", kv_score, (call_layers, rows, tokens, 2 * dim), jnp.float32)
    if not 1 <= tokens <= min(banks - 1, MAX_DRAFT):
        raise ValueError(f"kv_score: N = {tokens} verify tokens, but the state holds max_draft = {banks - 1}")
    if tree is not None:
        tree = _check_tree(tree, tokens)
    _check_layers(layer, call_layers, layers)
    _check_rows(num_slots, seq_lens, slots, rows)
    _check_array("ape", ape, (call_layers, BLOCK, dim), jnp.float32)
    pending = _optional_table("pending", pending, (num_slots,))
    if pending_banks is not None and not pending.shape[0]:
        raise ValueError("pending_banks: given without pending")
    pending_banks = _optional_table("pending_banks", pending_banks, (num_slots,))
    _check_distinct_slots(slots)
    per_row = 1 if tree is None else tokens
    results = dict(
        state=jax.ShapeDtypeStruct(state.shape, state.dtype),
        entries=jax.ShapeDtypeStruct((call_layers, rows, per_row, dim), jnp.float32),
        entry_blocks=jax.ShapeDtypeStruct((rows, per_row), jnp.int32),
    )
    args = dict(
        state=state,
        kv_score=kv_score,
        seq_lens=seq_lens,
        slots=slots,
        ape=ape,
        pending=pending,
        pending_banks=pending_banks,
        tree=_constant(() if tree is None else tree),
    )
    return _dispatch("oc128_verify", reference.verify, args, results, dict(layer=layer))


def commit(
    state, seq_lens, accept_lens, slots, *, layer: int = 0, num_layers: int | None = None, accept_banks=None
):
    """Keep ``accept_lens`` tokens of the last verify: ``bank0 = bank[accept_banks]`` (the chain:
    ``bank[accept_lens]``) where ``accept > 0`` and ``(seq_lens + accept) % 128 != 0``, for layers
    ``layer .. layer + num_layers - 1`` (default: all from ``layer`` on) in one call.

    Args:
      state: ``[L, 1 + B, S, 3, D]`` float32 or bfloat16, updated in place (donate it).
      seq_lens: ``[bs]`` int32, as given to :func:`verify`.
      accept_lens: ``[bs]`` int32 in ``[0, N]``, the verify tokens kept (0 keeps nothing); after a tree
        verify, the accepted node's depth + 1.
      slots: ``[bs]`` int32, one row per slot, -1 for padding rows.
      accept_banks: optional ``[bs]`` int32 in ``[0, N]``, the bank of the last kept token: after a tree
        verify, the accepted node k's bank k + 1. None: the chain's, ``accept_lens``.

    Returns:
      The updated state.
    """
    state, seq_lens, accept_lens, slots = _as_arrays(
        state=state, seq_lens=seq_lens, accept_lens=accept_lens, slots=slots
    )
    layers, banks, num_slots, _ = _check_state(state)
    check_int("layer", layer, 0)
    if num_layers is None:
        num_layers = layers - layer
    else:
        check_int("num_layers", num_layers, 1)
    _check_layers(layer, num_layers, layers)
    rows = seq_lens.shape[0] if seq_lens.ndim == 1 else -1
    if rows < 0:
        raise ValueError(f"seq_lens: expected shape [batch], got {list(seq_lens.shape)}")
    _check_rows(num_slots, seq_lens, slots, rows)
    _check_array("accept_lens", accept_lens, (rows,), jnp.int32)
    _check_values("accept_lens", accept_lens, 0, banks - 1)
    chain = accept_banks is None
    accept_banks = _optional_table("accept_banks", accept_banks, (rows,))
    if not chain:
        _check_values("accept_banks", accept_banks, 0, banks - 1)
    _check_distinct_slots(slots)
    results = dict(state=jax.ShapeDtypeStruct(state.shape, state.dtype))
    args = dict(
        state=state, seq_lens=seq_lens, accept_lens=accept_lens, accept_banks=accept_banks, slots=slots
    )
    attrs = dict(layer=layer, num_layers=num_layers)
    return _dispatch("oc128_commit", reference.commit, args, results, attrs)
