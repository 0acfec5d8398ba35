"""Plot a bench_ops.py result file: us per speculative step vs batch, one line per pattern, against the
launch and bandwidth floors; or bench_decode.py result files (their rows together): device-only and end-to-end
us per step vs slots, one panel per config and mode, one pair of lines per C128 backend (with tree modes:
tokens/s and mean accepted length per mode, chain against tree).

Usage (needs matplotlib):
  python bench/plot.py bench/results/YYYY-MM-DD/bench_ops.json bench/results/YYYY-MM-DD/bench_h200.png
  python bench/plot.py bench/results/YYYY-MM-DD/bench_decode_a.json [more.json ...] \
    bench/results/YYYY-MM-DD/bench_decode_h200.png
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def plot_decode(results, target):
    """bench_decode.py's rows: us per step vs slots, device (solid) and e2e (dashed) per backend."""
    rows = results["rows"]
    configs = list(dict.fromkeys(r["config"] for r in rows))
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    fig, axes = plt.subplots(
        len(configs), len(modes), figsize=(4.5 * len(modes), 3.8 * len(configs)), squeeze=False
    )
    for i, config in enumerate(configs):
        for j, mode in enumerate(modes):
            ax = axes[i, j]
            for backend, color in (("online", "C0"), ("offline", "C1")):
                sel = [r for r in rows if (r["config"], r["mode"], r["backend"]) == (config, mode, backend)]
                sel.sort(key=lambda r: r["slots"])
                if not sel:
                    continue
                slots = [r["slots"] for r in sel]
                ax.plot(slots, [r["device_us"] for r in sel], "o-", color=color, label=f"{backend}: device")
                ax.plot(slots, [r["e2e_us"] for r in sel], "s--", color=color, label=f"{backend}: e2e")
            ax.set(xscale="log", yscale="log", xlabel="slots", title=f"{config}, {mode}")
            ticks = sorted({r["slots"] for r in rows})
            ax.set_xticks(ticks, [str(s) for s in ticks], minor=False)
            ax.set_xticks([], minor=True)
            ax.grid(True, which="both", alpha=0.3)
        axes[i, 0].set_ylabel("us per step")
    axes[0, 0].legend(fontsize=8)
    k = results["steps_per_dispatch"]
    fig.suptitle(
        f"Decode loop on {results['device']}: device-only (K = {k} steps per dispatch) vs Engine.generate"
    )
    fig.tight_layout()
    fig.savefig(target, dpi=110)


def plot_tree(results, target):
    """bench_decode.py's rows with tree modes: tokens/s and mean accepted length per mode, bars per slots."""
    rows = results["rows"]
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    slots = sorted({r["slots"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(modes)
    for ax, key, label in (
        (axes[0], "tokens_per_s", "tokens/s"),
        (axes[1], "mean_accepted", "mean accepted"),
    ):
        for i, mode in enumerate(modes):
            values = [next((r[key] for r in rows if (r["mode"], r["slots"]) == (mode, s)), 0) for s in slots]
            ax.bar([j + i * width for j in range(len(slots))], values, width, label=mode)
        ax.set_xticks(
            [j + width * (len(modes) - 1) / 2 for j in range(len(slots))], [f"{s} slots" for s in slots]
        )
        ax.set(ylabel=label)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    configs = ", ".join(dict.fromkeys(r["config"] for r in rows))
    fig.suptitle(f"Chain vs tree speculation at the same verify width, {configs} on {results['device']}")
    fig.tight_layout()
    fig.savefig(target, dpi=110)


def main(*paths):
    *sources, target = paths
    loaded = []
    for source in sources:
        with open(source) as f:
            loaded.append(json.load(f))
    results = loaded[0]
    if results.get("bench") == "decode":
        results = dict(results, rows=[row for r in loaded for row in r["rows"]])
        if any(row["mode"].startswith("tree") for row in results["rows"]):
            return plot_tree(results, target)
        return plot_decode(results, target)
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
    main(*sys.argv[1:])
