"""One host class's table and plot from `bench.host_class`'s summary.json: every speed and
faithfulness criterion of the host-class table, per size, as the factor by which we beat
llama-server (higher is better) beside its target.

    python -m sgl_tpu.bench.host_class_report DIR/summary.json [MORE/summary.json ...]
        [--plot PNG]

prints the Markdown table (the README's performance section is these tables), and with --plot
draws the same factors as bars against their targets. Several summaries of one host class
(say, one run per size) merge into one table, a later file's runs replacing an earlier one's.
`bench.host_class` writes both beside its summary at the end of a run.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

# one size's runs -> (the factor or None, the measured values behind it)
Reader = Callable[[dict[str, Any]], tuple[float | None, str]]
Row = tuple[str, str, float, Reader]


def _inverse(x: float | None) -> float | None:
    return 1.0 / x if x else None


def _ms(itl: dict[str, float | None], target: str) -> str:
    v = itl.get(target)
    return "-" if v is None else f"{v:.1f}"


def _itl(run: str, target: str, ratio: str) -> Reader:
    """A run's ITL criterion: llama-server's ITL over `target`'s (the summary's `ratio`)."""

    def read(runs: dict[str, Any]) -> tuple[float | None, str]:
        s = runs.get(run, {})
        itl = s.get("itl_p50_ms", {})
        return (_inverse(s.get(ratio)),
                f"{_ms(itl, target)} / {_ms(itl, 'llama-server')} ms")

    return read


def _cold(runs: dict[str, Any]) -> tuple[float | None, str]:
    s = runs.get("cold2k", {})
    ttft = s.get("ttft_s", {})
    ours, peer = ttft.get("auto"), ttft.get("llama-server")
    detail = "-" if ours is None or peer is None else f"{ours:.2f} / {peer:.2f} s"
    return _inverse(s.get("auto_over_llama")), detail


def _agent(runs: dict[str, Any]) -> tuple[float | None, str]:
    s = runs.get("agent", {})
    pps = s.get("programs_per_s", {})
    ours, peer = pps.get("auto"), pps.get("llama-server")
    detail = "-" if ours is None or peer is None else f"{ours:.3f} / {peer:.3f} programs/s"
    return s.get("auto_over_llama_programs"), detail


def _floor(runs: dict[str, Any]) -> tuple[float | None, str]:
    over = runs.get("single", {}).get("itl_over_floor", {}).get("none")
    return _inverse(over), "-" if over is None else f"ITL {over:.2f}x the floor"


def _faith(key: str, lower_is_better: bool, digits: int, with_reference: bool = False
           ) -> Reader:
    """A faithfulness criterion: our `key` against llama.cpp's (and, `with_reference`, the
    float32 reference's beside them)."""

    def read(runs: dict[str, Any]) -> tuple[float | None, str]:
        f = runs.get("faithfulness", {})
        ours, peer = f.get("ours", {}).get(key), f.get("llama", {}).get(key)
        if ours is None or peer is None:
            return None, "-"
        detail = f"{ours:.{digits}f} / {peer:.{digits}f}"
        if with_reference:
            detail += f" (float32 {f.get('reference', {}).get(key, float('nan')):.{digits}f})"
        better, worse = (peer, ours) if lower_is_better else (ours, peer)
        return better / worse if worse else None, detail

    return read


