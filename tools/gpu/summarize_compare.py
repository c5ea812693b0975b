#!/usr/bin/env python3
"""Summarizes strata_optim_compare's JSON: median, min and max of every series, a verdict per
comparison, fits of the scaling curves, and one SVG per curve.

A verdict is given only where the difference is larger than the spread of the rounds: the
approaches ran in alternation, so round i of one is paired with round i of the other.
- faster (a / b, round by round): PASS when every round's ratio is below the goal (1: a faster),
  FAIL when every one is above it, WITHIN NOISE otherwise.
- floor (a / its own adjacent floor: the sample's floor_ms, or the field the comparison names):
  PASS when every round is at or below the goal, FAIL when every round is above it, WITHIN NOISE
  otherwise.
- fraction (a's floor / a, the share of the reference reached): PASS when every round reaches the
  goal, FAIL when none does, WITHIN NOISE otherwise.

Example:
    build/bin/strata_optim_compare --out=compare.json
    python3 tools/gpu/summarize_compare.py compare.json --svg-dir=bench/results/X/
"""

import argparse
import json
import math
import os
import statistics
import sys


def spread(values):
    """(median, min, max) of a non-empty list."""
    return statistics.median(values), min(values), max(values)


def verdict(kind, values, goal):
    """PASS / FAIL / WITHIN NOISE for one comparison's per-round values (see the module doc)."""
    if not values:
        return "NOT RUN"
    lo, hi = min(values), max(values)
    if kind == "faster":
        return "PASS" if hi < goal else "FAIL" if lo > goal else "WITHIN NOISE"
    if kind == "floor":
        return "PASS" if hi <= goal else "FAIL" if lo > goal else "WITHIN NOISE"
    if kind == "fraction":
        return "PASS" if lo >= goal else "FAIL" if hi < goal else "WITHIN NOISE"
    raise ValueError(f"unknown comparison kind {kind!r}")


def comparison_values(comp, series):
    """The per-round values a comparison judges, or [] when a series is missing or failed."""
    a = series.get(comp["a"])
    if a is None or a.get("error") or not a["samples"]:
        return []
    if comp["kind"] == "faster":
        b = series.get(comp["b"])
        if b is None or b.get("error") or not b["samples"]:
            return []
        return [x["ms"] / y["ms"] for x, y in zip(a["samples"], b["samples"]) if y["ms"] > 0]
    if comp["kind"] == "floor":
        field = comp.get("floor", "floor_ms")
        return [x["ms"] / x[field] for x in a["samples"] if x.get(field, 0) > 0]
    return [x["floor_ms"] / x["ms"] for x in a["samples"] if x["ms"] > 0]


