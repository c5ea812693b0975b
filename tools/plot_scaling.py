#!/usr/bin/env python3
"""Plots a scaling benchmark's Google Benchmark JSON as an SVG: time per operation (median of the
repetitions, bar from min to max) against the benchmark's argument on a log axis, the fit
t = a + b * log10(n) with its R^2, and a goal line.

Example:
    build/bin/strata_allocator_scaling_bench --benchmark_repetitions=5 \
        --benchmark_out=scaling.json --benchmark_out_format=json
    python3 tools/plot_scaling.py scaling.json scaling.svg --goal-ns=200 \
        --title="pooled allocate+deallocate against live blocks"
"""

import argparse
import json
import math
import statistics
import sys
from collections import defaultdict


def load(path):
    """{argument: [ns per iteration of each repetition]} for the file's one benchmark family."""
    with open(path) as f:
        data = json.load(f)
    runs = defaultdict(list)
    for b in data["benchmarks"]:
        if b.get("run_type", "iteration") != "iteration" or b.get("error_occurred"):
            continue
        scale = {"ns": 1.0, "us": 1e3, "ms": 1e6, "s": 1e9}[b.get("time_unit", "ns")]
        arg = int(b["name"].split("/")[1])
        runs[arg].append(b["real_time"] * scale)
    if not runs:
        sys.exit(f"{path}: no benchmark runs")
    return dict(sorted(runs.items())), data.get("context", {})


def fit_log(points):
    """Least squares t = a + b * log10(n); returns a, b, R^2."""
    xs = [math.log10(n) for n, _ in points]
    ys = [t for _, t in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    a = my - b * mx
    ss_res = sum((y - (a + b * x)) ** 2 for x, y in zip(xs, ys))
    ss_tot = sum((y - my) ** 2 for y in ys)
    return a, b, 1 - ss_res / ss_tot if ss_tot > 0 else 1.0


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json")
    p.add_argument("svg")
    p.add_argument("--goal-ns", type=float, default=None)
    p.add_argument("--title", default="")
    args = p.parse_args()
    runs, context = load(args.json)
    stats = [(n, statistics.median(v), min(v), max(v)) for n, v in runs.items()]
    a, b, r2 = fit_log([(n, med) for n, med, _, _ in stats])

    w, h, left, right, top, bottom = 720, 420, 70, 20, 60, 50
    lo_x, hi_x = math.log10(stats[0][0]), math.log10(stats[-1][0])
    top_y = max(max(s[3] for s in stats), args.goal_ns or 0) * 1.15
    px = lambda n: left + (math.log10(n) - lo_x) / (hi_x - lo_x) * (w - left - right)
    py = lambda t: h - bottom - t / top_y * (h - top - bottom)
    out = [
        (
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
            'font-family="sans-serif" font-size="12">'
        ),
        f'<rect width="{w}" height="{h}" fill="white"/>',
        f'<text x="{left}" y="22" font-size="15">{args.title}</text>',
        (
            f'<text x="{left}" y="42" fill="#52606d">{context.get("host_name", "")}, '
            f"{context.get('num_cpus', '?')} CPUs; median of {len(next(iter(runs.values())))} "
            f"repetitions, bars min-max; fit t = {a:.1f} + {b:.1f} log10(n) ns, R^2 {r2:.3f}</text>"
        ),
        f'<line x1="{left}" y1="{h - bottom}" x2="{w - right}" y2="{h - bottom}" stroke="black"/>',
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{h - bottom}" stroke="black"/>',
    ]
    for e in range(math.ceil(lo_x), math.floor(hi_x) + 1):
        x = px(10**e)
        out.append(f'<text x="{x:.1f}" y="{h - bottom + 18}" text-anchor="middle">10^{e}</text>')
    for k in range(6):
        t = top_y * k / 5
        out.append(f'<text x="{left - 6}" y="{py(t) + 4:.1f}" text-anchor="end">{t:.0f}</text>')
    out.append(f'<text x="{left - 50}" y="{top - 10}">ns</text>')
    if args.goal_ns:
        y = py(args.goal_ns)
        out.append(
            f'<line x1="{left}" y1="{y:.1f}" x2="{w - right}" y2="{y:.1f}" stroke="#c0392b" '
            f'stroke-dasharray="6 4"/><text x="{w - right}" y="{y - 6:.1f}" text-anchor="end" '
            f'fill="#c0392b">goal {args.goal_ns:.0f} ns</text>'
        )
    fit = " ".join(
        f"{px(10 ** (lo_x + (hi_x - lo_x) * i / 40)):.1f},"
        f"{py(a + b * (lo_x + (hi_x - lo_x) * i / 40)):.1f}"
        for i in range(41)
    )
    out.append(f'<polyline points="{fit}" fill="none" stroke="#9aa5b1"/>')
    for n, med, mn, mx in stats:
        x = px(n)
        out.append(
            f'<line x1="{x:.1f}" y1="{py(mn):.1f}" x2="{x:.1f}" y2="{py(mx):.1f}" '
            'stroke="#1f6feb"/>'
        )
        out.append(f'<circle cx="{x:.1f}" cy="{py(med):.1f}" r="4" fill="#1f6feb"/>')
        out.append(f'<text x="{x + 6:.1f}" y="{py(med) - 6:.1f}">{med:.0f}</text>')
    out.append("</svg>")
    with open(args.svg, "w") as f:
        f.write("\n".join(out) + "\n")
    for n, med, mn, mx in stats:
        print(f"{n:>9}  median {med:7.1f} ns  min {mn:7.1f}  max {mx:7.1f}")
    print(f"fit t = {a:.1f} + {b:.1f} log10(n) ns, R^2 {r2:.3f}")


if __name__ == "__main__":
    main()
