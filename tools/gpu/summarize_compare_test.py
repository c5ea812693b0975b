#!/usr/bin/env python3
"""Tests of tools/gpu/summarize_compare.py's verdicts and fits on made-up rounds.

Example:
    python3 tools/gpu/summarize_compare_test.py
"""

import os
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import summarize_compare as sc  # noqa: E402


def series(ms, floor=None, info=None):
    floor = floor or [0.0] * len(ms)
    return {
        "label": "",
        "error": "",
        "info": info or {},
        "samples": [{"ms": m, "floor_ms": f, "ref_gbps": 0.0} for m, f in zip(ms, floor)],
    }


class VerdictTest(unittest.TestCase):
    def test_faster_pairs_rounds(self):
        data = {"a": series([10, 11, 12]), "b": series([11, 12, 13])}
        comp = {"kind": "faster", "a": "a", "b": "b", "goal": 1.0}
        values = sc.comparison_values(comp, data)
        self.assertEqual(sc.verdict("faster", values, 1.0), "PASS")
        # The medians differ, but the rounds overlap the goal: no verdict.
        data["b"] = series([9.5, 12.5, 13])
        self.assertEqual(
            sc.verdict("faster", sc.comparison_values(comp, data), 1.0), "WITHIN NOISE"
        )
        data["b"] = series([9, 10, 11])
        self.assertEqual(sc.verdict("faster", sc.comparison_values(comp, data), 1.0), "FAIL")

    def test_floor_and_fraction(self):
        self.assertEqual(sc.verdict("floor", [1.01, 1.02, 1.03], 1.03), "PASS")
        self.assertEqual(sc.verdict("floor", [1.02, 1.036], 1.03), "WITHIN NOISE")
        self.assertEqual(sc.verdict("floor", [1.031, 1.05], 1.03), "FAIL")
        self.assertEqual(sc.verdict("fraction", [0.86, 0.9], 0.85), "PASS")
        self.assertEqual(sc.verdict("fraction", [0.84, 0.849], 0.85), "FAIL")
        self.assertEqual(sc.verdict("fraction", [0.84, 0.86], 0.85), "WITHIN NOISE")
        self.assertEqual(sc.verdict("floor", [], 1.03), "NOT RUN")

    def test_floor_can_name_another_field(self):
        data = {"a": series([10.2, 10.3], [10.0, 10.0])}
        data["a"]["samples"][0]["own_floor_ms"] = 9.0
        data["a"]["samples"][1]["own_floor_ms"] = 10.3
        comp = {"kind": "floor", "a": "a", "b": "", "goal": 1.03}
        self.assertEqual(sc.verdict("floor", sc.comparison_values(comp, data), 1.03), "PASS")
        comp["floor"] = "own_floor_ms"
        values = sc.comparison_values(comp, data)
        self.assertAlmostEqual(values[0], 10.2 / 9.0)
        self.assertEqual(sc.verdict("floor", values, 1.03), "WITHIN NOISE")
        # A sample without the field is left out, not divided by zero.
        del data["a"]["samples"][0]["own_floor_ms"]
        self.assertEqual(len(sc.comparison_values(comp, data)), 1)

    def test_failed_series_is_not_judged(self):
        data = {"a": series([1.0]), "b": series([2.0])}
        data["a"]["error"] = "DATA_LOSS: wrong"
        comp = {"kind": "faster", "a": "a", "b": "b", "goal": 1.0}
        self.assertEqual(sc.comparison_values(comp, data), [])


class CurveTest(unittest.TestCase):
    def test_fit_is_exact_on_a_line(self):
        a, b, r2 = sc.fit_line([1, 2, 4, 8], [3, 5, 9, 17])
        self.assertAlmostEqual(a, 1.0)
        self.assertAlmostEqual(b, 2.0)
        self.assertAlmostEqual(r2, 1.0)

    def test_bytes_slope_against_the_link(self):
        # 20 GB/s: 0.05 ms per MB; the step adds a fixed 2 ms.
        data = {"series": {}, "curves": [], "comparisons": [], "context": {"gpu": "test"}}
        ids, xs = [], []
        for mb in (100, 200, 400, 800, 1600):
            sid = f"bytes/{mb}"
            floor = mb * 0.05
            data["series"][sid] = series([floor + 2] * 3, [floor] * 3, {"moment_bytes": mb * 1e6})
            ids.append(sid)
            xs.append(mb * 1e6)
        curve = {
            "name": "c",
            "x_label": "moment bytes each way",
            "y": "ms",
            "note": "",
            "points": [{"x": x, "series": s} for x, s in zip(xs, ids)],
        }
        lines, fit = sc.describe_curve(curve, data["series"])
        self.assertAlmostEqual(fit["slope_over_link"], 1.0, places=6)
        self.assertTrue(any("PASS" in line for line in lines))
        data["curves"].append(curve)
        with tempfile.TemporaryDirectory() as d:
            sc.summarize(data, d)
            with open(os.path.join(d, "bytes.svg")) as f:
                self.assertIn("<svg", f.read())

    def test_per_tensor_overhead(self):
        # 10^4 tensors take 20 ms more over the floor than 100: 2 us for each of 9900 more.
        extra = 9900 * 2e-3
        data = {
            "tensors/strata_many": series([50 + extra] * 3, [40] * 3, {"tensors": 10000}),
            "tensors/strata_one": series([45] * 3, [35] * 3, {"tensors": 100}),
        }
        (line,) = sc.tensors_overhead(data)
        self.assertIn("2.00 us a tensor", line)


if __name__ == "__main__":
    unittest.main()