def fit_line(xs, ys):
    """Least squares y = a + b x; returns a, b, R^2."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else 0.0
    a = my - b * mx
    ss_res = sum((y - (a + b * x)) ** 2 for x, y in zip(xs, ys))
    ss_tot = sum((y - my) ** 2 for y in ys)
    return a, b, (1 - ss_res / ss_tot) if ss_tot > 0 else 1.0


def curve_points(curve, series):
    """[(x, [y of each round])] for a curve; y is ms, or ms over the floor for 'ms_over_floor'."""
    out = []
    for p in curve["points"]:
        s = series.get(p["series"])
        if s is None or s.get("error") or not s["samples"]:
            continue
        if curve["y"] == "ms_over_floor":
            ys = [x["ms"] - x["floor_ms"] for x in s["samples"]]
        else:
            ys = [x["ms"] for x in s["samples"]]
        out.append((p["x"], ys))
    return out


def describe_curve(curve, series):
    """Lines of text about one curve: its points, the fit, and what the fit means."""
    pts = curve_points(curve, series)
    lines = [f"{curve['name']} (y: {curve['y']}, against {curve['x_label']})"]
    if len(pts) < 2:
        return lines + ["  not enough points"], None
    for x, ys in pts:
        med, lo, hi = spread(ys)
        lines.append(f"  x={x:<14.6g} median {med:10.3f} ms  min {lo:10.3f}  max {hi:10.3f}")
    a, b, r2 = fit_line([x for x, _ in pts], [statistics.median(ys) for _, ys in pts])
    fit = {"a": a, "b": b, "r2": r2}
    lines.append(f"  fit y = {a:.4g} + {b:.4g} x, R^2 {r2:.4f}")
    if curve["x_label"].startswith("moment bytes") and curve["y"] == "ms":
        # The link's own slope: floor ms per byte, from every sample's adjacent floor.
        per_byte = [
            x["floor_ms"] / series[p["series"]]["info"]["moment_bytes"]
            for p in curve["points"]
            if p["series"] in series and "moment_bytes" in series[p["series"]]["info"]
            for x in series[p["series"]]["samples"]
            if x["floor_ms"] > 0
        ]
        if per_byte:
            link = statistics.median(per_byte)
            fit["slope_over_link"] = b / link
            ok = r2 >= 0.99 and abs(b / link - 1) <= 0.03
            lines.append(
                f"  slope {b * 1e9:.4f} ms/GB = {b / link:.4f} x the link's "
                f"({link * 1e9:.4f} ms/GB); goal R^2 >= 0.99 and slope within 3%: "
                f"{'PASS' if ok else 'FAIL'}"
            )
            lines.append(f"  intercept {a:.3f} ms (fixed cost of a step)")
    elif curve["x_label"] == "layers":
        lines.append(f"  per-layer overhead over the link floor: {b * 1e3:.2f} us a layer")
    return lines, fit


def tensors_overhead(series):
    """Per-tensor overhead (us) of strata and the LibTorch pipeline from the 'tensors' part."""
    out = []
    for who in ("strata", "torch"):
        many, one = series.get(f"tensors/{who}_many"), series.get(f"tensors/{who}_one")
        if not many or not one or many.get("error") or one.get("error"):
            continue
        if not many["samples"] or not one["samples"]:
            continue
        extra = [
            (m["ms"] - m["floor_ms"]) - (o["ms"] - o["floor_ms"])
            for m, o in zip(many["samples"], one["samples"])
        ]
        n = many["info"]["tensors"] - one["info"]["tensors"]
        per = [e / n * 1e3 for e in extra]
        med, lo, hi = spread(per)
        out.append(
            f"{who}: {int(many['info']['tensors'])} tensors vs {int(one['info']['tensors'])} "
            f"(same layers and bytes): {med:.2f} us a tensor (min {lo:.2f}, max {hi:.2f}); "
            f"step {statistics.median([m['ms'] for m in many['samples']]):.2f} ms against "
            f"{statistics.median([o['ms'] for o in one['samples']]):.2f} ms"
        )
    return out


def first_step_table(series):
    """Rows about time to the first step and host memory, for the series of 'first_step'."""
    rows = []
    for sid in sorted(
        series,
        key=lambda s: (
            (s.rsplit("_", 1)[0], int(s.rsplit("_", 1)[1]))
            if s.startswith("first_step/")
            else ("", 0)
        ),
    ):
        if not sid.startswith("first_step/"):
            continue
        s = series[sid]
        if not s["samples"]:
            continue
        med = lambda k: statistics.median(
            x.get(k, 0) if k != "ms" else x["ms"] for x in s["samples"]
        )
        rows.append(
            f"{sid:34} first step {med('ms') / 1e3:7.2f} s (setup {med('setup_ms') / 1e3:6.2f} s)"
            f"  RSS +{med('rss_growth_bytes') / 1e9:6.2f} GB  pinned reserved "
            f"{med('pinned_reserved_bytes') / 1e9:6.2f} GB held {med('pinned_held_bytes') / 1e9:6.2f} GB"
        )
    return rows


def svg_curve(curve, series, fit, path, context):
    """One curve as an SVG: median per point with a min-max bar, the fit line."""
    pts = curve_points(curve, series)
    if len(pts) < 2:
        return
    w, h, left, right, top, bottom = 720, 420, 80, 20, 60, 50
    xs = [x for x, _ in pts]
    log_x = max(xs) / max(min(xs), 1e-30) >= 16
    tx = (lambda x: math.log10(x)) if log_x else (lambda x: x)
    lo_x, hi_x = tx(min(xs)), tx(max(xs))
    top_y = max(max(ys) for _, ys in pts) * 1.15
    bottom_y = min(0.0, min(min(ys) for _, ys in pts))
    px = lambda x: left + (tx(x) - lo_x) / (hi_x - lo_x) * (w - left - right)
    py = lambda y: h - bottom - (y - bottom_y) / (top_y - bottom_y) * (h - top - bottom)
    sub = f"{context.get('gpu', '')}; median of {len(pts[0][1])} interleaved rounds, bars min-max"
    if fit:
        sub += f"; fit y = {fit['a']:.3g} + {fit['b']:.3g} x, R^2 {fit['r2']:.4f}"
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
        'font-family="sans-serif" font-size="12">',
        f'<rect width="{w}" height="{h}" fill="white"/>',
        f'<text x="{left}" y="22" font-size="14">{curve["name"]}</text>',
        f'<text x="{left}" y="42" fill="#52606d">{sub}</text>',
        f'<line x1="{left}" y1="{h - bottom}" x2="{w - right}" y2="{h - bottom}" stroke="black"/>',
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{h - bottom}" stroke="black"/>',
        f'<text x="{(left + w - right) / 2}" y="{h - 12}" text-anchor="middle">'
        f"{curve['x_label']}{' (log)' if log_x else ''}</text>",
        f'<text x="{left - 60}" y="{top - 10}">{curve["y"]}</text>',
    ]
    for k in range(6):
        y = bottom_y + (top_y - bottom_y) * k / 5
        out.append(f'<text x="{left - 6}" y="{py(y) + 4:.1f}" text-anchor="end">{y:.4g}</text>')
    if fit:
        line = " ".join(
            f"{px(x):.1f},{py(fit['a'] + fit['b'] * x):.1f}"
            for x in (
                [10 ** (lo_x + (hi_x - lo_x) * i / 40) for i in range(41)]
                if log_x
                else [lo_x + (hi_x - lo_x) * i / 40 for i in range(41)]
            )
        )
        out.append(f'<polyline points="{line}" fill="none" stroke="#9aa5b1"/>')
    for x, ys in pts:
        med, lo, hi = spread(ys)
        out.append(
            f'<line x1="{px(x):.1f}" y1="{py(lo):.1f}" x2="{px(x):.1f}" y2="{py(hi):.1f}" '
            'stroke="#1f6feb"/>'
        )
        out.append(f'<circle cx="{px(x):.1f}" cy="{py(med):.1f}" r="4" fill="#1f6feb"/>')
        out.append(f'<text x="{px(x) + 6:.1f}" y="{py(med) - 6:.1f}">{med:.4g}</text>')
        out.append(
            f'<text x="{px(x):.1f}" y="{h - bottom + 16}" text-anchor="middle">{x:.4g}</text>'
        )
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


def summarize(data, svg_dir=None):
    """The summary's lines; writes the SVGs into svg_dir when given."""
    context, series = data["context"], data["series"]
    lines = [f"GPU: {context.get('gpu', '?')}; {context.get('rounds', '?')} interleaved rounds"]
    if context.get("skipped"):
        return lines + [f"skipped: {context['skipped']}"]
    lines.append("series (ms: median [min, max]; x floor: median [min, max])")
    for sid, s in sorted(series.items()):
        if s.get("error"):
            lines.append(f"  {sid:34} ERROR {s['error']}")
            continue
        if not s["samples"] or sid.startswith("first_step/"):
            continue
        med, lo, hi = spread([x["ms"] for x in s["samples"]])
        text = f"  {sid:34} {med:10.3f} [{lo:.3f}, {hi:.3f}] ms"
        ratios = [x["ms"] / x["floor_ms"] for x in s["samples"] if x["floor_ms"] > 0]
        if ratios:
            rm, rl, rh = spread(ratios)
            text += f"  {rm:.4f} [{rl:.4f}, {rh:.4f}] x floor"
        lines.append(text)
        extras = sorted({k for x in s["samples"] for k in x} - {"ms", "floor_ms", "ref_gbps"})
        if extras:
            lines.append(
                "  "
                + " " * 34
                + " "
                + ", ".join(
                    f"{k} {statistics.median(x.get(k, 0) for x in s['samples']):.4g}"
                    for k in extras
                )
            )
    lines.append("verdicts")
    for comp in data["comparisons"]:
        values = comparison_values(comp, series)
        v = verdict(comp["kind"], values, comp["goal"])
        if values:
            med, lo, hi = spread(values)
            lines.append(
                f"  {v:12} {comp['name']}: {med:.4f} [{lo:.4f}, {hi:.4f}] (goal "
                f"{'<' if comp['kind'] == 'faster' else '<=' if comp['kind'] == 'floor' else '>='}"
                f" {comp['goal']:g})"
            )
        else:
            lines.append(f"  {v:12} {comp['name']}")
    for i, curve in enumerate(data["curves"]):
        text, fit = describe_curve(curve, series)
        lines += text
        if svg_dir:
            name = curve["points"][0]["series"].split("/")[0] if curve["points"] else f"curve{i}"
            if name == "first_step":
                name = curve["points"][0]["series"].rsplit("_", 1)[0].replace("/", "_")
            svg_curve(curve, series, fit, os.path.join(svg_dir, f"{name}.svg"), context)
    overhead = tensors_overhead(series)
    if overhead:
        lines.append("per-tensor overhead (10^4 small tensors against one a layer)")
        lines += [f"  {x}" for x in overhead]
    table = first_step_table(series)
    if table:
        lines.append("time to the first step and host memory")
        lines += [f"  {x}" for x in table]
    return lines


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json")
    p.add_argument("--svg-dir", default=None)
    args = p.parse_args()
    with open(args.json) as f:
        data = json.load(f)
    if args.svg_dir:
        os.makedirs(args.svg_dir, exist_ok=True)
    print("\n".join(summarize(data, args.svg_dir)))
    failed = [s for s in data["series"].values() if s.get("error")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
