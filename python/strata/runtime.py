"""strata.Runtime: a tiering runtime, and the tensors of a model bound to it layer by layer
(strata.attach, in strata/_attach.py, binds a whole model and hooks its layers).

    rt = strata.Runtime(policy="layer_prefetch", gpu_budget="8GiB", roles="all")
    strata.attach(model, rt)                # the blocks of the module tree are layers
    opt = strata.optim.AdamW(model.parameters(), runtime=rt)
    for batch in data:
        opt.zero_grad()
        model(batch).loss.backward()        # the hooks stream layers in and out
        opt.step()
    rt.offload_all(); ...; rt.reload_all()  # a phase switch: the GPU memory goes back to the driver
    print(rt.memory_summary())
    rt.close()                              # the model's tensors become ordinary torch tensors

A bound tensor's storage is strata's memory: the runtime moves it between the GPU, pinned and
pageable host memory and points the tensor at it. A tensor whose data is away (in pageable memory,
or on the GPU while the tensor is a CPU one) cannot be used by torch until it comes back;
``Runtime.is_accessible`` says whether it can, ``Runtime.check_accessible`` raises if not, and the
hooks of ``attach`` check every layer's parameters before its forward, so a forward over data that
is away raises RuntimeError saying where it is.
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence, Union

import torch

from . import _fsdp_copies, _strata
from .distributed import check_shardable, is_dtensor, local, make_grad, whole_storage

_log = logging.getLogger("strata")


def parse_bytes(value: Union[int, str, None], what: str = "gpu_budget") -> Optional[int]:
    """Bytes from an int or a size such as ``"8GiB"``, ``"512 MB"`` or ``"1.5GB"`` (KiB, MiB, GiB,
    TiB and K, M, G, T are powers of two; KB, MB, GB, TB of ten), read by the parser
    strata-train's flags use (base/units.h); None stays None."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"{what}: expected bytes or a size such as '8GiB', got {value!r}")
    n = value
    if isinstance(value, str):
        try:
            n = _strata.parse_bytes(value)
        except ValueError as e:
            raise ValueError(f"{what}: {e}") from None
    if n <= 0:
        raise ValueError(f"{what}: expected a positive number of bytes, got {value!r}")
    return n


