#!/usr/bin/env python3
"""tools/plot_trace.py: draws a strata-train copy trace (STRATA_TRACE_DIR) as an SVG: the H2D and
D2H lanes of the link, each copy a bar, and a line where each layer's backward ended; and prints,
for the backward (first layer mark to last), how busy each direction was. Copies of kind "other" (on
neither copy stream: undo copies kept on the GPU, a host-stepped layer's gradients and parameters)
have their bytes printed apart. Where the trace marks the optimizer step, each stream's copies from
that mark on are printed too: bytes, first start, last end, busy time and GB/s while busy.

  python3 tools/plot_trace.py TRACE.csv OUT.svg [--title TEXT]
"""

import argparse
import csv
import sys


def load(path):
    copies, marks = [], []
    with open(path) as f:
        for row in csv.DictReader(f):
            start, end = float(row["start_ms"]), float(row["end_ms"])
            if row["kind"] == "mark":
                marks.append((row["bytes_or_label"], start))
            else:
                stream = row.get("stream") or row["kind"]
                copies.append(
                    (row["kind"], int(row["bytes_or_label"]), start, end, stream)
                )
    return copies, marks


def optimizer_streams(copies, at):
    """Per stream, the copies that start at or after `at` (the optimizer step's mark)."""
    print(f"optimizer step from {at:.1f} ms:")
    for stream in sorted({c[4] for c in copies}, key=str):
        mine = [c for c in copies if c[4] == stream and c[2] >= at]
        if not mine:
            continue
        kind = mine[0][0]
        moved = sum(c[1] for c in mine)
        first, last = min(c[2] for c in mine), max(c[3] for c in mine)
        b = busy_ms([(k, n, s, e) for k, n, s, e, _ in mine], kind, first, last)
        rate = moved / b / 1e6 if b > 0 else 0.0
        print(
            f"  stream {stream} ({kind}): {moved / 1e9:.2f} GB in {len(mine)} copies, "
            f"{first - at:.1f} to {last - at:.1f} ms, busy {b:.1f} ms, {rate:.1f} GB/s while busy"
        )


def busy_ms(copies, kind, lo, hi):
    """Time in [lo, hi] during which at least one copy of `kind` ran."""
    spans = sorted((max(c[2], lo), min(c[3], hi)) for c in copies if c[0] == kind)
    total, cur_s, cur_e = 0.0, None, None
    for s, e in spans:
        if e <= s:
            continue
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("out")
    ap.add_argument("--title", default="")
    a = ap.parse_args()
    copies, marks = load(a.trace)
    if not copies:
        sys.exit("no copies in " + a.trace)
    end = max(max(c[3] for c in copies), max((t for _, t in marks), default=0))
    width, left, lane, top = 1000, 60, 40, 40
    x = lambda t: left + (width - left - 20) * t / end
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{top + 3 * lane + 60}" '
        'font-family="sans-serif" font-size="12">',
        f'<text x="{left}" y="20">{a.title or a.trace}</text>',
    ]
    for i, kind in enumerate(("h2d", "d2h")):
        y = top + i * (lane + 10)
        out.append(f'<text x="5" y="{y + lane / 2 + 4}">{kind.upper()}</text>')
        color = "#4477aa" if kind == "h2d" else "#cc6677"
        for k, _, s, e, _ in copies:
            if k == kind:
                out.append(
                    f'<rect x="{x(s):.2f}" y="{y}" width="{max(x(e) - x(s), 0.5):.2f}" '
                    f'height="{lane}" fill="{color}" fill-opacity="0.8"/>'
                )
    bottom = top + 2 * (lane + 10)
    optimizer = [t for label, t in marks if label == "optimizer step"]
    marks = [(label, t) for label, t in marks if label != "optimizer step"]
    for label, t in marks:
        out.append(
            f'<line x1="{x(t):.2f}" y1="{top - 5}" x2="{x(t):.2f}" y2="{bottom}" '
            'stroke="#333" stroke-width="0.6"/>'
        )
        layer = label.split()[-1]
        out.append(
            f'<text x="{x(t) + 1:.2f}" y="{bottom + 12}" font-size="9">{layer}</text>'
        )
    for ms in range(0, int(end) + 1, max(1, int(end / 10))):
        out.append(
            f'<text x="{x(ms):.2f}" y="{bottom + 35}" font-size="10">{ms} ms</text>'
        )
    out.append(
        f'<text x="{left}" y="{bottom + 52}" font-size="10">lines: a layer\'s backward ended '
        "(its number below)</text>"
    )
    out.append("</svg>")
    with open(a.out, "w") as f:
        f.write("\n".join(out) + "\n")
    if len(marks) >= 2:
        lo, hi = min(t for _, t in marks), max(t for _, t in marks)
        for kind in ("h2d", "d2h"):
            b = busy_ms(copies, kind, lo, hi)
            moved = sum(n for k, n, *_ in copies if k == kind)
            print(
                f"{kind}: busy {b:.1f} of the {hi - lo:.1f} ms of backward ({100 * b / (hi - lo):.0f}%); "
                f"{moved / 1e9:.2f} GB in the whole step, which spans {end:.1f} ms"
            )
    other = sum(n for k, n, *_ in copies if k == "other")
    if other:
        print(
            f"other streams (not the link's copy engines): {other / 1e9:.2f} GB in the step"
        )
    if optimizer:
        optimizer_streams(copies, optimizer[0])
    print("wrote", a.out)


if __name__ == "__main__":
    main()
