"""Assertions shared by the op tests."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from oracle import rel_err

# Native vs reference run the same float32 recurrence; they differ only in how exp and the divisions
# round (libm / CUDA expf vs XLA's exp), accumulated over at most 128 folds.
NATIVE_VS_REFERENCE_FP32 = 1e-5
# Against the float64 offline pooling (the bar for fp32).
OFFLINE_FP32 = 1e-4
# A bf16 state is rounded to 8 significant bits (relative 2**-9) each time it is stored. Native and
# reference can round a value to neighbouring bf16 numbers when their fp32 values differ in the last
# bits, so they agree to about one bf16 ulp (2**-8 relative to the value, below that normwise).
NATIVE_VS_REFERENCE_BF16 = 2**-8


def poisoned_state(rng, layers, slots, dim, max_draft, dtype=jnp.float32):
    """A state full of random values, so untouched rows can be checked bit for bit.

    Each row is a valid online state (sum > 0): a row read as the start of a fold is well conditioned.
    """
    values = rng.normal(size=(layers, 1 + max_draft, slots, 3, dim)).astype(np.float32)
    values[..., 1, :] = np.abs(values[..., 1, :]) + 0.5
    return jnp.asarray(values, dtype)


def assert_state_close(x, y, tol):
    """Per field (max, sum, mean), normwise relative error below ``tol``."""
    x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
    assert x.shape == y.shape
    for field, name in enumerate(("max", "sum", "mean")):
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
