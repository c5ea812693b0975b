"""The GPT of examples/train_gpt.py under PyTorch FSDP2 (fully_shard per block, then the root),
launched by torchrun, its optimizer strata.optim.AdamW: each rank binds its own shards to its own
runtime, and the policy streams their Adam states through the GPU layer by layer (one layer per
fully_shard unit).

    # the CPU, gloo, the simulated device (a test-sized model)
    torchrun --nproc_per_node=2 examples/train_fsdp.py --steps 10 --reference --json out.json
    # one node's GPUs, NCCL, bf16 compute with fp32 master shards, side by side with the
    # resident reference and FSDP2's own CPUOffloadPolicy
    torchrun --nproc_per_node=8 examples/train_fsdp.py --device cuda --dtype bfloat16 \\
        --layers 24 --d_model 2048 --heads 16 --vocab 32000 --seq 512 --batch 8 \\
        --policy layer_prefetch --reference --cpu_offload_peer --json out.json
    # several nodes: the same on each, with torchrun --nnodes=N --node_rank=K \\
    #     --rdzv_backend=c10d --rdzv_endpoint=HOST:PORT
    # each unit stepped during its backward, the states' trips hidden behind backward's compute
    torchrun --nproc_per_node=1 examples/train_fsdp.py ... --overlap backward --undo_on_gpu

--save DIR / --load DIR write and read a sharded checkpoint with torch.distributed.checkpoint
(model and optimizer state dicts from torch.distributed.checkpoint.state_dict), so a run saved by N
ranks continues on M. The batch of step k is the same for any number of ranks (each rank takes its
rows of it), so runs on different rank counts train the same model. Rank 0 writes --json with every
run's losses, gradient norms, step times, and per-rank GPU and host memory.
"""

import argparse
import gc
import importlib.util
import json
import os
import pathlib
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

import strata

try:
    from tqdm import tqdm
except ImportError:
    tqdm = None


def load_gpt():
    path = pathlib.Path(__file__).resolve().parent / "train_gpt.py"
    spec = importlib.util.spec_from_file_location("train_gpt", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.Gpt


def rank_value(text, rank):
    """'8GiB' for every rank, or 'A,B,...' one per rank."""
    if text is None:
        return None
    parts = text.split(",")
    return parts[rank] if len(parts) > 1 else parts[0]


def host_bytes():
    """This process's resident set now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def batch(args, step, rank, world, device):
    """Step `step`'s rows of this rank: the global batch depends on the step alone."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
    rows = args.batch // world
    tokens = tokens[rank * rows : (rank + 1) * rows].to(device)
    return tokens[:, :-1], tokens[:, 1:]


def build(args, kind, device, mesh):
    torch.manual_seed(args.seed)
    Gpt = load_gpt()
    model = Gpt(args.vocab, args.d_model, args.heads, args.layers, args.seq).to(device)
    kw = {"mesh": mesh}  # fully_shard's default mesh is on the GPU whenever there is one
    if args.dtype != "float32":
        dtype = getattr(torch, args.dtype)
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    if kind == "peer":
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    for block in model.blocks:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    return model


def make_optimizer(args, kind, model, rank, device):
    opt_kw = dict(lr=args.lr, weight_decay=args.weight_decay)
    if kind == "strata":
        return strata.optim.AdamW(
            model.parameters(),
            policy=args.policy,
            gpu_budget=rank_value(args.gpu_budget, rank),
            prefetch_depth=args.prefetch_depth,
            overlap=args.overlap,
            max_grad_norm=args.max_grad_norm if clips_in_optimizer(args) else None,
            undo_on_gpu=True if args.undo_on_gpu else None,
            hybrid_fraction=args.hybrid_fraction,
            state_dtype=args.state_dtype,
            layer_bytes=args.layer_bytes,
            **opt_kw,
        )
    if kind == "peer":  # the CPU step FSDP2's offload users run: torch's fused CPU AdamW
        return torch.optim.AdamW(model.parameters(), fused=True, **opt_kw)
    if device.type == "cuda":
        return torch.optim.AdamW(model.parameters(), fused=True, **opt_kw)
    return torch.optim.AdamW(model.parameters(), foreach=False, **opt_kw)


def clips_in_optimizer(args) -> bool:
    """Whether strata's optimizer clips inside its step (stepping in backward needs it) rather
    than strata.distributed.clip_grad_norm_ before it."""
    return args.max_grad_norm > 0 and (args.overlap == "backward" or args.clip_in_optimizer)


def load_checkpoint(path, model, opt):
    state = {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, opt),
        "step": torch.zeros((), dtype=torch.int64),
    }
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    return int(state["step"])