class Runtime:
    """A strata runtime: three memory tiers, a residency policy, and the tensors bound to it.

    Args:
        policy: "keep_on_gpu", "bulk", "layer_prefetch" or "hybrid"; None means the STRATA_POLICY
            environment variable, else the default policy.
        gpu_budget: the most GPU memory strata may take, in bytes or as "8GiB"; None: no limit.
        prefetch_depth: layers layer_prefetch brings ahead of use (0: none; its ring then holds
            the one layer in use).
        roles: what the policy moves: "optimizer_states" (Adam's moments and master weights),
            "all" (parameters and gradients too, streamed through forward and backward once the
            model is attached), or a list of roles such as "parameter,optimizer_state".
        device: "auto" (the GPU when there is one), "cuda" (the current CUDA device), "cuda:N",
            or "simulated" (host memory stands in for GPU memory, for CPU tensors and machines
            without a GPU). strata runs where torch computes: the device must be the current one
            when the model trains (torch.cuda.set_device(local_rank) in a distributed script;
            See Note [One CUDA device a runtime] in runtime/runtime.h).
        pinned_budget: the most pinned host memory strata may take; None: no limit.
        overlap: "none", or "backward": the optimizer steps each layer during backward, as soon as
            its gradients are final, speculatively and validated after backward (results equal
            the step after backward's bit for bit; strata.optim.AdamW's overlap argument).
        undo_on_gpu: with overlap, what such a step keeps for a redo of tensors resting on the
            GPU is kept on the GPU while the budget has room (no link traffic, GPU memory of
            their size during backward), else in pinned host memory.
        hybrid_fraction: policy "hybrid" only: the share of parameters whose optimizer step runs
            on the GPU, in [0, 1], the rest on the host; None: the cost model's choice from rates
            measured at setup (See Note [Hybrid placement] in policies/hybrid.cpp).
    """

    def __init__(
        self,
        policy: Optional[str] = None,
        gpu_budget: Union[int, str, None] = None,
        prefetch_depth: int = 1,
        roles: str = "optimizer_states",
        device: str = "auto",
        pinned_budget: Union[int, str, None] = None,
        overlap: str = "none",
        undo_on_gpu: bool = False,
        hybrid_fraction: Optional[float] = None,
    ):
        if not isinstance(prefetch_depth, int) or prefetch_depth < 0:
            raise ValueError(
                f"prefetch_depth: expected an int >= 0 (0: no prefetch), got {prefetch_depth!r}"
            )
        cuda = torch.cuda.is_available() and (
            device == "cuda" or (device == "auto" and _strata.cuda_device_count() > 0)
        )
        if cuda:
            # torch's current device: torch may leave CUDA's own setting elsewhere after a `with
            # torch.cuda.device(...)` block (See Note [One CUDA device a runtime]). A strata built
            # without CUDA sees no device, and "auto" stays the simulated one there.
            device = f"cuda:{torch.cuda.current_device()}"
        self._rt = _strata.Runtime(
            policy=policy,
            gpu_budget=parse_bytes(gpu_budget, "gpu_budget"),
            prefetch_depth=prefetch_depth,
            roles=roles,
            device=device,
            pinned_budget=parse_bytes(pinned_budget, "pinned_budget"),
            overlap=overlap,
            undo_on_gpu=bool(undo_on_gpu),
            hybrid_fraction=None if hybrid_fraction is None else float(hybrid_fraction),
        )
        roles_moved = {r.strip() for r in roles.split(",")}
        # Whether the policy streams gradients
        # (See Note [Clipping in the step] in strata/_overlap.py).
        self._streams_gradients = bool(roles_moved & {"all", "gradient"})
        # And parameters (See Note [When to step in backward] in strata/_when.py).
        self._streams_parameters = bool(roles_moved & {"all", "parameter"})
        self.prefetch_depth = prefetch_depth
        # Where the GPU budget came from: "argument", "none", or "auto" (strata.optim's gpu_budget
        # "auto"; See Note [The automatic budget] in strata/budget.py).
        self.budget_from = "none" if gpu_budget is None else "argument"
        # Where undo_on_gpu came from: "argument"; from strata.optim's own runtime "default" (from
        # the budget), "undecided", or "auto" once it has decided (See Note [The undo on the GPU
        # when there is room] in strata/budget.py).
        self.undo_from = "argument"
        # Where overlap came from: "argument", or strata.optim's choice for its own runtime
        # ("auto", or "auto: " and why not; See Note [Overlap by default] in strata/_overlap.py).
        self.overlap_from = "argument"
        self._names: set = set()
        self._bound: list = []  # bound tensors, in registration order
        self._layer_grads: list = []  # per layer, the bound gradients
        self._layer_params: list = []  # per layer, the bound parameters
        self._layer_of: dict = {}  # id(parameter as the user holds it) -> its layer
        self._layer_users: list = []  # per layer, the parameters as the user holds them
        # id(parameter) -> its gradient as bound, as the user's .grad held it (a DTensor under
        # FSDP2; See Note [Gradients the loop replaced])
        self._grad_obj: dict = {}
        # id(DTensor parameter) -> its gradient's version when zero_grad zeroed it in place
        self._zeroed: dict = {}
        # id(parameter) of those whose gradient is not bound
        # (See Note [Gradients given at each step] in optim/adam.h)
        self._given: set = set()
        # Called with a layer's index just before the runtime's after_backward of it (the
        # optimizer's check of that layer's gradients).
        self._before_layer_done = None
        self._hooks: list = []  # attach's module hooks
        self._param_hooks: list = []  # See Note [Gradients the loop replaced]
        self._closed = False

    # --- what it is ---
    @property
    def policy(self) -> str:
        return self._rt.policy()

    @property
    def overlap(self) -> str:
        """When the optimizer steps: "none" (after backward) or "backward" (each layer in it)."""
        return self._rt.overlap()

    @property
    def simulated(self) -> bool:
        """Whether host memory stands in for GPU memory (CPU tensors)."""
        return self._rt.simulated()

    @property
    def cuda_device(self) -> int:
        """The CUDA device's index the runtime runs on; -1 when the GPU is simulated."""
        return self._rt.cuda_device()

    @property
    def num_layers(self) -> int:
        return len(self._layer_grads)

    # --- binding ---
    def _check_open(self):
        if self._closed:
            raise RuntimeError("strata.Runtime: this runtime was closed")

    def _home(self, t: torch.Tensor) -> Optional[str]:
        if t.device.type == "cpu" and self.simulated:
            return "gpu"  # the simulated GPU tier is host memory that CPU tensors address
        if t.device.type == "cpu":
            raise ValueError(
                "strata: a CPU tensor cannot be bound to a runtime on a GPU; move the model to "
                "the GPU first, or make the runtime with device='simulated'"
            )
        return None

    def _unique(self, name: str) -> str:
        out, k = name, 1
        while out in self._names:
            out, k = f"{name}#{k}", k + 1
        self._names.add(out)
        return out

    def add_layer(self, named_params: Sequence) -> int:
        """Binds (name, parameter) pairs as one new layer, with their gradients (made zero where
        a parameter has none); returns the layer's index. Parameters already bound are skipped; a
        frozen parameter (requires_grad=False) is bound without a gradient, and so is any
        parameter when the policy does not move gradients: the optimizer then reads each step's
        gradient where autograd put it (See Note [Gradients given at each step] in optim/adam.h). A
        DTensor parameter (FSDP2) binds this rank's shard (See Note [Binding an FSDP2 shard] in
        strata/distributed.py)."""
        self._check_open()
        layer = len(self._layer_grads)
        grads, params, users = [], [], []
        for name, p in named_params:
            if self.is_bound(p):
                continue
            given = p.requires_grad and not is_dtensor(p) and not self._streams_gradients
            if given:
                self._given.add(id(p))
            if not p.requires_grad or given:
                param_t = whole_storage(local(p)) if is_dtensor(p) else p
                self._rt.register(
                    param_t, self._unique(name), layer, "parameter", self._home(param_t)
                )
                self._bound.append(param_t)
                self._layer_of[id(p)] = layer
                params.append(param_t)
                if given:
                    users.append(p)
                continue
            if is_dtensor(p):
                check_shardable(p, name)
                if p.is_cuda and not self.simulated:
                    _fsdp_copies.install()  # See Note [FSDP2's copies and the link]
                if p.grad is None or not is_dtensor(p.grad) or local(p.grad).data_ptr() == 0:
                    p.grad = make_grad(p)
                elif whole_storage(local(p.grad)).numel() != whole_storage(local(p)).numel():
                    p.grad = make_grad(p)
                param_t, grad_t = whole_storage(local(p)), whole_storage(local(p.grad))
            else:
                had_grad = p.grad is not None
                if not had_grad:
                    p.grad = torch.zeros_like(p)
                param_t, grad_t = p, p.grad
            self._rt.register(param_t, self._unique(name), layer, "parameter", self._home(param_t))
            self._bound.append(param_t)
            self._rt.register(
                grad_t, self._unique(name + ".grad"), layer, "gradient", self._home(param_t)
            )
            self._bound.append(grad_t)
            self._layer_of[id(p)] = layer
            self._grad_obj[id(p)] = p.grad
            if not is_dtensor(p):
                self._param_hooks.append(p.register_hook(self._grad_pre_hook(p)))
                if not had_grad:
                    p.grad = None  # as the loop left it; backward puts the bound one back
            grads.append(grad_t)
            params.append(param_t)
            users.append(p)
        self._layer_grads.append(grads)
        self._layer_params.append(params)
        self._layer_users.append(users)
        # Note [Blocks the bound tensors left]
        # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
        # Binding copies each tensor into strata's pool, and torch's caching allocator keeps the
        # block it left (the parameter's, and the zeroed gradient's made for it). Given back layer
        # by layer, the device never holds the model twice: binding a model whose parameters and
        # gradients fill half the GPU would otherwise need all of it, and torch would keep them
        # after.
        if any(t.is_cuda for t in params) and not self.simulated:
            torch.cuda.empty_cache()
        self._rt.set_layers(self._layer_params, self._layer_grads)
        return layer

    def bound_tensors(self, p: torch.Tensor) -> tuple:
        """(parameter, gradient) as strata bound them: `p` and its gradient, or for a DTensor the
        whole storages of its local shard and of its gradient's; the gradient is None for a frozen
        parameter."""
        g = self._grad_obj.get(id(p))
        if is_dtensor(p):
            return whole_storage(local(p)), None if g is None else whole_storage(local(g))
        return p, g

    # Note [Gradients the loop replaced]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # Where the policy streams gradients (roles="all") or FSDP2 shards them, strata binds each
    # trainable parameter's gradient once, and its kernels read that memory (elsewhere the gradient
    # stays torch's and the optimizer is told where it is at each step;
    # See Note [Gradients given at each step] in optim/adam.h). A training loop may drop it
    # (model.zero_grad() and torch's zero_grad() set .grad to None: Hugging Face's Trainer does
    # every step) or replace it (p.grad = ..., DDP's gradient_as_bucket_view, FSDP2's new sharded
    # gradients). So:
    #   - a hook on each parameter, run by autograd just before it accumulates the parameter's
    #     gradient, puts the bound gradient back, zeroed, where .grad is None: autograd then
    #     accumulates into strata's memory, and nothing is copied;
    #   - before a layer is stepped (step(), or in backward under overlap) a gradient that is
    #     another tensor is copied into the bound one, which becomes .grad again;
    #   - a parameter whose .grad is None then got no gradient this step: the optimizer skips it
    #     as torch does (See Note [Per-parameter steps] in optim/adam.h).
    # FSDP2 sets the sharded gradients itself, after its reduce-scatter, into the gradient that
    # is there (or a new one where there is none, which would cost a copy every step), so
    # strata.optim's zero_grad zeroes DTensor gradients in place and keeps their version: one
    # that no backward added to since counts as None.
    # The step never reads a stale value: it steps what autograd produced, or raises naming the
    # parameter.
    def _grad_pre_hook(self, p: torch.Tensor):
        def hook(grad):
            if p.grad is None and not self._closed:
                bound = self._grad_obj[id(p)]
                self._zero_bound(bound)
                p.grad = bound
            return None

        return hook

    def _zero_bound(self, t: torch.Tensor) -> None:
        if self._rt.is_accessible(local(t)):
            local(t).zero_()
        else:
            self._rt.zero([local(t)])

    def _take_gradient(self, p: torch.Tensor, name: str) -> bool:
        """Makes the gradient strata binds for `p` hold what p.grad holds
        (See Note [Gradients the loop replaced]); False when p has no gradient this step."""
        g = p.grad
        if id(p) in self._given:  # read where it is (See Note [Gradients given at each step])
            return g is not None
        bound = self._grad_obj[id(p)]
        if g is None:
            return False
        if g is bound:
            # A DTensor's gradient zeroed in place that no backward added to since: none.
            return self._zeroed.get(id(p)) != local(g)._version
        if local(g).untyped_storage().data_ptr() == local(bound).untyped_storage().data_ptr():
            return True  # a view of the bound gradient (the same memory)
        if not self._rt.is_accessible(local(bound)):
            raise RuntimeError(
                f"strata: parameter {name}'s gradient was replaced by another tensor after its "
                "layer's backward, and the gradient strata holds for it is in host memory now "
                "(roles='all' streams gradients); change gradients in place (p.grad.mul_(...)) "
                "or zero them with zero_grad()"
            )
        if tuple(local(g).shape) != tuple(local(bound).shape):
            raise RuntimeError(
                f"strata: parameter {name}'s gradient has shape {tuple(local(g).shape)}; the "
                f"parameter has {tuple(local(bound).shape)}"
            )
        with torch.no_grad():
            local(bound).copy_(local(g))
        p.grad = bound
        return True

    def is_bound(self, t: torch.Tensor) -> bool:
        return self._rt.is_bound(local(t))

    def is_accessible(self, t: torch.Tensor) -> bool:
        """Whether torch can use the bound tensor now (its data is where its device can address)."""
        return self._rt.is_accessible(local(t))

    def check_accessible(self, t: torch.Tensor) -> None:
        """Raises RuntimeError, saying where the data is, when torch cannot use the bound tensor
        now; the attach hooks check each layer's parameters so before its forward."""
        self._rt.check_accessible(local(t))

    def zero_(self, *tensors: torch.Tensor) -> None:
        """Zeroes bound tensors in place wherever their data is, once every move under way has
        completed (a move's destination would otherwise keep the values from before)."""
        self._rt.zero([local(t) for t in tensors])

    # --- a step (the attach hooks and strata.optim call these) ---
    def _before_forward(self, layer: int) -> None:
        self._rt.before_forward(layer)

    def _before_backward(self, layer: int) -> None:
        self._rt.before_backward(layer)

    def _after_backward(self, layer: int) -> None:
        if self._before_layer_done is not None:
            self._before_layer_done(layer)
        if self.simulated or self.overlap != "backward" or not torch.cuda.is_available():
            self._rt.after_backward(layer)
            return
        # The layer's gradients are final on torch's current stream (FSDP2's reduce-scatter
        # stream in its hooks): the runtime's hooks run there, and the step taken in backward on a
        # stream of its own that waits for it (See Note [The step stream] in
        # bridge/model_hooks.cpp); finish_backward joins them.
        self._rt.after_backward(layer, torch.cuda.current_stream().cuda_stream)

    # --- phase switches and waiting ---
    def offload_all(self, roles: Optional[str] = None, keep_cached: bool = False) -> None:
        """Moves every GPU-resident tensor of `roles` (default: all) to host memory and, unless
        keep_cached, gives the GPU memory it emptied back to the driver; no step until reload_all."""
        self._check_open()
        self._rt.offload_all(roles, keep_cached)

    def reload_all(self) -> None:
        """Brings back what offload_all moved."""
        self._check_open()
        self._rt.reload_all()

    @property
    def offloaded(self) -> bool:
        return self._rt.offloaded()

    def wait_all(self) -> None:
        self._rt.wait_all()

    # --- figures ---
    def memory_stats(self) -> dict:
        """A flat dict in torch.cuda.memory_stats()'s naming, one prefix per tier:
        "gpu.allocated_bytes.current", "pinned_host.reserved_bytes.peak", ..."""
        return self._rt.memory_stats()

    def memory_summary(self) -> str:
        """One table of the GPU's memory as torch, strata and the driver see it, then per layer and
        role where strata's bytes are (GPU, staged in the ring, pinned or pageable host), then the
        allocator's own per-tier statistics.

        Note [What the budget counts]
        ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
        gpu_budget bounds strata's GPU pools: whatever strata binds and keeps on the GPU (parameters
        and gradients it does not stream, layers resident for good, the staging ring, undo copies
        kept on the GPU). torch's own memory (activations, its cache) is torch's and is not
        counted. The undo copies are the exception that torch holds: they are taken from torch's
        caching allocator, so they count in the budget but show in torch's allocated bytes, not in
        strata's pool (See Note [The undo in the framework's memory] in runtime/undo_log.cpp)."""
        gib = 2**30
        lines = ["GPU memory (GiB)            current     peak"]
        if torch.cuda.is_available() and not self.simulated:
            dev = self.cuda_device
            free, total = torch.cuda.mem_get_info(dev)
            lines.append(f"  driver: used of {total / gib:.1f}   {(total - free) / gib:8.2f}")
            lines.append(
                f"  torch allocated          {torch.cuda.memory_allocated(dev) / gib:8.2f} "
                f"{torch.cuda.max_memory_allocated(dev) / gib:8.2f}"
            )
            lines.append(
                f"  torch reserved           {torch.cuda.memory_reserved(dev) / gib:8.2f} "
                f"{torch.cuda.max_memory_reserved(dev) / gib:8.2f}"
            )
        stats = self._rt.memory_stats()
        for what in ("allocated", "reserved"):
            cur = stats.get(f"gpu.{what}_bytes.current", 0) / gib
            peak = stats.get(f"gpu.{what}_bytes.peak", 0) / gib
            lines.append(f"  strata {what:<17} {cur:8.2f} {peak:8.2f}")
        lines.append("")
        lines.append("strata's tensors by layer and role or state (MiB): where their data is now")
        table: dict = {}
        for t in self._rt.tensors():
            where = "staged" if t["staged"] else t["tier"]
            row = table.setdefault((t["layer"], t["state"] or t["role"]), {})
            row[where] = row.get(where, 0) + t["bytes"]
        places = ["gpu", "staged", "pinned_host", "pageable_host"]
        lines.append(f"  {'layer':>5} {'role':<16}" + "".join(f"{p:>14}" for p in places))
        for (layer, role), row in sorted(table.items()):
            cells = "".join(f"{row.get(p, 0) / 2**20:14.1f}" for p in places)
            lines.append(f"  {layer:>5} {role:<16}{cells}")
        lines.append("")
        return "\n".join(lines) + self._rt.memory_summary()

    def leak_report(self) -> list:
        """What the allocator still holds: one dict (tier, bytes, owner) per live allocation."""
        return self._rt.leak_report()

    def stats(self) -> dict:
        """Bytes moved each way, link GB/s, prefetch hits, waits and stalls, GPU bytes reserved,
        the GPU budget: gpu_budget_bytes (None: none) and gpu_budget_from ("argument",
        "auto" or "none"), and where an overlapped step keeps its undo: undo_on_gpu and
        undo_on_gpu_from ("argument"; or, set by strata.optim, "default" (from the budget),
        "undecided" until it has measured, "auto")."""
        out = self._rt.stats()
        out["gpu_budget_bytes"] = self._rt.gpu_budget()
        out["gpu_budget_from"] = self.budget_from
        out["undo_on_gpu"] = self._rt.undo_on_gpu()
        out["undo_on_gpu_from"] = self.undo_from
        return out

    # --- the end ---
    def close(self) -> list:
        """Removes the hooks and unbinds every tensor, its values copied back into memory torch
        owns, so the model works as before; returns the leak report (empty unless something of
        strata's is still alive, e.g. an optimizer not closed)."""
        if self._closed:
            return []
        for h in self._hooks + self._param_hooks:
            h.remove()
        self._hooks.clear()
        self._param_hooks.clear()
        self._before_layer_done = None
        if self._rt.in_step():
            # A forward that no optimizer step followed (an evaluation) left layers held.
            self._rt.finish_backward()
            self._rt.end_step()
        self._rt.wait_all()
        for t in reversed(self._bound):
            if self._rt.is_bound(t):
                self._rt.unregister(t, True)
        self._bound.clear()
        self._closed = True
        return self._rt.leak_report()
