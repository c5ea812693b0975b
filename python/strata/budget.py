"""gpu_budget="auto": the GPU budget strata.optim sets itself once the first step has run; and,
under overlap="backward", where a step in backward keeps its undo, decided the same way.

    opt = strata.optim.AdamW(model.parameters(), gpu_budget="auto")
    # step 1 streams every layer's states; after it, the budget is what the GPU has free less
    # torch's headroom, and the layers that fit stay on the GPU from step 2 on
    opt.runtime.stats()["gpu_budget_bytes"]

Note [The automatic budget]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
A budget given by hand is a guess about torch's activations. Measured instead: the first step runs
with every layer's states streamed (no layer resident, the staging ring only), so it shows the most
torch needs beside strata. After it, torch's caching allocator holds `reserved` bytes and peaked at
`peak` reserved bytes during the step; the next steps need the same again, so torch may grow by
`peak - reserved` beyond what it holds (its cache keeps the rest). The budget is what strata holds
now plus the driver's free memory less that growth and a margin (a twentieth of the GPU, 1 GiB at
least) for what the first step did not show: a longer batch, fragmentation, another library. Then
layer_prefetch keeps as many whole layers resident as fit (See Note [Resident layers] in
policies/ring_plan.cpp): they never cross the link again. The budget is set once, logged in
one line, and reported in Runtime.stats() as gpu_budget_bytes with gpu_budget_from "auto". On the
simulated device there is no driver to ask: the memory comes from device_memory, which tests
replace.

Note [The undo on the GPU when there is room]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A step taken in backward keeps, for its redo, the bytes its kernels overwrite of tensors resting on
the GPU (See Note [Undo log] in runtime/undo_log.cpp): with float32 parameters and streamed states,
4 bytes a parameter. Copied to pinned memory they cross the link beside the states' own write-backs
and can make the step in backward slower than the step after it (See Note [When to step in
backward] in strata/_when.py); kept on the GPU they cost no link time, and GPU memory until
step(), in blocks of torch's cache (See Note [The undo in the framework's memory] in
runtime/undo_log.cpp). Without undo_on_gpu given (and no budget in bytes), strata.optim, when it
makes the runtime, takes its first step after backward, which shows torch's peak, and then
decides. The undo is the bytes of the parameters and states resting on the GPU in the layers
stepped on the GPU (undo_need). It goes on the GPU when two things hold, and stays in pinned memory
otherwise:
- it fits in what the driver has free less torch's headroom (as for the automatic budget), so
  that it can never take memory torch will ask for;
- it adds nothing to torch's peak: the tensors torch holds at step() (the gradients, backward's
  activations gone) plus the undo are at most the most torch has held, read after the first
  step. The undo is kept layer by layer as backward frees activations and makes gradients, so
  the end of backward, where all of it is kept beside every gradient, is where it would raise the
  peak. Where
  activations outweigh gradients and undo together (long sequences, large batches) it rides in
  memory backward has freed; where they do not (a small batch), it would add its bytes to the
  device's peak, and offloading is about that peak, so the steps copy it off instead and the
  optimizer measures whether they are still faster in backward.
The peak is torch's since the process began (resetting it would change what the user's own
max_memory_allocated reads); the first training step is the largest in the loops strata serves.
Under a budget (gpu_budget="auto" or bytes) the budget bounds the undo instead: the user gave the
GPU memory strata may use. Stepping the first step in backward would have copied the undo off the
GPU, and held as much pinned memory, only to learn it. Decided once and logged in one line;
Runtime.stats() reports undo_on_gpu and undo_on_gpu_from "auto". On the simulated device there is
no driver to ask: the undo stays in (simulated) pinned memory, as with undo_on_gpu=False.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch

_GIB = 2**30
_log = logging.getLogger("strata")


class DeviceMemory(NamedTuple):
    free: int  # the driver's free bytes
    total: int  # the device's bytes
    torch_reserved: int  # what torch's caching allocator holds now
    torch_peak: int  # the most it held since the process began (or its peaks were reset)
    torch_allocated: int  # the bytes of torch's tensors now
    torch_peak_allocated: int  # the most they were since the process began (or a reset)


def device_memory(runtime) -> DeviceMemory:
    """The GPU's memory as the driver and torch see it now (See Note [The automatic budget])."""
    if runtime.simulated or not torch.cuda.is_available():
        raise RuntimeError(
            "gpu_budget='auto' measures the GPU's free memory, and the simulated device has "
            "none; give a budget in bytes"
        )
    dev = runtime.cuda_device
    free, total = torch.cuda.mem_get_info(dev)
    return DeviceMemory(
        free,
        total,
        torch.cuda.memory_reserved(dev),
        torch.cuda.max_memory_reserved(dev),
        torch.cuda.memory_allocated(dev),
        torch.cuda.max_memory_allocated(dev),
    )


