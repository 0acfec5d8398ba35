"""The test machinery the test files share: tolerances and assertions, requests fed their true token streams
(the ``kv_score`` batches of their calls, drafts with junk after the accepted prefix), valid arguments for
the error tests, a tree copy, a compile counter and where two token outputs part. The float64 oracle is
:mod:`oracle`."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from oracle import BLOCK, Stream, random_ape, random_tokens, rel_err, state_err

import jax_oc128 as oc
from jax_oc128.nn import ForwardBatch, prepare_forward

# Native vs reference run the same float32 recurrence; they differ only in how exp and the divisions
# round (libm / CUDA expf vs XLA's exp), accumulated over at most 128 folds.
NATIVE_VS_REFERENCE_FP32 = 1e-5
# Against the float64 offline pooling (the bar for fp32).
OFFLINE_FP32 = 1e-4
# A bf16 state is rounded to 8 significant bits each time it is stored. Native and reference can round a
# value to neighbouring bf16 numbers when their fp32 values differ in the last bits: one bf16 ulp, 2**-8 of
# the value at the top of a binade and 2**-7 at its bottom. States are compared value by value against that
# (assert_state_close); this bound is for the float32 entries computed from bf16 states.
NATIVE_VS_REFERENCE_BF16 = 2**-8


# ---------------------------------------------------------------------------------------------------------
# States and assertions


def poisoned_state(rng, layers, slots, dim, max_draft, dtype=jnp.float32):
    """A state full of random values, so untouched rows can be checked bit for bit.

    Each row is a valid online state (sum > 0): a row read as the start of a fold is well conditioned.
    """
    values = rng.normal(size=(layers, 1 + max_draft, slots, 3, dim)).astype(np.float32)
    values[..., 1, :] = np.abs(values[..., 1, :]) + 0.5
    return jnp.asarray(values, dtype)


def assert_state_close(x, y, tol):
    """Per field (max, sum, mean): float32 states, normwise relative error below ``tol``; bfloat16 states,
    each value within one bf16 ulp of ``y``'s (7 stored bits: up to 2**-7 of the value, at the bottom of a
    binade) plus their float32 disagreement (``NATIVE_VS_REFERENCE_FP32`` of the field's largest value)."""
    bf16 = jnp.asarray(x).dtype == jnp.bfloat16
    x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
    assert x.shape == y.shape
    magnitude = np.abs(y)
    ulp = np.where(magnitude > 0, np.exp2(np.floor(np.log2(np.maximum(magnitude, 1e-30))) - 7), 0.0)
    for field, name in enumerate(("max", "sum", "mean")):
        if bf16:
            bound = ulp[..., field, :] + NATIVE_VS_REFERENCE_FP32 * magnitude[..., field, :].max()
            excess = (np.abs(x - y)[..., field, :] - bound).max()
            assert excess <= 0, f"state {name}: {excess:.3g} past one bf16 ulp"
        else:
            err = rel_err(x[..., field, :], y[..., field, :])
            assert err < tol, f"state {name}: relative error {err:.3g} >= {tol:.3g}"


def assert_outputs_match(native, ref, tol):
    """``(state, entries, entry_blocks)`` of a native op against its reference."""
    assert_state_close(native[0], ref[0], tol)
    if np.any(np.asarray(ref[1])):
        assert rel_err(native[1], ref[1]) < tol
    np.testing.assert_array_equal(np.asarray(native[1]) == 0, np.asarray(ref[1]) == 0)
    np.testing.assert_array_equal(native[2], ref[2])


def assert_untouched(before, after, keep):
    """``after`` equals ``before`` bit for bit wherever the boolean mask ``keep`` (broadcastable) is set."""
    before, after = np.asarray(before), np.asarray(after)
    keep = np.broadcast_to(keep, before.shape)
    np.testing.assert_array_equal(after[keep], before[keep])


def assert_wrote_nothing(outputs, state):
    """``(state, entries, entry_blocks)`` of a call whose rows were all skipped: the state as it was, no
    entries, every block -1."""
    np.testing.assert_array_equal(outputs[0], state)
    assert np.all(np.asarray(outputs[2]) == -1) and not np.any(np.asarray(outputs[1]))


_HLO_TYPES = {"float32": "f32", "bfloat16": "bf16"}


def assert_updated_in_place(step, state, *args):
    """``step`` (jitted, its first argument donated) writes the state's first array (the banks) in the
    caller's buffer: the compiled step aliases it and makes no copy of its shape, the donated input is
    consumed and the output's first array is at the input's address. Returns the step's output."""
    banks = jax.tree.leaves(state)[0]
    hlo = step.lower(state, *args).compile().as_text()
    assert "input_output_alias" in hlo
    shape = f"{_HLO_TYPES[banks.dtype.name]}[{','.join(map(str, banks.shape))}]"
    copies = [
        line
        for line in hlo.splitlines()
        if shape in line and (line.lstrip().startswith("copy") or " copy(" in line)
    ]
    assert not copies, copies
    pointer = banks.unsafe_buffer_pointer()
    out = step(state, *args)
    assert banks.is_deleted()
    assert jax.tree.leaves(out)[0].unsafe_buffer_pointer() == pointer
    return out


# ---------------------------------------------------------------------------------------------------------
# Requests fed their true token streams


class Request:
    """One request: its true token stream (a :class:`~oracle.Stream`), the ``seq`` tokens of it accepted so
    far, and for each block whose tokens were all accepted the entries emitted for it (block -> a tuple of
    entries, one per backend that emitted it). ``prompt``: the prompt length, for a simulation to use."""

    def __init__(self, rng, layers, length, dim, score_offset=0.0, prompt=0):
        self.stream = Stream(rng, layers, length, dim, score_offset)
        self.seq, self.prompt, self.entries = 0, prompt, {}

    def check(self, ape, tol=OFFLINE_FP32, last=None, name="request"):
        """Every closed block has its entries, and they equal the float64 offline pooling (only the ``last``
        ones recorded, when given)."""
        assert sorted(self.entries) == list(range(self.seq // BLOCK)), f"{name}: missing entries"
        recorded = list(self.entries.items())
        for block, entries in recorded[-last:] if last else recorded:
            expected = self.stream.entry(ape, block)
            for entry in entries:
                assert rel_err(entry, expected) < tol, f"{name} block {block}"

    def check_open(self, ape, rows, tol=OFFLINE_FP32, name="request"):
        """Stored rows ``[layers, 3, dim]`` of the open block equal its float64 online state (when a block is
        open)."""
        if self.seq % BLOCK:
            errors = state_err(rows, *self.stream.open_state(ape, self.seq))
            assert max(errors) < tol, f"{name} at {self.seq}: bank 0 errors (max, sum, mean) {errors}"


def kv_score(requests, counts, fill):
    """The ``kv_score`` batch of a call, ``fill`` ``[layers, rows, width, 2*dim]`` with row i's next
    ``counts[i]`` true tokens written in (those of ``requests[i]`` from its ``seq`` on; a None request, a
    padding row, gets none). The rest of a row keeps ``fill``: junk (drafts after the accepted prefix, or
    padding a call may read) or NaN (padding that must never be read)."""
    for i, (request, n) in enumerate(zip(requests, counts, strict=True)):
        if request is not None:
            fill[:, i, :n] = request.stream.rows[:, request.seq : request.seq + n]
    return jnp.asarray(fill)


def record_entries(requests, blocks, *entries, accepted=None):
    """Keeps in each row's request (None: a padding row) the entries ``[layers, rows, E, dim]`` (one array
    per backend) of the blocks ``blocks`` ``[rows, E]`` (-1: none) whose tokens were all accepted: every
    block a compress emits, and a block a verify emits when it ends within ``accepted[i]`` tokens."""
    blocks, entries = np.asarray(blocks), [np.asarray(e) for e in entries]
    for i, request in enumerate(requests):
        for e, block in enumerate(blocks[i]):
            final = accepted is None or (block + 1) * BLOCK <= accepted[i]
            if request is not None and block >= 0 and final:
                request.entries[int(block)] = tuple(x[:, i, e] for x in entries)


class Requests:
    """Requests, each in its slot of one compressed state (``layers`` layers, the calls covering those from
    ``call_layer`` on), fed their true token streams; ``length`` tokens each (a number or one per request).

    The random data is drawn from ``rng`` in this order: the streams, the ape, the state, then any junk.
    """

    def __init__(
        self,
        rng,
        slots,
        length,
        *,
        layers,
        call_layer,
        dim,
        max_draft,
        num_slots=None,
        dtype=jnp.float32,
        score_offset=0.0,
    ):
        self.rng, self.call_layer, self.dim = rng, call_layer, dim
        self.layers = layers - call_layer  # those the calls cover
        self.slots = np.asarray(slots, np.int32)
        lengths = np.broadcast_to(length, self.slots.shape)
        self.requests = [Request(rng, self.layers, int(n), dim, score_offset) for n in lengths]
        self.ape = random_ape(rng, self.layers, dim)  # numpy: the oracle computes in float64
        num_slots = int(self.slots.max()) + 2 if num_slots is None else num_slots
        self.state = poisoned_state(rng, layers, num_slots, dim, max_draft, dtype)

    @property
    def seq(self):
        return np.asarray([r.seq for r in self.requests], np.int32)

    def kv_score(self, counts, width=None, pad=None):
        """The batch of a call carrying ``counts[i]`` more tokens of request i, ``width`` wide (default: the
        largest count); the rest is junk from the rng, or ``pad`` when given."""
        width = int(np.max(counts)) if width is None else width
        shape = (self.layers, len(self.requests), width)
        if pad is None:
            fill = random_tokens(self.rng, shape, self.dim)
        else:
            fill = np.full((*shape, 2 * self.dim), pad, np.float32)
        return kv_score(self.requests, counts, fill)

    def advance(self, counts):
        for request, n in zip(self.requests, counts, strict=True):
            request.seq += int(n)

    def compress(self, new_lens, width=None, pad=None, ops=oc):
        """Feed ``new_lens[i]`` more tokens of request i through ``ops.compress`` (the native op, or
        :mod:`jax_oc128.reference`); records the entries."""
        new_lens = np.asarray(new_lens, np.int32)
        kv = self.kv_score(new_lens, width, pad)
        args = (jnp.asarray(self.seq), jnp.asarray(new_lens), jnp.asarray(self.slots), jnp.asarray(self.ape))
        outputs = ops.compress(self.state, kv, *args, layer=self.call_layer)
        self.state = outputs[0]
        record_entries(self.requests, outputs[2], outputs[1])
        self.advance(new_lens)
        return outputs

    def bank0(self, i):
        """Bank 0 of request i's slot in the calls' layers, ``[layers, 3, dim]`` float32."""
        return np.asarray(self.state[self.call_layer :, 0, self.slots[i]], np.float32)

    def check(self, tol=OFFLINE_FP32):
        """Every request's entries and its slot's bank 0 against the float64 oracle."""
        for i, request in enumerate(self.requests):
            request.check(self.ape, tol, name=f"request {i}")
            request.check_open(self.ape, self.bank0(i), tol, name=f"request {i}")


# ---------------------------------------------------------------------------------------------------------
# Arguments, trees, compilations


def ints(*values):
    """An int32 array of ``values``."""
    return jnp.asarray(values, jnp.int32)


def valid_args(op, *, rows=2, tokens=3, layers=2, slots=4, dim=64, max_draft=4):
    """Valid keyword arguments of the op named ``op`` ("compress", "verify" or "commit"): zeros, and one
    slot per row (rows <= slots), for the error tests to change one at a time."""
    zeros = jnp.zeros((rows,), jnp.int32)
    row_slots = jnp.arange(rows, dtype=jnp.int32)
    args = dict(state=oc.init_state(layers, slots, dim, max_draft), seq_lens=zeros, slots=row_slots)
    if op == "commit":
        return args | dict(accept_lens=zeros)
    args |= dict(
        kv_score=jnp.zeros((layers, rows, tokens, 2 * dim), jnp.float32),
        ape=jnp.zeros((layers, BLOCK, dim), jnp.float32),
    )
    return args | dict(new_lens=zeros) if op == "compress" else args


def copy_tree(tree):
    """A copy of every array of a pytree (to keep a state that a donating call will consume)."""
    return jax.tree.map(jnp.copy, tree)


@contextlib.contextmanager
def count_compiles():
    """Counts the XLA compilations of jitted functions inside the block, by function name (through
    jax.monitoring's compile events): ``with count_compiles() as compiles: ...; compiles["f"]``."""
    compiles = collections.Counter()

    def listener(event, duration, **kwargs):
        name = kwargs.get("fun_name", "")
        if event == "/jax/core/compile/backend_compile_duration" and name.startswith("jit("):
            compiles[name[len("jit(") : -1]] += 1

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield compiles
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


@functools.cache
def jit_op(impl, op):
    """The op named ``op`` ("compress", "verify" or "commit") of ``impl`` (:mod:`jax_oc128` or its
    reference), jitted with its static arguments (once: its compilations are kept): its row values are
    traced, so they reach the device unchecked (the on-device policies)."""
    static = ("layer", "num_layers") if op == "commit" else ("layer",)
    return jax.jit(getattr(impl, op), static_argnames=static)


def first_difference(a: list, b: list) -> int:
    """The index of the first token where two outputs of one length differ (their length if none)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def state_bits(state):
    """The state's bytes as unsigned integers of its width, to compare bit for bit (NaN payloads included)."""
    state = np.asarray(state)
    return state.view(np.uint32 if state.dtype.itemsize == 4 else np.uint16)


def poisoned_entries(state):
    """A decode ``state`` with every page of every pool (dense: every slot's entries and indexer keys) NaN
    (the float leaves; FP8 and integer leaves left): a read of what a slot has not written shows."""
    layers = [
        dataclasses.replace(
            layer,
            entries=jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), layer.entries),
            index_keys=jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), layer.index_keys),
        )
        for layer in state.cache.layers
    ]
    return dataclasses.replace(state, cache=dataclasses.replace(state.cache, layers=tuple(layers)))


