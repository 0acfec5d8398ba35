"""The native modules: each op passes its operands by name, in the order of the C++ binding, and a native
module that takes other operands than this source passes (another version's build) is refused."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_oc128 as oc
from jax_oc128 import _native, ops

pytestmark = pytest.mark.gpu  # in the GPU lane: the native modules' bindings

LAYERS, SLOTS, DIM, MAX_DRAFT, ROWS = 2, 3, 32, 2, 2
TREE = (-1, 0)


def _rows(*values):
    return jnp.asarray(values, jnp.int32)


def _calls():
    """target -> (the op's call, the arrays it passes by name, the attributes it passes)."""
    state = oc.init_state(LAYERS, SLOTS, DIM, MAX_DRAFT)
    ape = jnp.zeros((LAYERS, ops.BLOCK, DIM), jnp.float32)
    seq_lens, slots = _rows(0, 5), _rows(0, 2)
    compress = dict(
        state=state,
        kv_score=jnp.zeros((LAYERS, ROWS, 3, 2 * DIM), jnp.float32),
        seq_lens=seq_lens,
        new_lens=_rows(3, 1),
        slots=slots,
        ape=ape,
    )
    verify = dict(
        state=state,
        kv_score=jnp.zeros((LAYERS, ROWS, MAX_DRAFT, 2 * DIM), jnp.float32),
        seq_lens=seq_lens,
        slots=slots,
        ape=ape,
        pending=jnp.full((SLOTS,), -1, jnp.int32),
        pending_banks=jnp.full((SLOTS,), 1, jnp.int32),
        tree=np.asarray(TREE, np.int32),  # the op gets a tuple and passes it as a constant array
    )
    commit = dict(
        state=state, seq_lens=seq_lens, accept_lens=_rows(1, 0), accept_banks=_rows(2, 0), slots=slots
    )
    return {
        "oc128_compress": (lambda **a: oc.compress(**a, layer=0), compress, {"layer": 0}),
        "oc128_verify": (lambda tree, **a: oc.verify(**a, tree=tuple(tree), layer=0), verify, {"layer": 0}),
        "oc128_commit": (lambda **a: oc.commit(**a, layer=1), commit, {"layer": 1, "num_layers": 1}),
    }


def test_every_native_module_reports_the_operands_the_ops_pass():
    assert set(_native.MODULES) >= {"cpu"}
    for platform, module in _native.MODULES.items():
        assert _native.reported_operands(module) == ops.OPERANDS, platform
        assert set(module.registrations()) == set(ops.OPERANDS), platform


@pytest.mark.parametrize("target", ["oc128_compress", "oc128_verify", "oc128_commit"])
def test_each_op_passes_its_operands_in_the_binding_order(monkeypatch, target):
    """The native call gets the op's arrays in every module's binding order, the results in that order with
    each result named like an argument aliased to it, the attributes by name, and the op returns the results
    in the binding order."""
    recorded = {}

    def ffi_call(name, shapes, input_output_aliases, vmap_method):
        shapes = shapes if isinstance(shapes, tuple) else (shapes,)

        def call(*operands, **attrs):
            recorded.update(
                name=name, shapes=shapes, aliases=input_output_aliases, operands=operands, attrs=attrs
            )
            outputs = tuple(jnp.full(s.shape, i, s.dtype) for i, s in enumerate(shapes))
            return outputs if len(outputs) > 1 else outputs[0]

        return call

    monkeypatch.setattr(jax.ffi, "ffi_call", ffi_call)
    monkeypatch.setattr(_native, "TARGETS", {"cpu": tuple(ops.OPERANDS), "cuda": tuple(ops.OPERANDS)})
    op, arrays, attrs = _calls()[target]
    outputs = op(**arrays)

    for platform, module in _native.MODULES.items():
        names = _native.reported_operands(module)[target]
        assert recorded["name"] == target
        assert len(recorded["operands"]) == len(names.args), platform
        for name, operand in zip(names.args, recorded["operands"], strict=True):
            if name == "tree":
                np.testing.assert_array_equal(operand, arrays[name])
            else:
                assert operand is arrays[name], (platform, name)
        assert recorded["aliases"] == {names.args.index("state"): names.rets.index("state")}, platform
        assert len(recorded["shapes"]) == len(names.rets), platform
        assert recorded["shapes"][names.rets.index("state")].shape == arrays["state"].shape, platform
        assert recorded["attrs"] == {name: np.int64(attrs[name]) for name in names.attrs}, platform
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    for i, output in enumerate(outputs):
        assert np.all(np.asarray(output) == i), f"{target}: result {i} out of the binding order"


def _module(name, operands):
    return types.SimpleNamespace(__name__=name, __file__=f"/elsewhere/{name}.so", operands=lambda: operands)


def test_a_module_taking_other_operands_is_refused(monkeypatch):
    """The source tree's Python run against a native module built from another version."""
    swapped = {target: dict(names._asdict()) for target, names in ops.OPERANDS.items()}
    args = swapped["oc128_commit"]["args"]
    swapped["oc128_commit"]["args"] = (args[0], args[2], args[1], *args[3:])
    for stale in (
        _module("jax_oc128_native.cpu", swapped),
        types.SimpleNamespace(__name__="old", __file__="old.so"),
    ):
        monkeypatch.setattr(_native, "MODULES", {"cpu": stale})
        with pytest.raises(ImportError, match=r"does not match this source: reinstall with pip install \."):
            _native.check_operands(ops.OPERANDS)


def test_a_module_taking_the_same_operands_is_accepted(monkeypatch):
    same = {target: dict(names._asdict()) for target, names in ops.OPERANDS.items()}
    monkeypatch.setattr(_native, "MODULES", {"cpu": _module("jax_oc128_native.cpu", same)})
    _native.check_operands(ops.OPERANDS)
