"""A PNG for --compare runs: programs/s and TTFT p50 per workload, one bar per target."""

from __future__ import annotations

from typing import Any


def plot_compare(runs: dict[str, dict[str, dict[str, Any]]], path: str, title: str) -> None:
    """`runs[target][workload]` summaries -> a two-panel grouped bar chart at `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    targets = list(runs)
    workloads = list(dict.fromkeys(w for per_target in runs.values() for w in per_target))
    panels = (("programs_per_s", "programs / s (higher is better)"),
              ("ttft_p50", "TTFT p50, s (lower is better)"))
    fig, axes = plt.subplots(1, 2, figsize=(5 + 2.2 * len(workloads), 4.5))
    width = 0.8 / max(1, len(targets))
    for ax, (key, label) in zip(axes, panels, strict=True):
        for i, target in enumerate(targets):
            values = []
            for w in workloads:
                s = runs[target].get(w)
                v = None if s is None else (s["ttft_s"]["p50"] if key == "ttft_p50" else s[key])
                values.append(v or 0.0)
            xs = [j + (i - (len(targets) - 1) / 2) * width for j in range(len(workloads))]
            bars = ax.bar(xs, values, width, label=target)
            ax.bar_label(bars, fmt="%.3g", fontsize=7)
        ax.set_xticks(range(len(workloads)), workloads, rotation=15)
        ax.set_title(label, fontsize=10)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
