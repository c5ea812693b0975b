"""One line for one run of bench/users_script.py --one: its label, ms a step, the range of its
step times, the device peak, the md5 of its losses (equal hashes: bitwise equal losses) and how
its steps ran; FAILED with the log's tail when the run printed no RESULT line. Used by the
tools/gpu scripts that run approaches each in a process of their own.

    python3 tools/gpu/summarize_run.py LOG LABEL ROUND
"""

import hashlib
import json
import sys


def main():
    log, label, r = sys.argv[1:]
    lines = [x for x in open(log) if x.startswith("RESULT ")]
    if not lines:
        tail = open(log).read()[-300:].replace("\n", " | ")
        print(f"r{r} {label:<40} FAILED: {tail}")
        return
    res = json.loads(lines[-1][7:])
    h = hashlib.md5(json.dumps(res["losses"]).encode()).hexdigest()[:8]
    steps = f"{min(res['step_ms']):.1f}-{max(res['step_ms']):.1f}"
    outcomes = sorted(set(filter(None, res.get("step_outcomes") or [])))
    print(
        f"r{r} {label:<40} {res['ms_per_step']:8.1f} ms  steps {steps}  "
        f"peak {res['device_peak_gib']:.2f} GiB  losses {h}  {','.join(outcomes)}"
    )


if __name__ == "__main__":
    main()