# (plot label, criterion, the factor it asks for, how to read it from one size's runs). Each
# factor is "ours better by": llama-server's time over ours, our rate over its, the floor over
# our ITL.
ROWS: tuple[Row, ...] = (
    ("one stream", "one stream, drafts off: llama-server ITL / ours", 1 / 0.7,
     _itl("single", "none", "none_over_llama")),
    ("one stream, drafts", "one stream, default (drafts): llama-server ITL / ours", 0.0,
     _itl("single", "auto", "auto_over_llama")),
    ("8 streams", "8 streams: llama-server per-stream ITL / ours", 3.0,
     _itl("c8_256", "auto", "auto_over_llama")),
    ("cold 2k", "cold 2k-token prompt: llama-server TTFT / ours", 3.0, _cold),
    ("agents", "agent workload: our programs/s / llama-server's", 8.0, _agent),
    ("floor", "one stream, drafts off: bandwidth floor / ITL", 1 / 1.3, _floor),
    ("perplexity", "perplexity: llama.cpp's / ours", 1.0,
     _faith("perplexity", True, 2, with_reference=True)),
    ("top-1", "top-1 agreement with float32: ours / llama.cpp's", 1.0,
     _faith("top1_agreement", False, 3)),
    ("KL divergence", "mean KL divergence from float32: llama.cpp's / ours", 0.0,
     _faith("kld_mean", True, 4)),
)


def factors(summary: dict[str, Any]) -> dict[str, dict[str, tuple[float | None, str]]]:
    """{criterion: {size: (factor or None, the measured values behind it)}}."""
    sizes = list(summary.get("runs", {}))
    return {name: {size: read(summary["runs"][size]) for size in sizes}
            for _, name, _, read in ROWS}


def title(summary: dict[str, Any]) -> str:
    host = summary.get("host", {})
    isa = (summary.get("isa") or {}).get("name") or "native"
    return f"{host.get('model', 'unknown CPU')}, ISA {isa}"


def markdown(summary: dict[str, Any]) -> str:
    table = factors(summary)
    sizes = list(summary.get("runs", {}))
    lines = ["| " + " | ".join(["criterion (ours better by, target)", *sizes]) + " |",
             "|" + "---|" * (len(sizes) + 1)]
    for _, name, target, _ in ROWS:
        cells = []
        for size in sizes:
            factor, detail = table[name][size]
            if factor is None:
                cells.append("-" if detail == "-" else detail)
                continue
            mark = "" if not target else (" ✓" if factor >= target - 1e-9 else " ✗")
            cells.append(f"**{factor:.2f}x**{mark} ({detail})")
        goal = f">= {target:.2f}x" if target else "reported"
        lines.append(f"| {name} ({goal}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(summary: dict[str, Any], path: str) -> None:
    """The factors as grouped bars (one group per criterion, one bar per size), each
    criterion's target as a tick line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    table = factors(summary)
    sizes = list(summary.get("runs", {}))
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / max(1, len(sizes))
    for i, size in enumerate(sizes):
        xs = [j + (i - (len(sizes) - 1) / 2) * width for j in range(len(ROWS))]
        values = [table[name][size][0] or 0.0 for _, name, _, _ in ROWS]
        bars = ax.bar(xs, values, width, label=size)
        ax.bar_label(bars, fmt="%.2g", fontsize=7)
    for j, (_, _, target, _) in enumerate(ROWS):
        if target:
            ax.hlines(target, j - 0.45, j + 0.45, colors="black", linestyles="dashed")
    ax.set_xticks(range(len(ROWS)), [label for label, _, _, _ in ROWS], fontsize=8)
    ax.set_yscale("log")
    for axis in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
        axis(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.set_ylabel("ours better by (x); dashes: target")
    ax.legend(fontsize=8)
    ax.set_title(title(summary), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def merged(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """One summary from several of one host class: the first's host and ISA, every size's
    runs (later files' runs replacing earlier ones')."""
    out = {**summaries[0], "runs": {}}
    for summary in summaries:
        for size, runs in summary.get("runs", {}).items():
            out["runs"].setdefault(size, {}).update(runs)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("summaries", nargs="+", help="bench.host_class's summary.json files")
    p.add_argument("--plot", default=None, help="write the bar chart here (PNG)")
    args = p.parse_args(argv)
    summary = merged([json.loads(Path(f).read_text()) for f in args.summaries])
    print(f"{title(summary)}\n\n{markdown(summary)}")
    if args.plot:
        plot(summary, args.plot)


if __name__ == "__main__":
    main()
