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

__version__ = "0.3.0"  # the one version: CMakeLists.txt and pyproject.toml read it from here


def _check_torch():
    # The extension links LibTorch and torch_python of the torch it was built against; another
    # torch fails to load it with a loader error, so say what is wrong first.
    try:
        from ._build_info import TORCH_VERSION
    except ImportError:  # a tree not built by CMake's install (tests run from the source tree)
        return
    import torch

    have = torch.__version__.split("+")[0]
    if have != TORCH_VERSION.split("+")[0]:
        raise ImportError(
            f"strata {__version__} was built against torch {TORCH_VERSION}, but torch {have} is "
            "installed; reinstall strata against this torch (pip install --no-build-isolation "
            "--force-reinstall strata-tiering, or from its source tree), or install torch "
            f"{TORCH_VERSION}"
        )


_check_torch()

from . import distributed, optim  # noqa: E402
from ._attach import attach  # noqa: E402
from .runtime import Runtime, parse_bytes  # noqa: E402
from .scalars import read_scalars  # noqa: E402

__all__ = ["Runtime", "attach", "distributed", "optim", "parse_bytes", "read_scalars"]