def save_checkpoint(path, model, opt, step):
    state = {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, opt),
        "step": torch.tensor(step, dtype=torch.int64),
    }
    dcp.save(state, checkpoint_id=path)


def run(args, kind, rank, world, device, mesh):
    """Trains args.steps steps; returns this run's figures (rank 0 gathers every rank's)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    host_before = host_bytes()
    model = build(args, kind, device, mesh)
    opt = make_optimizer(args, kind, model, rank, device)
    start = load_checkpoint(args.load, model, opt) if args.load else 0
    losses, norms, times, backward_ms = [], [], [], []
    steps = range(start, start + args.steps)
    bar = tqdm(steps, desc=kind, disable=rank != 0) if tqdm else steps
    for step in bar:
        inputs, targets = batch(args, step, rank, world, device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        opt.zero_grad()
        logits = model(inputs)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()
        # When the host got back from backward (no wait for the GPU): a hook that waits on the
        # host holds backward's launches up, and shows here.
        backward_ms.append((time.perf_counter() - t0) * 1e3)
        if args.max_grad_norm > 0 and not (kind == "strata" and clips_in_optimizer(args)):
            if kind == "strata":
                norm = strata.distributed.clip_grad_norm_(opt, args.max_grad_norm)
            else:
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
            norms.append(norm)
        opt.step()
        if kind == "strata" and clips_in_optimizer(args):
            norms.append(opt.last_grad_norm)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
        if tqdm and rank == 0:
            bar.set_postfix(loss=f"{losses[-1]:.4f}", ms=f"{times[-1]:.0f}")
        elif rank == 0 and (step - start + 1) % max(1, args.steps // 10) == 0:
            print(f"{kind} step {step + 1} loss {losses[-1]:.5f} {times[-1]:.1f} ms", flush=True)
    if args.save:
        save_checkpoint(args.save, model, opt, start + args.steps)
    fields = {
        "host_bytes": host_bytes() - host_before,
        "gpu_peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0,
    }
    redone, runtime_stats = None, None
    if kind == "strata":
        redone = opt.steps_redone
        runtime_stats = opt.runtime.stats()
        runtime_stats["layers"] = opt.runtime.num_layers
        s = opt.runtime.memory_stats()
        fields["strata_gpu_peak_bytes"] = s.get("gpu.reserved_bytes.peak", 0)
        fields["strata_pinned_bytes"] = s.get("pinned_host.reserved_bytes.current", 0)
        fields["strata_pageable_bytes"] = s.get("pageable_host.reserved_bytes.current", 0)
        if device.type == "cuda":  # strata's GPU memory is outside torch's caching allocator
            fields["gpu_peak_bytes"] += fields["strata_gpu_peak_bytes"]
        leaks = opt.close()
        if leaks:
            raise RuntimeError(f"strata leaked: {leaks}")
    per_rank = gather(fields, times, world, device)
    del opt, model
    gc.collect()
    out = {"losses": losses, "grad_norms": [float(n) for n in norms], "ranks": per_rank}
    out["backward_host_ms"] = backward_ms  # rank 0's
    if redone is not None:  # steps taken in backward and redone after it (clipping triggered)
        out["steps_redone"] = redone
        out["runtime_stats"] = runtime_stats  # rank 0's strata.Runtime.stats() over the run
    warm = [t for r in per_rank for t in r["step_ms"][min(2, len(r["step_ms"]) - 1) :]]
    out["step_ms_median"] = sorted(warm)[len(warm) // 2] if warm else None
    return out


def gather(fields, times, world, device):
    """Every rank's figures (no pickling: all_gather_object needs numpy)."""
    mine = torch.tensor(list(fields.values()) + times, dtype=torch.float64, device=device)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    out = []
    for t in every:
        v = t.tolist()
        r = {k: int(x) for k, x in zip(fields, v)}
        r["step_ms"] = v[len(fields) :]
        out.append(r)
    return out


