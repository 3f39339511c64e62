"""Benchmark reports: one JSON file, a Markdown table and PNG plots, from the same dict.

The Markdown and JSON need nothing but the standard library; the plots need matplotlib (the
``bench`` extra) and are skipped with a note when it is missing.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

#: (report key, column title, format) of the Markdown table, in order.
COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("mean_ttft_ms", "mean TTFT ms", "{:.0f}"),
    ("p50_ttft_ms", "p50", "{:.0f}"),
    ("p90_ttft_ms", "p90", "{:.0f}"),
    ("p99_ttft_ms", "p99", "{:.0f}"),
    ("mean_itl_ms", "mean ITL ms", "{:.1f}"),
    ("mean_e2e_ms", "mean e2e ms", "{:.0f}"),
    ("p99_e2e_ms", "p99 e2e", "{:.0f}"),
    ("request_throughput_rps", "req/s", "{:.2f}"),
    ("gpu_hit_ratio", "GPU hit", "{:.3f}"),
    ("cpu_hit_ratio", "CPU hit", "{:.3f}"),
    ("hit_vs_bound", "hit / bound", "{:.0%}"),
    ("work_imbalance", "imbalance", "{:.2f}"),
    ("preemptions", "preempt.", "{:d}"),
    ("errors", "errors", "{:d}"),
)


def _fmt(value: Any, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if spec == "{:d}":
        return str(int(value))
    return spec.format(value)


def _label(run: dict[str, Any]) -> str:
    name = str(run.get("policy", "?"))
    routers = run.get("routers", 1) or 1
    if routers > 1:
        fan = run.get("fanout_delay_ms")
        name += f" x{routers} routers" + (f" (fan-out {fan:g} ms)" if fan is not None else " (no fan-out)")
    return name


def table(runs: list[dict[str, Any]]) -> str:
    """A Markdown table of runs: one row per run, only the columns some run has."""
    cols = [c for c in COLUMNS if any(r.get(c[0]) is not None for r in runs)]
    head = ["load", "policy"] + [c[1] for c in cols]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * 2 + ["---:"] * len(cols)) + "|"]
    for r in runs:
        load = r.get("load")
        cells = [_fmt(load, "{:.0%}") if load is not None else "-", _label(r)]
        cells += [_fmt(r.get(key), spec) for key, _, spec in cols]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _summary_lines(report: dict[str, Any]) -> list[str]:
    out = []
    for s in report.get("summary") or []:
        where = f"load {s['load']:.0%}" + (f", {s['routers']} routers" if s["routers"] > 1 else "")
        parts = []
        for m, name in (("mean_ttft_ms", "mean"), ("p99_ttft_ms", "p99")):
            if s.get(f"{m}_ratio") is not None:
                parts.append(
                    f"{name} TTFT {s[f'{m}_ratio']:.2f}x the best baseline ({s[f'{m}_best_baseline']})"
                )
        if s.get("hit_vs_bound") is not None:
            parts.append(f"hit ratio {s['hit_vs_bound']:.0%} of the bound")
        if s.get("hit_kept") is not None:
            parts.append(
                f"keeps {s['hit_kept']:.0%} of one router's hit ratio, {s['mean_ttft_kept']:.0%} of its "
                f"mean TTFT and {s['p99_ttft_kept']:.0%} of its p99"
            )
        if parts:
            out.append(f"- kvroute, {where}: " + "; ".join(parts))
    return out


def markdown(report: dict[str, Any]) -> str:
    """The whole report as Markdown: settings, capacity, bounds, the table, the comparison."""
    s = report.get("settings", {})
    lines = [f"# kvroute bench {report.get('kind', '')}", ""]
    if s:
        keys = ("source", "replicas", "preset", "requests", "arrival", "routers", "fanout_delay_ms", "url")
        lines.append("Settings: " + ", ".join(f"{k}={s[k]}" for k in keys if s.get(k) is not None) + ".")
    cap = report.get("capacity")
    if cap:
        lines.append(
            f"Capacity ({cap['policy']}, {cap['method']}): {cap['rps']:.3f} req/s; loads are fractions of it."
        )
    b = report.get("bounds")
    if b:
        lines.append(
            f"Hit-ratio bounds: pooled LRU (one LRU cache of the fleet's size, perfect affinity) "
            f"{b['pooled_lru']:.3f}; Belady on the pooled size {b['belady']:.3f}; infinite cache "
            f"{b['infinite']:.3f}. `hit / bound` is against pooled LRU."
        )
    lines += ["", table(report.get("runs", [])), ""]
    lines += _summary_lines(report)
    if report.get("dynamo"):
        lines += ["", "## Side by side with NVIDIA Dynamo's replay (dynamo-mocker preset)", ""]
        lines.append(table(report["dynamo"]))
    if report.get("dynamo_error"):
        lines += ["", f"Dynamo comparison not run: {report['dynamo_error']}"]
    return "\n".join(lines).rstrip() + "\n"


def plot(report: dict[str, Any], out_dir: Path, stem: str) -> list[Path]:
    """TTFT (mean and p99) vs load per policy, and hit ratio per policy; returns the files."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report.get("runs", [])
    series: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        if r.get("load") is not None:
            series.setdefault(_label(r), []).append(r)
    files = []
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), dpi=80)
    for name, rs in series.items():
        rs = sorted(rs, key=lambda r: r["load"])
        style = {"linewidth": 2.5, "color": "black"} if name == "kvroute" else {"linewidth": 1.2}
        for ax, key in zip(axes, ("mean_ttft_ms", "p99_ttft_ms"), strict=True):
            ax.plot([r["load"] for r in rs], [r[key] / 1000.0 for r in rs], marker="o", label=name, **style)
    for ax, title in zip(axes, ("mean TTFT", "p99 TTFT"), strict=True):
        ax.set_xlabel("load (fraction of round robin's capacity)")
        ax.set_ylabel(f"{title} (s)")
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.set_title(title)
    axes[1].legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    path = out_dir / f"{stem}-ttft.png"
    fig.savefig(path)
    plt.close(fig)
    files.append(path)

    loads = sorted({r["load"] for r in runs if r.get("load") is not None})
    names = list(series)
    if loads and names:
        fig, ax = plt.subplots(figsize=(10, 3.5), dpi=80)
        width = 0.8 / len(loads)
        for i, load in enumerate(loads):
            vals = [next((r["gpu_hit_ratio"] for r in series[n] if r["load"] == load), 0.0) for n in names]
            ax.bar([j + i * width for j in range(len(names))], vals, width, label=f"load {load:.0%}")
        b = report.get("bounds")
        if b:
            ax.axhline(b["pooled_lru"], color="black", linestyle="--", linewidth=1, label="pooled-LRU bound")
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(names))])
        ax.set_xticklabels(names, rotation=20, ha="right", fontsize=7)
        ax.set_ylabel("GPU token hit ratio")
        ax.legend(fontsize=7)
        ax.grid(True, axis="y", alpha=0.3)
        fig.tight_layout()
        path = out_dir / f"{stem}-hit.png"
        fig.savefig(path)
        plt.close(fig)
        files.append(path)
    return files


