"""The link between pinned host memory and the GPU as torch's copies see it: host to device alone,
device to host alone, and both at once (one stream each way), the figures a streamed step's floor
is computed from. Best of 5 each, over 2 GiB buffers unless told.
    python3 tools/gpu/probes/link.py [GIB]"""

import sys
import time

import torch


def timed(fn, repeats=5):
    fn()  # first use: the streams and the copy engines warm
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def main():
    gib = float(sys.argv[1]) if len(sys.argv) > 1 else 2.0
    n = int(gib * (1 << 30))
    host_in = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    host_out = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev_in = torch.empty(n, dtype=torch.uint8, device="cuda")
    dev_out = torch.empty(n, dtype=torch.uint8, device="cuda")
    h2d_stream, d2h_stream = torch.cuda.Stream(), torch.cuda.Stream()

    def h2d():
        with torch.cuda.stream(h2d_stream):
            dev_in.copy_(host_in, non_blocking=True)

    def d2h():
        with torch.cuda.stream(d2h_stream):
            host_out.copy_(dev_out, non_blocking=True)

    def both():
        h2d()
        d2h()

    gbs = n / 1e9
    print(f"pinned {gib:g} GiB copies, torch, one stream each way (best of 5):")
    print(f"h2d {gbs / timed(h2d):.1f} GB/s")
    print(f"d2h {gbs / timed(d2h):.1f} GB/s")
    print(f"both at once: {gbs / timed(both):.1f} GB/s each way")
    print(torch.cuda.get_device_name())


if __name__ == "__main__":
    main()
