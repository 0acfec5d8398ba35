"""The model's linear layer (jax_oc128.nn.linear.linear): a quantized weight as one group per weight group
through the quantized grouped matmul op (linear_op; its CPU handler here, the CUDA kernel on a GPU) and
through the grouped matmul's Pallas kernel (linear_pallas; interpret mode on CPU, Triton on a GPU) against
their twin, the weight dequantized whole (functional.linear_jnp), and an independent float64 computation;
which weights the layer sends to which kernel when lowered for CUDA, with and without the op."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.sharding import AbstractMesh, AxisType
from quantization import abstract_quantized, assert_float32_sum, float64_linear, quantized

from jax_oc128 import ops
from jax_oc128.nn import linear, quant_gmm
from jax_oc128.nn.functional import linear_jnp
from jax_oc128.nn.quant import FP4, FP8
from jax_oc128.nn.sharding import MODEL


@pytest.mark.parametrize(
    "interpret", [True, pytest.param(False, marks=pytest.mark.cuda)], ids=["interpret", "triton"]
)
@pytest.mark.parametrize("lead, groups", [((3, 5), None), ((40,), None), ((2, 3), 4)])
@pytest.mark.parametrize("fmt, scales", [(FP8, "e8m0"), (FP8, "float32"), (FP4, "e8m0")])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kernel_equals_jnp_and_float64(fmt, scales, dtype, lead, groups, interpret):
    """linear_pallas == linear_jnp == float64 on a ``[320, 192]`` weight (FP8's last 128-column scale group
    partial; FP4's six 32-column groups), rows in one 16-row tile, in a 64-row tile and in four groups of
    80 outputs each (the o_a projection's shape)."""
    rng = np.random.default_rng(3)
    weight = quantized(rng.standard_normal((1, 320, 192)) / 14, fmt, scales, dtype)[0]
    x = jnp.asarray(rng.standard_normal((*lead, *([groups] if groups else []), 192)), jnp.float32)
    got = linear.linear_pallas(x, weight, groups=groups, interpret=interpret)
    twin = linear_jnp(x, weight, groups=groups)
    want, magnitudes = float64_linear(x, weight, groups, magnitudes=True)
    assert got.shape == twin.shape == want.shape and got.dtype == jnp.float32
    assert_float32_sum(got, want, magnitudes, 192)
    assert_float32_sum(twin, want, magnitudes, 192)


@pytest.mark.parametrize("lead, groups", [((3, 5), None), ((40,), None), ((2, 3), 4)])
@pytest.mark.parametrize("fmt, scales", [(FP8, "e8m0"), (FP8, "float32"), (FP4, "e8m0")])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_op_equals_jnp_and_float64(fmt, scales, dtype, lead, groups):
    """linear_op (the op's CPU handler) == linear_jnp == float64 on linear_pallas's cases: one group of 15 or
    40 rows, four groups of 6 rows, each one tile of the op."""
    rng = np.random.default_rng(4)
    weight = quantized(rng.standard_normal((1, 320, 192)) / 14, fmt, scales, dtype)[0]
    x = jnp.asarray(rng.standard_normal((*lead, *([groups] if groups else []), 192)), jnp.float32)
    got = jax.jit(linear.linear_op, static_argnames="groups")(x, weight, groups=groups)
    want, magnitudes = float64_linear(x, weight, groups, magnitudes=True)
    assert got.shape == want.shape and got.dtype == jnp.float32
    assert_float32_sum(got, want, magnitudes, 192)
    assert_float32_sum(linear_jnp(x, weight, groups=groups), want, magnitudes, 192)


def test_v4_flash_projection_equals_float64():
    """DeepSeek-V4-Flash's o_a projection (8 groups of 1024 x 4096, FP8) at 8 tokens through the layer: on a
    GPU the op's CUDA kernel, elsewhere the dequantized matmul; both the float64 computation's."""
    rng = np.random.default_rng(5)
    weight = quantized(rng.standard_normal((1, 8192, 4096)) / 64, FP8, "e8m0", "bfloat16")[0]
    x = jnp.asarray(rng.standard_normal((8, 8, 4096)), jnp.float32)
    got = jax.jit(linear.linear, static_argnames="groups")(x, weight, groups=8)
    want, magnitudes = float64_linear(x, weight, 8, magnitudes=True)
    assert_float32_sum(got, want, magnitudes, 4096)


@pytest.fixture(params=[True, False], ids=["op", "no op"])
def cuda_op(request, monkeypatch):
    """Whether the CUDA module has the quantized grouped matmul op (a build with it, or one without), as
    ops.native_targets tells the layer (jax's caches cleared around it: a trace does not key on it)."""
    real, has = ops.native_targets, request.param

    def native_targets(platform):
        others = tuple(t for t in real(platform) if t != quant_gmm.TARGET)
        return others + ((quant_gmm.TARGET,) if has and platform == "cuda" else ())

    monkeypatch.setattr(ops, "native_targets", native_targets)
    jax.clear_caches()  # traces of the layer made under the other answer
    yield has
    jax.clear_caches()


def kernels_for_cuda(x_shape, weight, groups=None, model_devices=1, name=None) -> tuple[int, int]:
    """The Triton kernels and the op's calls of the layer on ``x_shape`` rows, lowered for CUDA here (traced
    under a mesh of ``model_devices`` on ``"model"``; ``name``: the weight's parameter path)."""
    checks = [export.DisabledSafetyCheck.custom_call(t) for t in ("__gpu$xla.gpu.triton", quant_gmm.TARGET)]
    fn = jax.jit(linear.linear, static_argnames=("groups", "name"))
    x = jax.ShapeDtypeStruct(x_shape, jnp.float32)
    mesh = AbstractMesh((model_devices,), (MODEL,), axis_types=(AxisType.Auto,))
    with jax.sharding.use_abstract_mesh(mesh):
        exported = export.export(fn, platforms=["cuda"], disabled_checks=checks)(
            x, weight, groups=groups, name=name
        )
    text = exported.mlir_module()
    return text.count("@__gpu$xla.gpu.triton"), text.count(f"@{quant_gmm.TARGET}")


def test_layer_sends_quantized_weights_at_decode_sizes_to_a_kernel(cuda_op):
    """For CUDA: a bfloat16 model's FP8 or FP4 weight with e8m0 scales runs the op where the CUDA module has
    it, at up to LINEAR_OP_ROWS rows per group, if the op splits its K (quant_gmm.splits: its outputs alone
    leave blocks idle), whatever its size; else, up to LINEAR_KERNEL_ROWS rows, and for a float32 model's or
    float32 scales, a weight of at least LINEAR_KERNEL_PARAMS parameters runs the Pallas kernel. More rows, a
    smaller weight off the op or a float one run neither. Under a mesh that splits the weights over "model" a
    weight named by its parameter path runs the kernel on each device's part (tensor_parallel: outputs,
    grouped outputs or inputs split); an unnamed one does not (XLA partitions its dequantized matmul: the
    kernel is not partitioned)."""
    large, small = (4096, 4096), (512, 4096)
    assert linear.LINEAR_KERNEL_PARAMS <= 4096 * 4096 // 2 and 512 * 4096 < linear.LINEAR_KERNEL_PARAMS
    rows, op_rows = linear.LINEAR_KERNEL_ROWS, linear.LINEAR_OP_ROWS
    op, pallas, neither = (0, 1), (1, 0), (0, 0)
    kernel = op if cuda_op else pallas
    for fmt in (FP8, FP4):
        weight = abstract_quantized(fmt, large, "bfloat16")
        assert quant_gmm.splits(fmt, *large, 1, False) > 1
        assert kernels_for_cuda((2, op_rows // 2, 4096), weight) == kernel
        assert kernels_for_cuda((op_rows + 1, 4096), weight) == pallas
        assert kernels_for_cuda((2, rows // 2, 4096), weight) == pallas
        assert kernels_for_cuda((rows + 1, 4096), weight) == neither
        small_weight = abstract_quantized(fmt, small, "bfloat16")
        assert kernels_for_cuda((8, 4096), small_weight) == (op if cuda_op else neither)
        assert kernels_for_cuda((op_rows + 1, 4096), small_weight) == neither
        assert kernels_for_cuda((8, 4096), weight, model_devices=2) == neither
        for name in (("attn", "q_b_proj"), ("attn", "o_b_proj"), ("moe", "shared_down")):
            assert kernels_for_cuda((8, 4096), weight, model_devices=2, name=name) == kernel, name
        assert kernels_for_cuda((8, 4096), abstract_quantized(fmt, large, "float32")) == pallas
        assert kernels_for_cuda((8, 4096), abstract_quantized(fmt, small, "float32")) == neither
    float_scales = abstract_quantized(FP8, large, "bfloat16")
    float_scales = dataclasses.replace(
        float_scales, scales=jax.ShapeDtypeStruct(float_scales.scales.shape, jnp.float32)
    )
    assert kernels_for_cuda((8, 4096), float_scales) == pallas
    assert kernels_for_cuda((8, 4096), jax.ShapeDtypeStruct(large, jnp.bfloat16)) == neither
    # the o_a projection: 8 groups fill the blocks without a split of K, so the Pallas kernel; rows per group
    grouped = abstract_quantized(FP8, (8192, 4096), "bfloat16")
    assert quant_gmm.splits(FP8, 1024, 4096, 8, False) == 1
    assert kernels_for_cuda((8, 8, 4096), grouped, groups=8) == pallas
    assert kernels_for_cuda((rows + 1, 8, 4096), grouped, groups=8) == neither
    # on two devices, four groups each: the op splits K again
    assert quant_gmm.splits(FP8, 1024, 4096, 4, False) > 1
    named = kernels_for_cuda((8, 8, 4096), grouped, groups=8, model_devices=2, name=("attn", "o_a_proj"))
    assert named == kernel


def test_bench_linear_runs_tiny(tmp_path):
    """bench/bench_linear.py end to end on this platform at 2 tokens: a row per V4-Flash FP8 layer and their
    sum, each floored by its codes' and scales' bytes (o_b: 4096 x 8192 codes, 4096 x 64 scale bytes)."""
    out = tmp_path / "bench_linear.json"
    bench = pathlib.Path(__file__).resolve().parent.parent / "bench" / "bench_linear.py"
    command = [sys.executable, str(bench), "--tokens", "2", "--copy-mib", "1", "--calls", "1"]
    command += ["--out", str(out)]
    subprocess.run(command, check=True, capture_output=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    results = json.loads(out.read_text())
    rows = {row["name"]: row for row in results["rows"]}
    assert len(rows) == 10 and rows["all"]["floor_us"] == pytest.approx(
        sum(row["floor_us"] for name, row in rows.items() if name != "all")
    )
    assert rows["o_b"]["floor_us"] == pytest.approx((4096 * 8192 + 4096 * 64) / results["bandwidth"] * 1e6)