def headroom(mem: DeviceMemory) -> int:
    """What torch may still take after the first step: its growth to its peak and a margin
    (See Note [The automatic budget])."""
    return max(0, mem.torch_peak - mem.torch_reserved) + max(_GIB, mem.total // 20)


def auto_budget(mem: DeviceMemory, strata_now: int) -> tuple:
    """(budget in bytes, headroom in bytes) from the memory after the first step
    (See Note [The automatic budget]); the budget is never below what strata holds now."""
    room = headroom(mem)
    return strata_now + max(0, mem.free - room), room


def describe(mem: DeviceMemory, budget: int, headroom: int, resident: int, layers: int) -> str:
    """The log line's figures."""
    return (
        f"after the first step the GPU had {mem.free / _GIB:.2f} GiB free of "
        f"{mem.total / _GIB:.1f}, torch held {mem.torch_reserved / _GIB:.2f} GiB and peaked at "
        f"{mem.torch_peak / _GIB:.2f}; leaving {headroom / _GIB:.2f} GiB for torch, the budget is "
        f"{budget / _GIB:.2f} GiB: {resident} of {layers} layers' states now stay on the GPU"
    )


def set_auto_budget(runtime, name: str) -> None:
    """Sets the runtime's budget after the first step (See Note [The automatic budget]) and logs
    it in one line; `name` is the optimizer's ("AdamW")."""
    mem = device_memory(runtime)
    budget, room = auto_budget(mem, runtime.stats()["gpu_reserved_bytes"])
    runtime._rt.set_gpu_budget(budget)
    layers = {}
    for t in runtime._rt.tensors():
        if t["role"] not in ("parameter", "gradient") and t["bytes"]:
            layers[t["layer"]] = layers.get(t["layer"], True) and t["tier"] == "gpu"
    _log.info(
        "strata.optim.%s: gpu_budget auto: %s",
        name,
        describe(mem, budget, room, sum(layers.values()), len(layers)),
    )


def undo_need(runtime, host_layers) -> int:
    """The bytes a step in backward keeps for its redo on the GPU, were the undo there: the
    parameters and states resting on the GPU (not staged) outside `host_layers`, the layers
    stepped on the host (See Note [The undo on the GPU when there is room])."""
    return sum(
        t["bytes"]
        for t in runtime._rt.tensors()
        if t["role"] in ("parameter", "optimizer_state")
        and t["tier"] == "gpu"
        and not t["staged"]
        and t["layer"] not in host_layers
    )


def set_auto_undo(runtime, name: str, need: int) -> None:
    """Decides where a step in backward keeps its undo of `need` bytes after the first step
    (See Note [The undo on the GPU when there is room]) and logs it in one line; `name` is the
    optimizer's ("AdamW")."""
    mem = device_memory(runtime)
    if runtime._rt.gpu_budget() is not None:
        on, why = True, "the GPU budget bounds it"
    else:
        torch_more = headroom(mem)
        fits = need <= mem.free - torch_more
        at_peak = mem.torch_allocated + need
        within = at_peak <= mem.torch_peak_allocated
        on = fits and within
        why = (
            f"the GPU had {mem.free / _GIB:.2f} GiB free and torch may need "
            f"{torch_more / _GIB:.2f} GiB more; torch holds {mem.torch_allocated / _GIB:.2f} GiB "
            f"of tensors at step() and held at most {mem.torch_peak_allocated / _GIB:.2f} GiB, "
            f"which the undo would {'stay within' if within else 'pass'}"
        )
    runtime._rt.set_undo_on_gpu(on)
    runtime.undo_from = "auto"
    _log.info(
        "strata.optim.%s: undo_on_gpu auto: a step in backward keeps %.2f GiB of the tensors "
        "resting on the GPU for its redo; %s, so it is kept %s",
        name,
        need / _GIB,
        why,
        "on the GPU" if on else "in pinned host memory",
    )
