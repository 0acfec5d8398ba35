"""bench/bench_serving.py at a tiny setting on the shipped model (Poisson and all-at-once arrivals, both
workloads, and the offline baseline; every request gives its output tokens; the online and offline C128
states swept) and on a tiny slice in the released format (``--model v4flash-slice``); the prefix cache's
TTFT comparison and the backends' throughput one."""

from __future__ import annotations

import argparse
import math

import bench_serving
import pytest
from hf_fixtures import quantized_config

from jax_oc128.controller import OFFLINE
from jax_oc128.nn import ModelConfig


@pytest.mark.parametrize("dataset", ["random", "shared-prefix"])
def test_bench_serving_runs_and_counts_every_token(dataset, capsys):
    """Each rate's row counts every request's tokens (num_prompts x output_len), orders its percentiles and
    gives the offline rate over its own, the engine process's busy time (within the run's) and the three
    processes' CPU times; the offline row counts the same tokens; ``--sweep-slots`` (the random workload)
    gives these rows per slot count; the shared-prefix workload is sent by two client processes to a server
    per C128 state (``--sweep-backend``), the offline state's rows giving the online ones' tokens/s over
    theirs."""
    flags = ["--pages", "8", "--steps-per-dispatch", "4", "--num-prompts", "6", "--input-len", "16"]
    flags += ["--output-len", "4", "--prefix-len", "40", "--rates", "8", "inf", "--dataset", dataset]
    if dataset == "random":
        slots, backends = [1, 2], ["online"]
        flags += ["--sweep-slots", "1", "2"]
    else:
        slots, backends = [2], ["online", "offline"]
        flags += ["--slots", "2", "--clients", "2", "--sweep-backend", *backends]
    rows = bench_serving.main([*flags, "--offline", "--output", "json"])
    assert [(row["backend"], row["slots"], row["rate"]) for row in rows] == [
        (b, s, rate) for b in backends for s in slots for rate in ("offline", 8.0, math.inf)
    ]
    online = {(row["slots"], row["rate"]): row for row in rows if row["backend"] == "online"}
    for row in rows:
        if row["backend"] == "online":
            assert "offline_c128_over_online" not in row, row
        else:
            ratio = online[row["slots"], row["rate"]]["output_tokens_per_s"] / row["output_tokens_per_s"]
            assert row["offline_c128_over_online"] == pytest.approx(ratio), row
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
            assert 0 < row["engine_busy_s"] <= row["duration_s"], row  # the engine's part of the run
            assert all(row[f"{side}_cpu_s"] > 0 for side in ("engine", "http", "client")), row
            assert row["engine_over_offline"] == pytest.approx(row["engine_busy_s"] / offline["duration_s"])
    assert '"rate": "offline"' in capsys.readouterr().out


def test_bench_serving_serves_a_released_slice():
    """``--model v4flash-slice`` (a small DeepSeek-V4 in the released format, built in the engine process)
    served and offline: every request's tokens counted, its prompt prefilled whole; each token has text
    (the raw ids' tokenizer), so the first token's event comes before the request's end. The slice is built
    on the C128 state of ``--backend``."""
    assert bench_serving.raw_tokenizer(64).decode_stream().push([5, 63, 0]) == "5 63 0"
    config = ModelConfig.from_hf(quantized_config(), dtype="bfloat16")
    args = argparse.Namespace(backend="offline", max_len=256)
    assert bench_serving.slice_model(args, config).target.backend is OFFLINE
    flags = ["--model", "v4flash-slice", "--slots", "2", "--max-len", "256", "--steps-per-dispatch", "4"]
    flags += ["--num-prompts", "4", "--input-len", "16", "--output-len", "6", "--rates", "inf", "--offline"]
    offline, served = bench_serving.main([*flags, "--output", "json"], slice_=config)
    assert (offline["rate"], served["rate"]) == ("offline", math.inf)
    assert offline["output_tokens"] == served["output_tokens"] == 4 * 6, (offline, served)
    assert served["prefill_tokens"] == 4 * 16 and served["cached_tokens"] == 0, served
    for row in (offline, served):  # the 4 requests in 2 slots: at least 2 admissions
        assert 4 / 2 <= row["prefills"] <= 4, row
    assert served["ttft_p50_ms"] < served["e2e_p50_ms"], served


def test_a_backend_sweep_with_a_tree_is_refused_before_any_server(capsys):
    """The offline state verifies chains only: ``--tree`` with it anywhere in ``--sweep-backend`` is
    argparse's error naming both flags, before the first (online) server runs."""
    with pytest.raises(SystemExit):
        bench_serving.main(["--tree", "2", "--sweep-backend", "online", "offline"])
    assert "argument --tree: tree speculation runs on the online C128 state only (--backend online)" in (
        capsys.readouterr().err
    )


def test_the_comparisons_pair_rows_alike_but_for_the_swept_flag():
    """``ttft_off_over_cached``: on each row with the cache on, the TTFT p50 of the row of its backend, slots
    and rate with the cache off over its own; ``offline_c128_over_online``: on each offline-backend row, the
    output tokens/s of the online row of its slots, cache and rate over its own; none where there is no
    such row or no such metric."""
    rows = [
        dict(slots=2, prefix_cache=0, rate="offline"),
        dict(slots=2, prefix_cache=0, rate=math.inf, ttft_p50_ms=90.0),
        dict(slots=4, prefix_cache=0, rate=math.inf, ttft_p50_ms=50.0),
        dict(slots=2, prefix_cache=8, rate="offline"),
        dict(slots=2, prefix_cache=8, rate=math.inf, ttft_p50_ms=30.0),
        dict(slots=2, prefix_cache=8, rate=4.0, ttft_p50_ms=10.0),
    ]
    bench_serving.compare(rows, "prefix_cache", 0, "ttft_p50_ms", "ttft_off_over_cached")
    assert [row.get("ttft_off_over_cached") for row in rows] == [None, None, None, None, 3.0, None]
    rows = [
        dict(backend="online", slots=2, prefix_cache=0, rate=math.inf, output_tokens_per_s=120.0),
        dict(backend="online", slots=2, prefix_cache=8, rate=math.inf, output_tokens_per_s=300.0),
        dict(backend="offline", slots=2, prefix_cache=0, rate=math.inf, output_tokens_per_s=100.0),
        dict(backend="offline", slots=2, prefix_cache=8, rate=math.inf, output_tokens_per_s=200.0),
        dict(backend="offline", slots=4, prefix_cache=0, rate=math.inf, output_tokens_per_s=90.0),
    ]
    bench_serving.compare(rows, "backend", "online", "output_tokens_per_s", "offline_c128_over_online")
    assert [row.get("offline_c128_over_online") for row in rows] == [None, None, 1.2, 1.5, None]