def compare(a, b):
    if len(a) != len(b):
        return float("inf")
    return max((abs(x - y) / max(abs(y), 1e-30) for x, y in zip(a, b)), default=0.0)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--policy", default="layer_prefetch")
    p.add_argument("--gpu_budget", default=None, help="per rank; 'A,B' gives each rank its own")
    p.add_argument("--prefetch_depth", type=int, default=1)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d_model", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=4, help="global batch, split over the ranks")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight_decay", type=float, default=0.01)
    p.add_argument("--max_grad_norm", type=float, default=1.0, help="0: no clipping")
    p.add_argument(
        "--overlap",
        default="auto",
        choices=["auto", "none", "backward"],
        help="strata: step each fully_shard unit during backward (backward: clipping inside the "
        "optimizer; auto, strata's default: on a GPU under layer_prefetch or hybrid, the loop "
        "clipping)",
    )
    p.add_argument(
        "--clip_in_optimizer",
        action="store_true",
        help="strata: clip inside the optimizer's step even without overlap (as overlap does)",
    )
    p.add_argument(
        "--undo_on_gpu",
        action="store_true",
        help="strata with overlap: keep the redo's copy of the float32 shards on the GPU (without "
        "it, strata decides after the first step from the GPU's free memory)",
    )
    p.add_argument(
        "--hybrid_fraction",
        type=float,
        default=None,
        help="strata with --policy=hybrid: the share of parameters stepped on the GPU (the rest on "
        "the host); default: the cost model's choice",
    )
    p.add_argument(
        "--state_dtype",
        default="float32",
        choices=["float32", "bfloat16", "int8"],
        help="strata: how the moments are stored (on every tier and on the link)",
    )
    p.add_argument(
        "--layer_bytes",
        default=None,
        help="strata: each fully_shard unit cut in layers of at most this many parameter bytes "
        "(default: one layer a unit, cut where it holds over a 32nd of the states)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reference", action="store_true", help="also FSDP2 + torch.optim.AdamW")
    p.add_argument("--cpu_offload_peer", action="store_true", help="also CPUOffloadPolicy")
    p.add_argument("--match_tol", type=float, default=1e-6, help="relative, vs the reference")
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="deterministic CUDA kernels (attention on the math backend), so that runs can match "
        "bitwise; the fast attention kernels' backward adds in a varying order",
    )
    p.add_argument("--save", default=None, help="a checkpoint folder written after training")
    p.add_argument("--load", default=None, help="a checkpoint folder to start from")
    p.add_argument("--json", default=None)
    args = p.parse_args()

    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        if use_cuda:
            torch.backends.cuda.enable_flash_sdp(False)
            torch.backends.cuda.enable_mem_efficient_sdp(False)
            torch.backends.cuda.enable_cudnn_sdp(False)
    # CPUOffloadPolicy's gradients are CPU DTensors, and clip_grad_norm_ reduces their norms across
    # ranks there: the peer needs a CPU backend beside NCCL, as its users set up.
    backend = "cpu:gloo,cuda:nccl" if use_cuda else "gloo"
    dist.init_process_group(backend, device_id=device if use_cuda else None)
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,))
    if args.batch % world:
        raise ValueError(f"--batch {args.batch} does not split over {world} ranks")

    report = {"world_size": world, "device": str(device.type), "policy": args.policy}
    report["gpu"] = torch.cuda.get_device_name(device) if use_cuda else None
    report["config"] = {k: v for k, v in vars(args).items() if k != "json"}
    report["strata"] = run(args, "strata", rank, world, device, mesh)
    if args.reference:
        report["reference"] = ref = run(args, "reference", rank, world, device, mesh)
        diff = compare(report["strata"]["losses"], ref["losses"])
        report["max_loss_diff_vs_reference"] = diff
        report["losses_match_reference"] = diff <= args.match_tol
        report["max_grad_norm_diff_vs_reference"] = compare(
            report["strata"]["grad_norms"], ref["grad_norms"]
        )
        if ref["step_ms_median"]:
            report["step_vs_reference"] = report["strata"]["step_ms_median"] / ref["step_ms_median"]
    if args.cpu_offload_peer:
        report["cpu_offload_peer"] = peer = run(args, "peer", rank, world, device, mesh)
        if peer["step_ms_median"]:
            report["peer_vs_strata"] = peer["step_ms_median"] / report["strata"]["step_ms_median"]
    if rank == 0:
        for k in ("strata", "reference", "cpu_offload_peer"):
            if k in report and report[k]["losses"]:
                r = report[k]
                gpu = max(x["gpu_peak_bytes"] for x in r["ranks"]) / 2**30
                print(
                    f"{k:>16}: {r['step_ms_median']:.1f} ms/step, peak GPU {gpu:.2f} GiB/rank, "
                    f"last loss {r['losses'][-1]:.5f}"
                )
        if "losses_match_reference" in report:
            print(
                f"losses match the reference: {report['losses_match_reference']} "
                f"(max relative difference {report['max_loss_diff_vs_reference']:.3g})"
            )
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps(report, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except Exception:
        # Every rank exits with the error instead of waiting in a collective for the failed one:
        # torchrun ends the others once one exits non-zero.
        rank = os.environ.get("RANK", "?")
        sys.stderr.write(f"rank {rank} failed:\n{traceback.format_exc()}")
        sys.stderr.flush()
        os._exit(1)
