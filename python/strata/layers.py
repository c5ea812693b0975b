"""Where strata's layers come from when the user names none: the unit a policy streams.

    layers = discover_layers(model, prefetch_depth=3)      # [(name, module)], the blocks
    plan = plan_layers(params, model=model)                  # [[(name, param)]], one list a layer

Note [Layers without being told]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A layer must be small beside the whole (the staging ring holds prefetch_depth + 1 of them on the
GPU, one more under overlap, so one layer of the whole model keeps every moment on the GPU, and
more) and should follow the model's blocks (a block's parameters are used, and their gradients are
final, together).
strata.optim.AdamW(model.parameters()) finds them, in this order:
  1. FSDP2: one layer per fully_shard unit (strata/distributed.py);
  2. a module given (model=): the blocks of its module tree (discover_layers);
  3. named parameters (model.named_parameters(), as torch.optim takes them): the names' block
     prefixes, up to the first index (model.layers.3.mlp.up.weight is in model.layers.3);
  4. parameters alone: runs of consecutive parameters.
Then no layer holds more than a size taken from the whole and the budget (state_chunk_bytes: a
32nd of the states, so that the ring of four slots holds at most an eighth of them): a unit or a
block past it is cut into runs of its parameters in order (split_runs), never merged with the next
(its gradients are final together, the next one's later). A parameter past it is a layer alone.
A layer holding more than a quarter of the states is warned about: its ring slot keeps that much
of the moments on the GPU.
"""

from __future__ import annotations

import re

import torch

_INDEX = re.compile(r"^\d+$")


def _count(module: torch.nn.Module, counted: set) -> int:
    return sum(p.numel() for p in module.parameters() if id(p) not in counted)


def discover_layers(model: torch.nn.Module, prefetch_depth: int = 1) -> list:
    """(name, module) pairs that make good strata layers, in the model's order.

    Note [Finding the blocks]
    ~~~~~~~~~~~~~~~~~~~~~~~~~
    From the model down, a ModuleList or ModuleDict is always opened (its entries are the blocks,
    wherever it sits: model.layers, model.model.layers, transformer.h), and so is any other child
    with children of its own that holds more than 1 / (prefetch_depth + 1) of the parameters (a
    wrapper such as Hugging Face's LlamaModel inside LlamaForCausalLM). Everything else with
    parameters is a layer of its own: each block, the embeddings, the final norm, the head. A
    parameter shared by two modules (tied embeddings) belongs to the first. Parameters held directly
    by an opened module are left out here.
    """
    total = max(_count(model, set()), 1)
    threshold = total / (prefetch_depth + 1)
    counted: set = set()
    out = []

    def walk(module: torch.nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            full = f"{prefix}.{name}" if prefix else name
            n = _count(child, counted)
            if n == 0:
                continue
            has_children = any(True for _ in child.children())
            container = isinstance(child, (torch.nn.ModuleList, torch.nn.ModuleDict))
            if has_children and (container or n > threshold):
                walk(child, full)
                continue
            out.append((full, child))
            counted.update(id(p) for p in child.parameters())

    walk(model, "")
    return out


def block_of(name: str) -> str:
    """The block a parameter's name belongs to: its prefix up to the first index
    ("model.layers.3.mlp.up.weight" -> "model.layers.3"), else its module ("lm_head.weight" ->
    "lm_head")."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if _INDEX.match(part):
            return ".".join(parts[: i + 1])
    return ".".join(parts[:-1]) or name


def state_bytes(
    p: torch.Tensor, amsgrad: bool = False, state_dtype: str = "float32", moments: int = 2
) -> int:
    """Bytes of an optimizer's states for `p`: `moments` of them (Adam's 2, one more with amsgrad;
    Lion's 1) stored as state_dtype says (float32, bfloat16, or int8 with a float32 scale per
    block of 256: See Note [Compressed moments] in optim/state_codec.h), and a float32 master for
    a bfloat16 or float16 parameter."""
    n = p.numel()
    moment = {"float32": 4 * n, "bfloat16": 2 * n, "int8": (n + 255) // 256 * 260}[state_dtype]
    master = 0 if p.dtype == torch.float32 else 4 * n
    return (moments + (1 if amsgrad else 0)) * moment + master


def state_chunk_bytes(total: int, budget: int | None, prefetch_depth: int) -> int:
    """The most bytes of states a layer should hold: a 32nd of the whole (the ring then keeps at
    most an eighth of the states at depth 3), at least 16 MiB (the link's pieces stay large), and
    at most half the budget over the ring's slots."""
    chunk = max(total // 32, 16 << 20)
    if budget is not None:
        chunk = min(chunk, max(budget // (2 * (prefetch_depth + 1)), 1))
    return chunk


def split_runs(pairs: list, limit: int, size_of) -> list:
    """(name, parameter) pairs cut, in order, into runs whose size_of(parameter) adds up to at
    most `limit`; a parameter larger than `limit` is a run alone."""
    runs, size = [], 0
    for pair in pairs:
        n = size_of(pair[1])
        if not runs or (size and size + n > limit):
            runs.append([])
            size = 0
        runs[-1].append(pair)
        size += n
    return runs


def plan_layers(
    named: list,
    has_names: bool,
    model: torch.nn.Module | None = None,
    budget: int | None = None,
    prefetch_depth: int = 3,
    amsgrad: bool = False,
    state_dtype: str = "float32",
    moments: int = 2,
    chunk: int | None = None,
) -> tuple:
    """Groups (name, parameter) pairs into layers (See Note [Layers without being told], steps 2-4;
    FSDP2 units are the caller's); has_names: the names are the user's (step 3 applies); chunk:
    the most bytes of states a layer holds (None: state_chunk_bytes of these parameters'). Returns
    (layers, how): layers a list of lists of pairs in the parameters' order, how a few words
    saying where they came from."""
    if not named:
        return [], "no parameters"

    def size_of(p):
        return state_bytes(p, amsgrad, state_dtype, moments)

    if chunk is None:
        total = sum(size_of(p) for _, p in named)
        chunk = state_chunk_bytes(total, budget, prefetch_depth)
    key = {}
    if model is not None:
        for i, (_, module) in enumerate(discover_layers(model, prefetch_depth)):
            for p in module.parameters():
                key.setdefault(id(p), f"module {i}")
        how = "the module tree"
        for name, p in named:
            key.setdefault(id(p), "the rest")
    elif has_names:
        how = "the parameters' names"
        for name, p in named:
            key[id(p)] = block_of(name)
    else:
        how = f"runs of parameters with at most {chunk / 2**20:.0f} MiB of states each"
        for name, p in named:
            key[id(p)] = "all"  # one run, cut below
    blocks, index = [], {}
    for name, p in named:
        k = key[id(p)]
        if k not in index:
            index[k] = len(blocks)
            blocks.append([])
        blocks[index[k]].append((name, p))
    layers = [run for block in blocks for run in split_runs(block, chunk, size_of)]
    flat = model is None and not has_names
    if len(layers) > len(blocks) and not flat:
        how += f", blocks past {chunk / 2**20:.0f} MiB of states cut in runs of parameters"
    return layers, how
