"""strata: tiered GPU / pinned / pageable memory for PyTorch training state.

The core is C++ (the runtime, its residency policies and a fused Adam); this package is a thin
layer over it. Two ways in:

    # A drop-in optimizer that owns its runtime: Adam states rest in host memory, streamed
    # through the GPU layer by layer under the layer_prefetch policy.
    opt = strata.optim.AdamW(model.parameters(), lr=3e-4, policy="layer_prefetch")

    # Full control: one runtime, a model attached layer by layer (parameters and gradients
    # streamed through forward and backward with roles="all"), the optimizer on top.
    rt = strata.Runtime(policy="layer_prefetch", gpu_budget="8GiB", roles="all")
    strata.attach(model, rt)
    opt = strata.optim.AdamW(model.parameters(), runtime=rt, lr=3e-4)
    ...
    rt.offload_all()   # everything to host memory, GPU memory back to the driver
    rt.reload_all()

    # Under FSDP2 (fully_shard, torchrun): each rank binds and steps its own shards.
    opt = strata.optim.AdamW(fsdp_model.parameters(), lr=3e-4)
    strata.distributed.clip_grad_norm_(opt, 1.0)

    # The loss on the host without waiting behind strata's copies (not loss.item()).
    loss_value, = strata.read_scalars(loss)
"""

from . import distributed, optim
from .runtime import Runtime, attach, parse_bytes
from .scalars import read_scalars

__all__ = ["Runtime", "attach", "distributed", "optim", "parse_bytes", "read_scalars"]
__version__ = "0.2.0"
