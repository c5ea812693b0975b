"""Host memory bandwidth as three access patterns see it, on torch's CPU threads: a copy (read one
buffer, write another: strata_step_rates' figure, which counts 2 bytes a byte copied), an in-place
add (read two, write one back where it was read: the pattern of the host Adam kernel, which writes
its states where it reads them), and a read alone (a sum). A copy's destination is written without
being read, and caches that allocate on write read it first, so a copy moves a third more than it
counts; the in-place pattern does not. Best of 5 each, over buffers larger than the caches.
    python3 tools/gpu/probes/host_memory.py [GIB] [THREADS]"""

import json
import sys
import time

import torch


def best_of(fn, repeats=5):
    fn()  # faults the pages in
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main():
    gib = float(sys.argv[1]) if len(sys.argv) > 1 else 1.0
    if len(sys.argv) > 2:
        torch.set_num_threads(int(sys.argv[2]))
    n = int(gib * (1 << 30)) // 4
    a, b, c = torch.ones(n), torch.ones(n), torch.empty(n)
    nbytes = 4 * n
    copy_s = best_of(lambda: c.copy_(a))
    add_s = best_of(lambda: a.add_(b))
    sum_s = best_of(lambda: a.sum())
    out = {
        "threads": torch.get_num_threads(),
        "buffer_bytes": nbytes,
        "copy_gbps_counted_2x": 2 * nbytes / copy_s / 1e9,
        "copy_gbps_counted_3x": 3 * nbytes / copy_s / 1e9,
        "inplace_add_gbps_3x": 3 * nbytes / add_s / 1e9,
        "read_gbps": nbytes / sum_s / 1e9,
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
