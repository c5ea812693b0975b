"""A step-by-step smoke run of the extension, each call printed before the next: where a crash
happens is the last line printed. tools/gpu/run_python.sh runs it before pytest."""

import torch

from strata import _strata

print("imported", flush=True)
KW = dict(policy=None, gpu_budget=None, prefetch_depth=1, roles="all", pinned_budget=None)
KW.update(overlap="none", undo_on_gpu=False, hybrid_fraction=None)
sim = _strata.Runtime(device="simulated", **KW)
t = torch.zeros(4)
print("simulated runtime, CPU tensor bound:", sim.is_bound(t), flush=True)
sim.register(t, "t", 0, "parameter", "gpu")
print("registered on the simulated runtime:", sim.is_bound(t), flush=True)
sim.unregister(t, True)
if torch.cuda.is_available():
    rt = _strata.Runtime(device="cuda", **KW)
    print("CUDA runtime made, policy", rt.policy(), flush=True)
    print("CUDA runtime, CPU tensor bound:", rt.is_bound(t), flush=True)
    c = torch.zeros(4, device="cuda")
    print("CUDA runtime, CUDA tensor bound:", rt.is_bound(c), flush=True)
    rt.register(c, "c", 0, "parameter", None)
    print("registered on the CUDA runtime:", rt.is_bound(c), flush=True)
    rt.unregister(c, True)
    print("unregistered; leak report:", rt.leak_report(), flush=True)
print("smoke done", flush=True)
