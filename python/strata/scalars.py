"""strata.read_scalars: the values of scalar tensors (a loss, a gradient norm) on the host, without
waiting behind the copies strata leaves running.

    opt = strata.optim.AdamW(model.parameters(), policy="layer_prefetch", overlap="backward",
                             max_grad_norm=1.0)
    loss.backward()
    opt.step()
    loss_value, norm = strata.read_scalars(loss, opt.last_grad_norm)   # not loss.item()

.item() on a CUDA tensor is a copy to the host, and the GPU's copy engines take copies in turn:
after a strata step, the write-backs of the layers stepped last (every byte of state a step
moves goes through them) are still running, and the 4-byte copy waits for them (the README has
the figures), although the value was ready long before. read_scalars has a kernel on torch's
current stream write the values into pinned host memory, and waits for that stream only (its first
call allocates that memory, which may wait for the whole device once). CPU tensors are read as
.item() reads them.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from . import _strata


def read_scalars(*tensors: Optional[torch.Tensor]) -> List[float]:
    """The values of one-element tensors as Python floats (a bool reads 0.0 or 1.0; None reads
    nan), each after the work queued before it on torch's current stream. CUDA tensors must be on
    one device; a tensor of more than one element raises RuntimeError."""
    for i, t in enumerate(tensors):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(
                f"strata.read_scalars: argument {i} is a {type(t).__name__}, not a tensor"
            )
    return list(_strata.read_scalars(list(tensors)))
