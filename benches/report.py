#!/usr/bin/python3
"""Writes the benchmark report: REPORT.md and one PNG chart per figure group, from the JSON lines
the benchmarks appended to <results>/figures.jsonl and the machine facts in <results>/machine.txt.

    /usr/bin/python3 benches/report.py <results dir>

Each figure line is {"chart", "title", "unit", "series", "x", "y"}: the figures of one chart share a
title and unit; each series (pg_outbox, or a baseline measured in the same run) is a set of points.
When every x is a number the chart is a line chart, otherwise grouped bars. Ratio lines are
{"ratio", "value", "target"}. The charts are drawn by matplotlib (Debian python3-matplotlib).
"""

import json
import os
import sys
from collections import OrderedDict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load(path):
    charts = OrderedDict()
    ratios = []
    x_units = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            rec = json.loads(line)
            if "ratio" in rec:
                ratios.append(rec)
                continue
            if "x_unit" in rec:
                x_units[rec["chart"]] = rec["x_unit"]
                continue
            chart = charts.setdefault(
                rec["chart"], {"title": rec["title"], "unit": rec["unit"], "series": OrderedDict()}
            )
            chart["series"].setdefault(rec["series"], []).append((rec["x"], rec["y"]))
    for name, unit in x_units.items():
        if name in charts:
            charts[name]["x_unit"] = unit
    return charts, ratios


def fmt(v):
    if isinstance(v, float):
        if abs(v) >= 100:
            return f"{v:,.0f}"
        return f"{v:.2f}"
    return str(v)


def table(chart):
    xs = []
    for points in chart["series"].values():
        for x, _ in points:
            if x not in xs:
                xs.append(x)
    names = list(chart["series"])
    lines = ["| " + " | ".join([""] + names) + " |", "|" + "---|" * (len(names) + 1)]
    for x in xs:
        row = [fmt(x)]
        for name in names:
            ys = [y for px, y in chart["series"][name] if px == x]
            row.append(fmt(ys[-1]) if ys else "")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def draw(name, chart, out_dir):
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    numeric = all(isinstance(x, (int, float)) for pts in chart["series"].values() for x, _ in pts)
    if numeric:
        for series, points in chart["series"].items():
            points = sorted(points)
            # Dense series (a value per second, say) read better without markers.
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o" if len(points) <= 30 else None,
                    label=series)
        xs = [x for pts in chart["series"].values() for x, _ in pts]
        # x spanning orders of magnitude (batch sizes 1 to 1,000) reads on a log scale.
        if xs and min(xs) > 0 and max(xs) / min(xs) >= 100:
            ax.set_xscale("log")
    else:
        xs = []
        for points in chart["series"].values():
            for x, _ in points:
                if x not in xs:
                    xs.append(x)
        width = 0.8 / max(1, len(chart["series"]))
        for i, (series, points) in enumerate(chart["series"].items()):
            values = dict(points)
            positions = [j + i * width for j, x in enumerate(xs) if x in values]
            ax.bar(positions, [values[x] for x in xs if x in values], width, label=series)
        ax.set_xticks([j + width * (len(chart["series"]) - 1) / 2 for j in range(len(xs))])
        ax.set_xticklabels([str(x) for x in xs], rotation=15, ha="right")
    ax.set_title(chart["title"])
    if chart.get("x_unit"):
        ax.set_xlabel(chart["x_unit"])
    ax.set_ylabel(chart["unit"])
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    path = os.path.join(out_dir, f"{name}.png")
    fig.savefig(path)
    plt.close(fig)
    return os.path.basename(path)


def main():
    out_dir = sys.argv[1]
    charts, ratios = load(os.path.join(out_dir, "figures.jsonl"))
    machine = ""
    machine_path = os.path.join(out_dir, "machine.txt")
    if os.path.exists(machine_path):
        with open(machine_path) as f:
            machine = f.read().strip()
    md = ["# pg_outbox benchmark report", ""]
    if machine:
        md += ["## Machine and settings", "", "```", machine, "```", ""]
    if ratios:
        md += ["## Ratios against the baselines", "", "| what | measured | target | |", "|---|---|---|---|"]
        for r in ratios:
            target = r.get("target")
            if target is None:
                verdict = ""
            elif "at most" in r["ratio"]:
                verdict = "met" if r["value"] <= target else "missed"
            else:
                verdict = "met" if r["value"] >= target else "missed"
            md.append(f"| {r['ratio']} | {r['value']:.2f} | {'' if target is None else target} | {verdict} |")
        md.append("")
    for name, chart in charts.items():
        png = draw(name, chart, out_dir)
        md += [f"## {chart['title']}", "", f"Unit: {chart['unit']}.", "", table(chart), "", f"![{chart['title']}]({png})", ""]
    with open(os.path.join(out_dir, "REPORT.md"), "w") as f:
        f.write("\n".join(md))
    print(f"wrote {os.path.join(out_dir, 'REPORT.md')} with {len(charts)} charts and {len(ratios)} ratios")


if __name__ == "__main__":
    main()
