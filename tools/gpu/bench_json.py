"""Reading Google Benchmark JSON for strata's summarizers: the rows of each benchmark grouped by
run name, with the median (aggregate or computed) and the worst repetition of a counter."""

import json
import statistics


class Group:
    """Every row of one benchmark: per-repetition rows, aggregates by name, error messages."""

    def __init__(self, name):
        self.name = name
        self.iterations = []
        self.aggregates = {}
        self.errors = []

    def usable(self):
        return bool(self.iterations or self.aggregates)

    def value(self, counter):
        """The median: the median aggregate when present, else the median of the repetitions."""
        if "median" in self.aggregates and counter in self.aggregates["median"]:
            return self.aggregates["median"][counter]
        values = self.per_repetition(counter)
        return statistics.median(values) if values else None

    def per_repetition(self, counter):
        """The counter's value in each repetition ([] when the JSON holds aggregates only)."""
        return [r[counter] for r in self.iterations if counter in r]

    def worst(self, counter):
        """The largest value over the repetitions, for counters that must stay 0. With aggregates
        only, the mean: for counts >= 0 it is above 0 exactly when some repetition was."""
        values = self.per_repetition(counter)
        if values:
            return max(values)
        for agg in ("mean", "median"):
            if agg in self.aggregates and counter in self.aggregates[agg]:
                return self.aggregates[agg][counter]
        return None


def load(path):
    with open(path) as f:
        data = json.load(f)
    groups = {}
    for b in data.get("benchmarks", []):
        name = b.get("run_name", b["name"])
        g = groups.setdefault(name, Group(name))
        if b.get("error_occurred"):
            g.errors.append(b.get("error_message", "error"))
        elif b.get("run_type") == "aggregate":
            g.aggregates[b.get("aggregate_name")] = b
        else:
            g.iterations.append(b)
    return data.get("context", {}), groups


def find(groups, family):
    """The group of `family` ("BM_RawPinnedCopy/h2d"); run names go on with "/iterations:5/..."."""
    for name, g in groups.items():
        if name == family or name.startswith(family + "/"):
            return g
    return None


def fmt(v, spec=".2f"):
    return "-" if v is None else format(v, spec)


class Verdicts:
    """The PASS / FAIL / MISSING lines of a summary; all_pass() when every target passed."""

    def __init__(self):
        self.results = []

    def add(self, label, ok, missing_reason=None):
        if ok is None:
            self.results.append(False)
            text = "MISSING" + (f" ({missing_reason})" if missing_reason else "")
        else:
            self.results.append(ok)
            text = "PASS" if ok else "FAIL"
        print(f"  {label}: {text}")

    def judge(self, label, values, goal, at_least):
        """A target judged over repetitions: PASS when every repetition meets it, FAIL when none
        does, WITHIN NOISE otherwise (counted as not passing), MISSING without values."""
        if not values:
            self.add(label, None, "no repetitions in the JSON")
            return
        ok = [v >= goal if at_least else v <= goal for v in values]
        text = "PASS" if all(ok) else "FAIL" if not any(ok) else "WITHIN NOISE"
        self.results.append(text == "PASS")
        print(
            f"  {label}: median {statistics.median(values):.4f} [{min(values):.4f}, "
            f"{max(values):.4f}] over {len(values)} repetitions "
            f"({'>=' if at_least else '<='} {goal}): {text}"
        )

    def all_pass(self):
        return all(self.results)


def why_missing(*groups):
    """Why a figure is missing: the first (family, group) not in the JSON or skipped; else None."""
    for fam, g in groups:
        if g is None:
            return f"{fam} not in the JSON"
        if not g.usable():
            return f"{fam} skipped: {g.errors[0] if g.errors else 'no data'}"
    return None
