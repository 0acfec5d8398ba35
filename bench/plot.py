"""Plot a bench_ops.py result file: us per speculative step vs batch, one line per pattern, against the
launch and bandwidth floors.

Usage: python bench/plot.py bench/results/bench_ops.json bench/results/bench_h200.png   (needs matplotlib)
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
    layers = results["layers"]
    dtypes = sorted({row["dtype"] for row in results["rows"]})
    fig, axes = plt.subplots(1, len(dtypes), figsize=(6 * len(dtypes), 4.5), sharey=True, squeeze=False)
    for ax, dtype in zip(axes[0], dtypes, strict=True):
        rows = sorted((r for r in results["rows"] if r["dtype"] == dtype), key=lambda r: r["batch"])
        batch = [r["batch"] for r in rows]
        for key, label, style, width in (
            ("model_us", f"model: {layers} verify launches, commit fused", "o-", 1.5),
            ("sglang_us", f"SGLang: {layers} verify + {layers} commit launches", "s-", 1.5),
            ("batched_us", "1 verify + 1 commit, all layers (reference; a model cannot)", "d:", 1.2),
            ("launch_us", f"floor: {layers} do-nothing launches", "k--", 1.0),
            ("floor_us", "floor: bytes / copy bandwidth", "k:", 1.0),
        ):
            ax.plot(batch, [r[key] for r in rows], style, label=label, lw=width)
        title = f"{dtype} state, N = {rows[0]['draft']}"
        ax.set(xscale="log", yscale="log", xlabel="batch (requests)", title=title)
        ax.set_xticks(batch, [str(b) for b in batch], minor=False)
        ax.set_xticks([], minor=True)
        ax.grid(True, which="both", alpha=0.3)
    axes[0, 0].set_ylabel(f"us per speculative step, {layers} C128 layers")
    axes[0, 0].legend(fontsize=8)
    fig.suptitle(f"C128 ops per speculative step on {results['device']}, head_dim {results['head_dim']}")
    fig.tight_layout()
    fig.savefig(target, dpi=110)


if __name__ == "__main__":
    main(*sys.argv[1:3])
