"""bench/bench_prefill.py and its FLOP floor (bench/prefill_floor.py): the floor against a hand count of a
small V4's matrices and keys, the 43-layer projection as the FLOP share it documents, and one CPU row at toy
sizes: its table columns and its numbers' relations."""

from __future__ import annotations

import json

import bench_prefill
import prefill_floor
import pytest

from jax_oc128.nn import ModelConfig


def hand_flops(c: ModelConfig, prompt_len: int) -> float:
    """The prefill FLOPs of a V4 of ``c`` (sliding, CSA, HCA layers in that order; MoE and hyper-connections;
    a sliding draft head), counted from its fields and position by position."""
    h, d, heads = c.hidden_size, c.head_dim, c.num_heads
    attn = h * c.q_lora_rank + c.q_lora_rank * heads * d + h * d + heads * d * c.o_lora_rank
    attn += c.o_groups * c.o_lora_rank * h
    hc = 2 * (c.hc_mult * h) * ((2 + c.hc_mult) * c.hc_mult)  # the attention's and the MLP's mixes
    moe = h * c.num_experts + 3 * h * c.mlp_hidden * (1 + c.num_experts_per_tok)  # router, shared, top-k
    csa = 2 * 2 * d * h + 2 * 2 * c.index_head_dim * h + c.q_lora_rank * c.index_n_heads * c.index_head_dim
    csa += h * c.index_n_heads  # the indexer's weights
    hca = 2 * d * h
    head = c.hc_mult * c.hc_mult * h
    draft = h * h * c.hc_mult + h * h + attn + hc + moe + head
    per_token = 3 * (attn + hc + moe) + csa + hca + head + draft
    total = 2.0 * per_token * prompt_len + 2.0 * c.vocab_size * h
    for p in range(prompt_len):
        window = min(p + 1, c.sliding_window)
        csa_keys = (p + 1) // 4
        keys = window * 4 + min(csa_keys, c.index_topk) + (p + 1) // 128  # 3 layers and the draft head
        total += 4.0 * heads * d * keys + 2.0 * c.index_n_heads * c.index_head_dim * csa_keys
    return total


def test_flops_match_a_hand_count():
    config = bench_prefill.TINY
    assert config.layer_types == (prefill_floor.SLIDING, prefill_floor.CSA, prefill_floor.HCA)
    for prompt_len in (1, 37, 300):
        flops = prefill_floor.prefill_flops(config, prompt_len)
        assert sum(flops.values()) == pytest.approx(hand_flops(config, prompt_len), rel=1e-12)
    kinds = prefill_floor.by_kind(config, prefill_floor.prefill_flops(config, 300))
    assert kinds["layers"] == dict(sliding=1, csa=1, hca=1)
    assert kinds["flops"]["csa"] > kinds["flops"]["hca"] > kinds["flops"]["sliding"]


def test_projection_is_the_flop_share():
    """The 43-layer TTFT: the slice's time scaled by the FLOP ratio, a time per layer of each kind."""
    slice_ = ModelConfig.deepseek_v4_flash(num_layers=6, dtype="bfloat16")  # its 256 experts: routers alike
    full = ModelConfig.deepseek_v4_flash()
    rows = [
        dict(
            weights="bf16", prompt=p, chunk=2048, prefill_ms=ms, flops=prefill_floor.prefill_flops(slice_, p)
        )
        for p, ms in ((8192, 100.0), (131072, 3000.0))
    ]
    for row, got in zip(rows, bench_prefill.projection(rows, slice_, full), strict=True):
        ratio = sum(prefill_floor.prefill_flops(full, row["prompt"]).values()) / sum(row["flops"].values())
        assert got["ttft_ms"] == pytest.approx(row["prefill_ms"] * ratio, rel=1e-9)
        assert got["layers"] == dict(sliding=2, csa=21, hca=20)
        assert got["ms_per_layer"]["csa"] > got["ms_per_layer"]["sliding"]
        assert got["tokens_per_s"] == pytest.approx(row["prompt"] / got["ttft_ms"] * 1e3)


def test_bench_prefill_runs_tiny(tmp_path, capsys):
    out = tmp_path / "bench_prefill.json"
    flags = ["--configs", "tiny", "--prompt-lens", "256", "--chunks", "128", "--reps", "1"]
    results = bench_prefill.main([*flags, "--matmul-n", "128", "--out", str(out)])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("|")]
    assert [cell.strip() for cell in lines[0].strip("|").split("|")] == list(bench_prefill.COLUMNS)
    assert len(lines) == 3 and len(lines[2].strip("|").split("|")) == len(bench_prefill.COLUMNS)
    (row,) = results["rows"]
    assert (row["config"], row["weights"], row["prompt"], row["chunk"]) == ("tiny", "float32", 256, 128)
    assert row["max_len"] == 384  # the least multiple of 128 holding 256 + 2
    floor_ms = (
        sum(prefill_floor.prefill_flops(bench_prefill.TINY, 256).values()) / results["matmul_flops"] * 1e3
    )
    assert row["floor_ms"] == pytest.approx(floor_ms)
    assert row["x_floor"] == pytest.approx(row["prefill_ms"] / floor_ms)
    assert row["tokens_per_s"] == pytest.approx(256 / row["prefill_ms"] * 1e3)
    assert 0 < row["temp_gib"] < 1
    assert results["projection"] == []  # the slice's only
    assert json.loads(out.read_text())["rows"][0]["prompt"] == 256
