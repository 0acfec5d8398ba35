"""Tree speculation at the op level: verify(tree=) writes, for every node, the fold of its root-to-node path,
and commit(accept_banks=) keeps any node; checked per path against the float64 offline pooling."""

from __future__ import annotations

import copy
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import (
    NATIVE_VS_REFERENCE_BF16,
    NATIVE_VS_REFERENCE_FP32,
    OFFLINE_FP32,
    Requests,
    assert_outputs_match,
    assert_state_close,
    assert_untouched,
    assert_wrote_nothing,
    ints,
    jit_op,
    poisoned_state,
    record_entries,
    state_bits,
    valid_args,
)
from oracle import BLOCK, random_ape, random_tokens, rel_err, state_err

import jax_oc128 as oc
from jax_oc128 import reference
from jax_oc128.controller import Controller, ForwardMode
from jax_oc128.state import CompressState
from jax_oc128.tree import Tree

LAYERS, CALL_LAYER, DIM, MAX_DRAFT = 3, 1, 64, 16
CALL_LAYERS = LAYERS - CALL_LAYER
# A bf16 state is rounded once by the prefill and once by the verify's store (each fold in fp32): 2 ulps.
OFFLINE_BF16 = 2**-7

#: EAGLE-style trees: two candidates per level (a binary tree of 15 nodes, depths 0..3), the chain written as
#: a tree, a wide one (ten children of the root) and a star-and-chain mix of 16 nodes (depth up to 8)
BINARY = (-1, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6)
CHAIN8 = (-1, 0, 1, 2, 3, 4, 5, 6)
WIDE = (-1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
MIXED = (-1, 0, 0, 1, 2, 3, 3, 4, 6, 6, 8, 9, 10, 11, 12, 13)


@functools.cache
def jit_verify(impl):
    """``impl.verify`` (:mod:`jax_oc128` or its reference) jitted, its rows traced: the op's tree is static,
    the twin's an array."""
    return jax.jit(impl.verify, static_argnames=("layer", "tree") if impl is oc else ("layer",))


def tree_arg(impl, tree):
    """``tree`` as ``impl.verify`` takes it: a tuple for the op, an int32 array for the twin."""
    return tree if impl is oc else jnp.asarray(tree, jnp.int32)


def assert_same_bits(xs, ys):
    for x, y in zip(xs, ys, strict=True):
        np.testing.assert_array_equal(state_bits(x), state_bits(y))


def depths(tree):
    """Each node's depth (the root's is 0)."""
    out = []
    for parent in tree:
        out.append(0 if parent < 0 else out[parent] + 1)
    return out


def path(tree, node):
    """The nodes from the root to ``node``, in order."""
    nodes = [node]
    while tree[nodes[-1]] >= 0:
        nodes.append(tree[nodes[-1]])
    return nodes[::-1]


def random_tree(rng, n):
    """A random tree of ``n`` nodes: each node's parent is its predecessor (half the time: deep paths) or any
    earlier node (wide levels)."""
    return (-1, *(int(k - 1 if rng.random() < 0.5 else rng.integers(0, k)) for k in range(1, n)))


def along(stream, seq, node_rows):
    """The oracle stream of a path: the first ``seq`` tokens of ``stream``, then ``node_rows``
    ``[layers, n, 2*dim]`` (the path's tokens)."""
    out = copy.copy(stream)
    out.rows = np.concatenate([stream.rows[:, :seq], node_rows], axis=1)
    return out


def offsets_for(tree):
    """Block offsets of seq near block ends for ``tree``: 0, 1, and those where the deepest, the middle and
    the first level close a block (a level of several nodes closes several blocks at one depth)."""
    deepest = max(depths(tree))
    return [0, 1, BLOCK - 1 - deepest, BLOCK - 1 - deepest // 2, BLOCK - 1]


def prefilled(rng, seq, dtype=jnp.float32, shared_stream=False):
    """Requests in slots 1..rows (slot 0 and the last one belong to nobody), prefilled to ``seq``; with
    ``shared_stream`` every request carries the first one's tokens."""
    slots = (rng.permutation(len(seq)) + 1).astype(np.int32)
    reqs = Requests(
        rng,
        slots,
        int(max(seq)) + 200,
        layers=LAYERS,
        call_layer=CALL_LAYER,
        dim=DIM,
        max_draft=MAX_DRAFT,
        num_slots=len(seq) + 2,
        dtype=dtype,
    )
    if shared_stream:
        for request in reqs.requests:
            request.stream = reqs.requests[0].stream
    reqs.compress(np.asarray(seq, np.int32), pad=0.0)
    return reqs


def check_nodes(reqs, tree, nodes_kv, before, outputs, tol):
    """Per row and node: bank k + 1 of the row's slot holds the float64 open state of the node's path, or,
    where the node closes a block, its entry is the float64 pooling of that block; nothing else changed."""
    state, entries, blocks = (np.asarray(x) for x in outputs)
    assert entries.shape == (CALL_LAYERS, len(reqs.requests), len(tree), DIM)
    keep = np.ones(state.shape[:3], bool)
    for i, request in enumerate(reqs.requests):
        seq, slot = request.seq, reqs.slots[i]
        for k, depth in enumerate(depths(tree)):
            stream = along(request.stream, seq, nodes_kv[:, i, path(tree, k)])
            end = seq + depth + 1  # tokens up to and with node k
            if end % BLOCK == 0:
                assert blocks[i, k] == end // BLOCK - 1, (i, k)
                assert rel_err(entries[:, i, k], stream.entry(reqs.ape, blocks[i, k])) < tol, (i, k)
            else:
                assert blocks[i, k] == -1 and not np.any(entries[:, i, k]), (i, k)
                errors = state_err(state[CALL_LAYER:, k + 1, slot], *stream.open_state(reqs.ape, end))
                assert max(errors) < tol, f"row {i} node {k}: (max, sum, mean) errors {errors}"
                keep[CALL_LAYER:, k + 1, slot] = False
    assert_untouched(before, state, keep[..., None, None])


@pytest.mark.parametrize(
    "tree, seed",
    [(BINARY, 0), (CHAIN8, 1), (WIDE, 2), (MIXED, 3), ((-1,), 4)]
    + [(random_tree(np.random.default_rng(seed), n), seed) for seed, n in ((5, 16), (6, 9), (7, 16))],
)
def test_every_path_is_the_offline_pooling(tree, seed, dtype=jnp.float32, tol=OFFLINE_FP32):
    """Rows at offsets near block ends (and a padding row with NaN tokens): every root-to-node path's bank or
    entry equals the float64 pooling of that path, native == jnp twin, nothing else written."""
    rng = np.random.default_rng(seed)
    offsets = offsets_for(tree)
    seq = np.asarray([BLOCK * (1 + i % 2) + o for i, o in enumerate(offsets)], np.int32)
    reqs = prefilled(rng, seq, dtype)
    nodes_kv = random_tokens(rng, (CALL_LAYERS, len(seq), len(tree)), DIM)
    padding = np.full((CALL_LAYERS, 1, len(tree), 2 * DIM), np.nan, np.float32)  # must never be read
    kv = jnp.asarray(np.concatenate([nodes_kv, padding], axis=1))
    args = (kv, jnp.asarray(np.r_[seq, 5]), jnp.asarray(np.r_[reqs.slots, -1]), jnp.asarray(reqs.ape))

    outputs = oc.verify(reqs.state, *args, layer=CALL_LAYER, tree=tree)
    twin = jit_verify(reference)(reqs.state, *args, tree=tree_arg(reference, tree), layer=CALL_LAYER)
    tolerance = NATIVE_VS_REFERENCE_FP32 if dtype == jnp.float32 else NATIVE_VS_REFERENCE_BF16
    assert_outputs_match(outputs, twin, tolerance)
    entries, blocks = np.asarray(outputs[1]), np.asarray(outputs[2])
    assert blocks.shape == (len(seq) + 1, len(tree))
    assert np.all(blocks[-1] == -1) and not np.any(entries[:, -1])  # the padding row
    real = (outputs[0], entries[:, :-1], blocks[:-1])
    check_nodes(reqs, tree, nodes_kv, reqs.state, real, tol)


@pytest.mark.parametrize("tree, seed", [(BINARY, 10), (MIXED, 11)])
def test_every_path_bf16(tree, seed):
    """bf16 state: each stored bank is rounded once more than the prefill's (2 bf16 ulps of the offline)."""
    test_every_path_is_the_offline_pooling(tree, seed, jnp.bfloat16, OFFLINE_BF16)


def continue_after(reqs, state, tokens):
    """Fold ``tokens`` ``[layers, rows, T, 2*dim]`` into every row (a compress from ``reqs.seq``)."""
    new = np.full(len(reqs.requests), tokens.shape[2], np.int32)
    args = (jnp.asarray(reqs.seq), jnp.asarray(new), jnp.asarray(reqs.slots), jnp.asarray(reqs.ape))
    return oc.compress(state, jnp.asarray(tokens), *args, layer=CALL_LAYER)


@pytest.mark.parametrize("offset", [1, 120, 125])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_commit_of_any_node_then_continuing_is_the_chain_of_its_path(offset, dtype):
    """One row per node of a 16-node tree, all at one seq with one committed state: row k commits node k
    (accept = depth + 1, bank k + 1). Bit for bit what a chain verify of node k's path and its commit give,
    and so is everything after (a compress across the next block); against float64, bank 0 is the open state
    of the accepted stream and every entry its offline pooling."""
    rng = np.random.default_rng(offset)
    tree = MIXED
    n, depth = len(tree), depths(tree)
    seq = np.full(n, BLOCK + offset, np.int32)
    reqs = prefilled(rng, seq, dtype, shared_stream=True)
    nodes_kv = np.broadcast_to(random_tokens(rng, (CALL_LAYERS, 1, n), DIM), (CALL_LAYERS, n, n, 2 * DIM))
    seq_j, slots_j, ape = jnp.asarray(seq), jnp.asarray(reqs.slots), jnp.asarray(reqs.ape)
    accept = np.asarray([d + 1 for d in depth], np.int32)
    banks = np.arange(1, n + 1, dtype=np.int32)

    tree_state, tree_entries, tree_blocks = oc.verify(
        reqs.state, jnp.asarray(nodes_kv), seq_j, slots_j, ape, layer=CALL_LAYER, tree=tree
    )
    tree_state = oc.commit(
        tree_state, seq_j, jnp.asarray(accept), slots_j, layer=CALL_LAYER, accept_banks=banks
    )

    width = max(accept)  # the chain: node k's path, then junk
    chain_kv = random_tokens(rng, (CALL_LAYERS, n, width), DIM)
    for k in range(n):
        chain_kv[:, k, : accept[k]] = nodes_kv[:, k, path(tree, k)]
    chain_state, chain_entries, chain_blocks = oc.verify(
        reqs.state, jnp.asarray(chain_kv), seq_j, slots_j, ape, layer=CALL_LAYER
    )
    chain_state = oc.commit(chain_state, seq_j, jnp.asarray(accept), slots_j, layer=CALL_LAYER)
    bank0 = (slice(CALL_LAYER, None), 0, reqs.slots)
    np.testing.assert_array_equal(state_bits(tree_state[bank0]), state_bits(chain_state[bank0]))

    tol = OFFLINE_FP32 if dtype == jnp.float32 else OFFLINE_BF16
    for k, request in enumerate(reqs.requests):  # the accepted stream: node k's path
        request.stream = along(request.stream, request.seq, nodes_kv[:, k, path(tree, k)])
        closed = np.flatnonzero(np.asarray(tree_blocks)[k] >= 0)
        for node in set(closed) & set(path(tree, k)):  # a block the accepted path closed
            block = int(np.asarray(tree_blocks)[k, node])
            assert np.asarray(chain_blocks)[k, 0] == block
            np.testing.assert_array_equal(tree_entries[:, k, node], chain_entries[:, k, 0])
            request.entries[block] = (np.asarray(tree_entries[:, k, node]),)
    reqs.advance(accept)
    reqs.state = tree_state
    for k, request in enumerate(reqs.requests):
        request.check_open(reqs.ape, reqs.bank0(k), tol, name=f"node {k}")

    after = random_tokens(rng, (CALL_LAYERS, n, 140), DIM)
    for k, request in enumerate(reqs.requests):
        request.stream.rows = np.concatenate([request.stream.rows[:, : request.seq], after[:, k]], axis=1)
    from_tree, from_chain = continue_after(reqs, tree_state, after), continue_after(reqs, chain_state, after)
    np.testing.assert_array_equal(state_bits(from_tree[0][bank0]), state_bits(from_chain[0][bank0]))
    assert_same_bits(from_tree[1:], from_chain[1:])
    reqs.state = from_tree[0]
    record_entries(reqs.requests, from_tree[2], from_tree[1])
    reqs.advance(np.full(n, 140))
    reqs.check(tol)


def test_chain_is_unchanged():
    """tree=None and the chain written as a tree fold the same: the same state bits natively; the chain's one
    entry is the tree's closing node's. accept_banks=None is accept_banks=accept_lens, pending_banks=None the
    chain's bank (seq_lens - pending), bit for bit. Native and jnp twin alike."""
    rng = np.random.default_rng(20)
    n, rows = 6, 5
    state = poisoned_state(rng, LAYERS, 8, DIM, MAX_DRAFT)
    slots, seq = ints(3, 0, 7, -1, 5), ints(250, 128, 127, 4, 100)
    pending = np.full(8, -1, np.int32)
    pending[[3, 0, 5]] = [247, 125, 50]  # accept 3; 3 (the block closed: nothing); 50 (past max: nothing)
    seq_of_slot = np.zeros(8, np.int32)
    seq_of_slot[[3, 0, 7, 5]] = [250, 128, 127, 100]
    chain_banks = jnp.asarray(np.where(pending >= 0, seq_of_slot - pending, 0).astype(np.int32))
    pending = jnp.asarray(pending)
    kv = jnp.asarray(random_tokens(rng, (CALL_LAYERS, rows, n), DIM))
    ape = jnp.asarray(random_ape(rng, CALL_LAYERS, DIM))
    as_tree = tuple(range(-1, n - 1))
    for impl in (oc, reference):
        verify = jit_verify(impl)
        chain = verify(state, kv, seq, slots, ape, pending=pending, layer=CALL_LAYER)
        banked = verify(
            state, kv, seq, slots, ape, pending=pending, pending_banks=chain_banks, layer=CALL_LAYER
        )
        assert_same_bits(chain, banked)
        treed = verify(
            state, kv, seq, slots, ape, pending=pending, layer=CALL_LAYER, tree=tree_arg(impl, as_tree)
        )
        as_chain = (treed[0], np.sum(treed[1], axis=2, keepdims=True), np.max(treed[2], axis=1)[:, None])
        if impl is oc:
            assert_same_bits(chain, as_chain)
        else:  # XLA fuses the twin's tree (selects of each parent's state) otherwise: last bits may differ
            assert_outputs_match(chain, as_chain, NATIVE_VS_REFERENCE_FP32)
        assert np.sum(np.asarray(treed[2]) >= 0) == 2  # seq 250 closes at node 5, seq 127 at node 0

        accept = ints(2, 1, 4, 0, 6)
        commit = jit_op(impl, "commit")
        plain = commit(chain[0], seq, accept, slots, layer=CALL_LAYER)
        np.testing.assert_array_equal(
            state_bits(plain),
            state_bits(commit(chain[0], seq, accept, slots, layer=CALL_LAYER, accept_banks=accept)),
        )


def test_lazy_commit_keeps_the_pending_bank():
    """verify(pending, pending_banks) does what commit(accept_banks) followed by verify does, for a tree
    verify after a tree verify; a bank outside [1, max_draft] (or 0) commits nothing."""
    rng = np.random.default_rng(21)
    tree = (-1, 0, 0, 1, 2, 2)  # the previous verify's banks (up to 16) are what matter here
    state = poisoned_state(rng, LAYERS, 8, DIM, MAX_DRAFT)
    slots, seq = ints(0, 3, 5, 7, 2, -1), ints(130, 257, 640, 72, 300, 9)
    pending = np.full(8, -1, np.int32)
    pending[[0, 3, 5, 7, 2]] = [127, 253, 637, 70, 299]  # accept 3, 4, 3 (closes a block), 2, 1
    pending_banks = np.zeros(8, np.int32)
    pending_banks[[0, 3, 5, 7, 2]] = [9, 11, 4, 17, 1]  # bank 17 is past max_draft: nothing committed
    kv = jnp.asarray(random_tokens(rng, (CALL_LAYERS, 6, len(tree)), DIM))
    ape = jnp.asarray(random_ape(rng, CALL_LAYERS, DIM))
    pending, pending_banks = jnp.asarray(pending), jnp.asarray(pending_banks)
    before = jnp.where(slots >= 0, pending[jnp.maximum(slots, 0)], -1)
    accept_banks = jnp.where(before >= 0, pending_banks[jnp.maximum(slots, 0)], 0)
    accept = jnp.where(before >= 0, seq - before, 0)
    commit_args = (jnp.maximum(before, 0), accept, jnp.where(before >= 0, slots, -1))
    expected = np.asarray(state).copy()
    for slot, bank in ((0, 9), (3, 11), (2, 1)):  # slot 5: its block closed; slot 7: bank 17
        expected[CALL_LAYER:, 0, slot] = expected[CALL_LAYER:, bank, slot]
    results = []
    for impl in (oc, reference):
        verify, tree_ = jit_verify(impl), tree_arg(impl, tree)
        fused = verify(
            state,
            kv,
            seq,
            slots,
            ape,
            layer=CALL_LAYER,
            pending=pending,
            pending_banks=pending_banks,
            tree=tree_,
        )
        committed = jit_op(impl, "commit")(state, *commit_args, layer=CALL_LAYER, accept_banks=accept_banks)
        np.testing.assert_array_equal(np.asarray(committed), expected)
        assert_same_bits(fused, verify(committed, kv, seq, slots, ape, layer=CALL_LAYER, tree=tree_))
        results.append(fused)
    assert_outputs_match(*results, NATIVE_VS_REFERENCE_FP32)


def test_banks_out_of_range_on_device_commit_nothing():
    """Traced accept_banks outside [1, max_draft] (or 0) commit nothing, but the row still holds its slot (a
    later row with that slot is skipped)."""
    rng = np.random.default_rng(22)
    state = poisoned_state(rng, 2, 4, DIM, 4)
    seq, accept, slots = ints(5, 9, 20, 30), ints(2, 3, 1, 2), ints(0, 1, 2, 2)
    for impl in (oc, reference):
        commit = jit_op(impl, "commit")
        out = commit(state, seq, accept, slots, accept_banks=ints(-1, 5, 0, 3))
        np.testing.assert_array_equal(state_bits(out), state_bits(state))
        out = commit(state, seq, accept, slots, accept_banks=ints(4, 5, 2, 3))
        expected = np.asarray(state).copy()
        expected[:, 0, 0], expected[:, 0, 2] = expected[:, 4, 0], expected[:, 2, 2]
        np.testing.assert_array_equal(out, expected)


def test_padding_only_and_empty_batches():
    rng = np.random.default_rng(23)
    state = poisoned_state(rng, 2, 3, DIM, 4)
    kv = jnp.asarray(random_tokens(rng, (2, 2, 4), DIM))
    ape = jnp.asarray(random_ape(rng, 2, DIM))
    for impl in (oc, reference):
        out = jit_verify(impl)(state, kv, ints(127, 5), ints(-1, -1), ape, tree=tree_arg(impl, (-1, 0, 0, 2)))
        assert out[2].shape == (2, 4) and out[1].shape == (2, 2, 4, DIM)
        assert_wrote_nothing(out, state)
    empty = jnp.zeros((0,), jnp.int32)
    out = oc.verify(state, jnp.zeros((2, 0, 3, 2 * DIM)), empty, empty, ape, tree=(-1, 0, 0))
    assert out[1].shape == (2, 0, 3, DIM) and out[2].shape == (0, 3)
    np.testing.assert_array_equal(oc.commit(out[0], empty, empty, empty, accept_banks=empty), state)


def test_tree_may_be_a_tree_or_a_list():
    """``tree=`` takes a :class:`~jax_oc128.tree.Tree` or any sequence of parents alike."""
    rng = np.random.default_rng(25)
    state = poisoned_state(rng, 2, 3, DIM, 4)
    kv = jnp.asarray(random_tokens(rng, (2, 2, 4), DIM))
    args = (state, kv, ints(126, 5), ints(2, 0), jnp.asarray(random_ape(rng, 2, DIM)))
    parents = (-1, 0, 0, 1)
    want = oc.verify(*args, tree=parents)
    for tree in (Tree(parents), list(parents)):
        assert_same_bits(oc.verify(*args, tree=tree), want)


@pytest.mark.parametrize("last_commit", ["eager", "decode forward"])
def test_controller_carries_the_accepted_bank(last_commit):
    """Controller: a tree verify, the accepted node named at the next forward (lazily, inside the next tree
    verify), then the last one committed eagerly or by a decode forward's prepare_forward; open_state and
    then bank 0 follow the accepted stream (float64)."""
    rng = np.random.default_rng(24)
    tree, depth = BINARY, depths(BINARY)
    seq = np.asarray([BLOCK + 124, 2 * BLOCK + 7], np.int32)
    reqs = prefilled(rng, seq)
    ctl = Controller()
    cs = CompressState.create(LAYERS, reqs.state.shape[2], DIM, MAX_DRAFT).replace(banks=reqs.state)
    slots, ape = jnp.asarray(reqs.slots), jnp.asarray(reqs.ape)
    step = jax.jit(
        lambda cs, kv, seq, banks: ctl.write_prefix(
            ctl.prepare_forward(cs, ForwardMode.TARGET_VERIFY, slots, seq, accept_banks=banks),
            kv,
            seq,
            slots,
            ape,
            layer=CALL_LAYER,
            tree=tree,
        )[0]
    )
    banks = ints(0, 0)  # nothing pending yet
    for accepted in ([14, 5], [3, 0]):  # nodes of depth 3 / 2, then 2 / 0
        nodes_kv = random_tokens(rng, (CALL_LAYERS, 2, len(tree)), DIM)
        cs = step(cs, jnp.asarray(nodes_kv), jnp.asarray(reqs.seq), banks)
        for i, k in enumerate(accepted):
            request = reqs.requests[i]
            request.stream = along(request.stream, request.seq, nodes_kv[:, i, path(tree, k)])
        banks = ints(*(k + 1 for k in accepted))
        reqs.advance([depth[k] + 1 for k in accepted])
    opened = ctl.open_state(cs, slots, jnp.asarray(reqs.seq), ape, accept_banks=banks)
    for i, request in enumerate(reqs.requests):
        rows = np.stack([np.asarray(field)[CALL_LAYER:, i] for field in opened], axis=1)
        request.check_open(reqs.ape, rows, name=f"open_state row {i}")
    if last_commit == "eager":
        accept = ints(*(depth[k] + 1 for k in accepted))
        cs = ctl.commit(cs, slots, jnp.asarray(reqs.seq - np.asarray(accept)), accept, accept_banks=banks)
    else:
        cs = ctl.prepare_forward(cs, ForwardMode.DECODE, slots, jnp.asarray(reqs.seq), accept_banks=banks)
    assert np.all(np.asarray(cs.pending)[reqs.slots] == -1)
    reqs.state = cs.banks
    for i, request in enumerate(reqs.requests):
        request.check_open(reqs.ape, reqs.bank0(i), name=f"row {i}")


@pytest.mark.parametrize(
    "tree, error, match",
    [
        ("x", TypeError, "tree: must be a sequence of ints"),
        ((-1, 0.0, 1), TypeError, r"tree: tree\[1\] must be an int"),
        ((-1, True, 1), TypeError, r"tree: tree\[1\] must be an int"),
        ((0, 0, 1), ValueError, r"tree: tree\[0\] must be -1"),
        ((-1, 1, 1), ValueError, r"tree: tree\[1\] must be in \[0, 1\)"),
        ((-1, 0, -1), ValueError, r"tree: tree\[2\] must be in \[0, 2\)"),
        ((-1, 0), ValueError, "tree: 2 nodes, but kv_score has num_tokens = 3"),
        (tuple(range(-1, 16)), ValueError, "tree: must have 1 to 16"),
    ],
)
def test_bad_trees_are_named(tree, error, match):
    with pytest.raises(error, match=match):
        oc.verify(**valid_args("verify"), tree=tree)


@pytest.mark.parametrize(
    "op, change, error, match",
    [
        ("verify", dict(pending_banks=ints(1, 1, 1, 1)), ValueError, "pending_banks: given without pending"),
        (
            "verify",
            dict(pending=ints(-1, -1, -1, -1), pending_banks=ints(1, 1)),
            ValueError,
            r"pending_banks: expected shape \[4\]",
        ),
        (
            "verify",
            dict(pending=ints(-1, -1, -1, -1), pending_banks=jnp.zeros(4)),
            TypeError,
            "pending_banks: expected dtype",
        ),
        ("commit", dict(accept_banks=ints(0, 5)), ValueError, r"accept_banks: values must be in \[0, 4\]"),
        ("commit", dict(accept_banks=ints(0)), ValueError, r"accept_banks: expected shape \[2\]"),
        ("commit", dict(accept_banks="x"), TypeError, "accept_banks: expected an array"),
    ],
)
def test_bad_banks_are_named(op, change, error, match):
    with pytest.raises(error, match=match):
        getattr(oc, op)(**(valid_args(op) | change))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_cuda_tree_matches_cpu(dtype):
    """A tree verify with lazy commits of accepted banks, then a commit of accepted nodes, on both devices
    (head_dim 512 and 96: both CUDA block widths)."""
    tol = NATIVE_VS_REFERENCE_FP32 if dtype == jnp.float32 else NATIVE_VS_REFERENCE_BF16
    gpu, cpu = jax.devices("gpu")[0], jax.devices("cpu")[0]
    for dim in (512, 96):
        rng = np.random.default_rng(dim)
        rows, num_slots, tree = 6, 9, MIXED
        state = poisoned_state(rng, LAYERS, num_slots, dim, MAX_DRAFT, dtype)
        kv = jnp.asarray(random_tokens(rng, (CALL_LAYERS, rows, len(tree)), dim))
        ape = jnp.asarray(random_ape(rng, CALL_LAYERS, dim))
        seq, slots = ints(125, 127, 0, 300, 126, 60), ints(3, 0, 8, -1, 5, 1)
        pending = ints(-1, 59, -1, 120, -1, 123, -1, -1, -1)
        pending_banks = ints(0, 1, 0, 7, 0, 3, 0, 0, 0)
        accept, banks = ints(4, 1, 2, 3, 9, 2), ints(5, 1, 3, 4, 16, 3)
        outputs = []
        for device in (gpu, cpu):
            on = [jax.device_put(x, device) for x in (state, kv, seq, slots, ape, pending, pending_banks)]
            s, e, b = oc.verify(*on[:5], layer=CALL_LAYER, pending=on[5], pending_banks=on[6], tree=tree)
            s = oc.commit(
                s, on[2], jax.device_put(accept, device), on[3], accept_banks=jax.device_put(banks, device)
            )
            outputs.append([np.asarray(x) for x in (s, e, b)])
        assert_state_close(outputs[0][0], outputs[1][0], tol)
        assert_outputs_match(outputs[0], outputs[1], tol)
