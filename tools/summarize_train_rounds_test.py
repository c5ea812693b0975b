#!/usr/bin/env python3
"""Tests of tools/summarize_train_rounds.py on made-up strata-train JSON.

Example:
    python3 tools/summarize_train_rounds_test.py
"""

import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import summarize_train_rounds as st


def data(*runs):
    return {"runs": [{"name": n, "ok": ok, "median_step_ms": ms} for n, ms, ok in runs]}


class RoundsTest(unittest.TestCase):
    def test_kth_runs_of_each_name_pair_up(self):
        d = data(("a", 10, True), ("b", 11, True), ("b", 12, True), ("a", 9, True))
        ratios, v = st.judge(st.rounds(d), "a", "b")
        self.assertEqual([round(r, 4) for r in ratios], [round(10 / 11, 4), 0.75])
        self.assertEqual(v, "PASS")

    def test_rounds_that_disagree_give_no_verdict(self):
        d = data(("a", 10, True), ("b", 11, True), ("a", 12, True), ("b", 11, True))
        self.assertEqual(st.judge(st.rounds(d), "a", "b")[1], "WITHIN NOISE")
        d = data(("a", 12, True), ("b", 11, True), ("a", 13, True), ("b", 11, True))
        self.assertEqual(st.judge(st.rounds(d), "a", "b")[1], "FAIL")

    def test_failed_runs_are_left_out(self):
        d = data(("a", 10, False), ("b", 11, True))
        self.assertEqual(st.judge(st.rounds(d), "a", "b"), ([], "NOT RUN"))
        lines = st.summarize(d, ["a/b"])
        self.assertTrue(any("NOT RUN" in line for line in lines))


if __name__ == "__main__":
    unittest.main()