# ---------------------------------------------------------------------------------------------------------
# Attention layers


def run_layer_chunks(layer, chunks, caches=None):
    """A :class:`~jax_oc128.nn.DeepseekV4Attention` ``layer``'s outputs over chunks of random inputs from
    position 0, two rows (row 0 every token of each chunk, row 1 7 fewer), each row's valid outputs
    concatenated, and its ``(cache, compressed)`` after them (from ``caches``, default the layer's empty
    ones); jitted afresh (module constants such as loop sizes are read at trace)."""
    graphdef, params = nnx.split(layer)

    @jax.jit
    def step(caches, x, first, lengths):
        cache, compressed = caches
        positions = first[:, None] + jnp.arange(x.shape[1], dtype=jnp.int32)
        fb = ForwardBatch.create(positions, lengths=lengths, mode=oc.ForwardMode.EXTEND)
        y, cache, compressed = nnx.merge(graphdef, params)(x, cache, prepare_forward(compressed, fb), fb)
        return y, (cache, compressed)

    rng = np.random.default_rng(3)
    caches = caches or (layer.init_cache(2), layer.init_compressed(2))
    outputs, first = [[], []], np.zeros(2, np.int32)
    for tokens in chunks:
        x = jnp.asarray(rng.standard_normal((2, tokens, layer.config.hidden_size)), jnp.float32)
        lengths = np.asarray([tokens, tokens - 7], np.int32)
        y, caches = step(caches, x, jnp.asarray(first), jnp.asarray(lengths))
        for row in range(2):
            outputs[row].append(np.asarray(y[row, : lengths[row]]))
        first += lengths
    return [np.concatenate(row) for row in outputs], caches
