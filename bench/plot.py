"""Plot a bench_ops.py result file: time per speculative step vs batch, against the launch and bandwidth
floors.

Usage: python bench/plot.py bench/results/results_h200.json bench/results/bench_h200.png   (needs matplotlib)
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def main(source, target):
    with open(source) as f:
        results = json.load(f)
    dtypes = sorted({row["dtype"] for row in results["rows"]})
    fig, axes = plt.subplots(1, len(dtypes), figsize=(6 * len(dtypes), 4.5), sharey=True)
    for ax, dtype in zip(axes, dtypes, strict=True):
        rows = sorted((r for r in results["rows"] if r["dtype"] == dtype), key=lambda r: r["batch"])
        batch = [r["batch"] for r in rows]
        for key, label, style in (
            ("per_layer_us", "per-layer launches (40 / step)", "o:"),
            ("eager_step_us", "controller, eager commit (2 launches)", "s-"),
            ("lazy_step_us", "controller, lazy commit fused into verify (1 launch)", "^-"),
            ("ops_us", "verify + commit ops", "d--"),
        ):
            ax.plot(batch, [r[key] for r in rows], style, label=label)
        ax.plot(batch, [r["launch_us"] for r in rows], "k-", lw=0.8, label="floor: one kernel launch")
        floor = [r["bytes"] / results["copy_bandwidth"] * 1e6 for r in rows]
        ax.plot(batch, floor, "k--", lw=0.8, label="floor: bytes / copy bandwidth")
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="batch (requests)",
            title=f"{dtype} state, N = {rows[0]['draft']}",
        )
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel(f"us per speculative step, all {results['layers']} C128 layers")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"verify + commit on {results['device']}, head_dim {results['head_dim']}")
    fig.tight_layout()
    fig.savefig(target, dpi=110)


if __name__ == "__main__":
    main(*sys.argv[1:3])
