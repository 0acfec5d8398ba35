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
    """Each rate's row counts every request's tokens (num_prompts x output_len), orders its percentiles and
    gives the offline rate over its own; the offline row counts the same tokens; ``--sweep-slots`` (the
    random workload) gives these rows per slot count."""
    flags = ["--pages", "8", "--steps-per-dispatch", "4", "--num-prompts", "6", "--input-len", "16"]
    flags += ["--output-len", "4", "--prefix-len", "40", "--rates", "8", "inf", "--dataset", dataset]
    slots = [1, 2] if dataset == "random" else [2]
    flags += ["--sweep-slots", *map(str, slots)] if dataset == "random" else ["--slots", "2"]
    rows = bench_serving.main([*flags, "--offline", "--output", "json"])
    assert [(row["slots"], row["rate"]) for row in rows] == [
        (s, rate) for s in slots for rate in ("offline", 8.0, math.inf)
    ]
    assert all(row["output_tokens"] == 6 * 4 and row["dispatches"] >= 1 for row in rows), rows
    for offline, *served in zip(rows[::3], rows[1::3], rows[2::3], strict=True):
        for row in served:
            assert row["requests"] == 6
            for metric in ("ttft", "tpot", "e2e"):
                assert 0 <= row[f"{metric}_p50_ms"] <= row[f"{metric}_p99_ms"], row
            assert row["ttft_p99_ms"] <= row["e2e_p99_ms"]
            assert 1 <= row["events_per_request"] <= 4 + 1  # at most a token an event, and the usage's
            ratio = offline["output_tokens_per_s"] / row["output_tokens_per_s"]
            assert row["offline_over_served"] == pytest.approx(ratio)
    assert '"rate": "offline"' in capsys.readouterr().out