def plot_live(report: dict[str, Any], out_dir: Path, stem: str) -> list[Path]:
    """Distributions (CDF) of TTFT and end-to-end latency of a live run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=80)
    for key, name in (("ttft_ms", "TTFT"), ("e2e_ms", "end to end")):
        v = sorted(x[key] / 1000.0 for x in report.get("samples", []) if x.get(key) is not None)
        if v:
            ax.plot(v, [(i + 1) / len(v) for i in range(len(v))], label=name)
    ax.set_xlabel("seconds")
    ax.set_ylabel("fraction of requests")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = out_dir / f"{stem}-latency.png"
    fig.savefig(path)
    plt.close(fig)
    return [path]


def write(report: dict[str, Any], out_dir: Path, stem: str, *, plots: bool = True) -> list[Path]:
    """Writes ``STEM.json``, ``STEM.md`` and, if matplotlib is there, ``STEM-*.png``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    files = [out_dir / f"{stem}.json", out_dir / f"{stem}.md"]
    files[0].write_text(json.dumps(report, indent=1, default=str) + "\n")
    files[1].write_text(markdown(report))
    if plots:
        try:
            draw = plot_live if report.get("kind") == "live" else plot
            files += draw(report, out_dir, stem)
        except ImportError:
            report.setdefault("notes", []).append(
                "plots skipped: matplotlib is not installed (pip install kvroute[bench])"
            )
    return files
