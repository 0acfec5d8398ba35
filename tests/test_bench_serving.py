"""bench/bench_serving.py at a tiny setting on the shipped model: Poisson and all-at-once arrivals, both
workloads, and the offline baseline; every request gives its output tokens."""

from __future__ import annotations

import math
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "bench"))
import bench_serving


@pytest.mark.parametrize("dataset", ["random", "shared-prefix"])
def test_bench_serving_runs_and_counts_every_token(dataset, capsys):
    """Each rate's row counts every request's tokens (num_prompts x output_len) and orders its
    percentiles; the offline row counts the same tokens."""
    flags = ["--slots", "2", "--pages", "8", "--steps-per-dispatch", "4", "--num-prompts", "6"]
    flags += ["--input-len", "16", "--output-len", "4", "--prefix-len", "40", "--rates", "8", "inf"]
    rows = bench_serving.main([*flags, "--dataset", dataset, "--offline", "--output", "json"])
    assert [row["rate"] for row in rows] == ["offline", 8.0, math.inf]
    assert all(row["output_tokens"] == 6 * 4 and row["dispatches"] >= 1 for row in rows), rows
    for row in rows[1:]:
        assert row["requests"] == 6
        for metric in ("ttft", "tpot", "e2e"):
            assert 0 <= row[f"{metric}_p50_ms"] <= row[f"{metric}_p99_ms"], row
        assert row["ttft_p99_ms"] <= row["e2e_p99_ms"]
        assert 1 <= row["events_per_request"] <= 4 + 1  # at most a token an event, and the usage's
    assert '"rate": "offline"' in capsys.readouterr().out
