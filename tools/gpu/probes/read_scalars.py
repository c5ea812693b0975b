"""How long reading a loss on the host takes while a large copy to pinned memory runs on another
stream (as strata's write-backs run after a step): loss.item() against strata.read_scalars(loss).
The loss is ready before the copy starts; the copy's own time is printed beside. Median of 7
alternating repetitions.
    PYTHONPATH=<the strata package> python3 tools/gpu/probes/read_scalars.py [GIB]"""

import statistics
import sys
import time

import torch

import strata


def main():
    gib = float(sys.argv[1]) if len(sys.argv) > 1 else 2.0
    n = int(gib * (1 << 30)) // 4
    src = torch.randn(n, device="cuda")
    dst = torch.empty(n, pin_memory=True)
    loss = src[:4096].square().mean()
    copies = torch.cuda.Stream()
    ways = {
        "loss.item()": lambda: loss.item(),
        "strata.read_scalars(loss)": lambda: strata.read_scalars(loss)[0],
    }
    times = {name: [] for name in ways}
    copy_ms = []
    expected = loss.item()
    strata.read_scalars(loss)  # the first call allocates the reader's pinned buffer
    for _ in range(7):
        for name, read in ways.items():
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(copies):
                start.record()
                dst.copy_(src, non_blocking=True)
                end.record()
            t0 = time.perf_counter()
            value = read()
            times[name].append((time.perf_counter() - t0) * 1e3)
            assert value == expected, (value, expected)
            torch.cuda.synchronize()
            copy_ms.append(start.elapsed_time(end))
    print(
        f"{torch.cuda.get_device_name()}: a {gib:g} GiB copy to pinned memory on a side stream "
        f"takes {statistics.median(copy_ms):.1f} ms (median of {len(copy_ms)})"
    )
    for name, t in times.items():
        print(
            f"  {name:28s} returns after {statistics.median(t):8.3f} ms "
            f"[{min(t):.3f}, {max(t):.3f}] of the copy"
        )


if __name__ == "__main__":
    main()
