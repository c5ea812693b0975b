"""A user's own training script, timed with strata and its peers (issue 37), on one GPU.

The script is what a PyTorch user writes, not strata-train: a plain model whose blocks sit in an
nn.ModuleList (LayerNorm, Linear(d, 4d), GELU, Linear(4d, d), a residual; 28 blocks of d=2048 are
0.94 B parameters), float32 parameters under bfloat16 autocast, clip_grad_norm_(1.0), AdamW, and
zero_grad() after every step. The approaches (--approaches, all by default):

  resident        torch.optim.AdamW(fused=True), every state on the GPU
  torchao         torchao's CPUOffloadOptimizer(params, torch.optim.AdamW, fused=True): fused CPU
                  AdamW, gradients copied to the host during backward (its default keeps the GPU
                  gradients too; its step does not see clip_grad_norm_, which acts on the GPU's)
  strata          strata.optim.AdamW(model.parameters()): the README's one line, defaults only
                  (on a GPU that steps in backward: See Note [Overlap by default])
  strata_seq      the same with overlap="none": every step after backward (the default before)
  strata_hostundo the same with undo_on_gpu=False: a step in backward keeps its undo in pinned
                  host memory (the default decides from the GPU's free memory)
  strata_auto     strata.optim.AdamW(model.parameters(), gpu_budget="auto"): after the first
                  step, the layers whose states fit what the GPU has free stay there
  strata_hybrid   strata.optim.AdamW(model.parameters(), policy="hybrid"): the cost model places
                  each block's step on the GPU (streamed) or the host, from rates measured at setup
  strata_tuned    strata.optim.AdamW(model.parameters(), model=model, overlap="backward",
                  max_grad_norm=1.0): the step inside backward, clipping in the optimizer;
                  the prefetch depth and undo_on_gpu strata's defaults
  strata_hybrid_tuned
                  strata_tuned with policy="hybrid": host steps during backward, the split
                  refined by the run's measured steps (give --warmup enough steps for its
                  search: about 4 a split tried)
  strata_int8, strata_bf16, strata_tuned_int8
                  strata and strata_tuned with state_dtype="int8" or "bfloat16": the moments
                  stored and streamed compressed (See Note [Compressed moments])
  NAME:dK         a strata approach with prefetch_depth=K given, e.g. strata_tuned_int8:d12
  NAME+undo       a strata_tuned approach with undo_on_gpu=True, e.g. strata_tuned_int8:d28+undo
  NAME+torchcopies
                  an fsdp2_strata approach with FSDP2's own copy kernels (STRATA_FSDP_COPIES=torch;
                  See Note [FSDP2's copies and the link] in strata/_fsdp_copies.py)
  NAME@SIZE       a strata approach with layer_bytes=SIZE given, e.g. fsdp2_strata@1GiB (one layer
                  a unit, none cut)
  torchao_8bit    torchao's AdamW8bit, every state on the GPU (its 8-bit moments are GPU
                  tensors; it does not offload)
  deepspeed       DeepSpeed ZeRO-Offload as its users configure it: ZeRO stage 2 with
                  offload_optimizer to pinned CPU memory (its CPU Adam), bf16 (bfloat16
                  parameters and gradients on the GPU, float32 masters and moments on the host),
                  gradient_clipping 1.0, overlap_comm; one rank. Needs deepspeed importable
                  (tools/gpu/run_users_script.sh installs it from .deps/wheels into DS_PKGS)
  fsdp2           FSDP2 on one GPU (fully_shard per block, bfloat16 MixedPrecisionPolicy),
                  torch.optim.AdamW(fused=True), every state on the GPU
  fsdp2_offload   the same with CPUOffloadPolicy(pin_memory=True): fused CPU AdamW
  fsdp2_strata    the same FSDP2 model with strata.optim.AdamW(model.parameters())
  fsdp2_strata_seq, fsdp2_strata_hostundo
                  the same with overlap="none", or with undo_on_gpu=False
  fsdp2_strata_tuned
                  the same with overlap="backward", max_grad_norm=1.0: each unit steps in its
                  backward, clipping in the optimizer
  fsdp2_strata_int8, fsdp2_strata_tuned_int8
                  fsdp2_strata and fsdp2_strata_tuned with state_dtype="int8"
  fsdp2_strata_hybrid, fsdp2_strata_hybrid_tuned
                  fsdp2_strata and fsdp2_strata_tuned with policy="hybrid"

Each run is a process of its own, so that its device peak is its own: cudaMemGetInfo polled every
5 ms by a thread (the driver's view, torch's and strata's included), beside torch's
max_memory_reserved. The driver runs the approaches in rounds, interleaved (A B C ... A B C ...),
and reports per approach the median step time over the rounds, min and max, the ratio to the
resident run of the same batch, and the device peak. A strata run's JSON also keeps what strata
decided: its INFO lines, each with the step it came at (`strata_log`).

    python3 bench/users_script.py --batches 8 32 --rounds 2 --json out.json
    python3 bench/users_script.py --one strata --batch 8            # one run, JSON on stdout
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import statistics
import subprocess
import sys
import threading
import time

APPROACHES = [
    "resident",
    "torchao",
    "strata",
    "strata_seq",
    "strata_hostundo",
    "strata_auto",
    "strata_hybrid",
    "strata_tuned",
    "strata_hybrid_tuned",
    "strata_int8",
    "strata_bf16",
    "strata_tuned_int8",
    "torchao_8bit",
    "deepspeed",
    "fsdp2",
    "fsdp2_offload",
    "fsdp2_strata",
    "fsdp2_strata_seq",
    "fsdp2_strata_hostundo",
    "fsdp2_strata_tuned",
    "fsdp2_strata_int8",
    "fsdp2_strata_tuned_int8",
    "fsdp2_strata_hybrid",
    "fsdp2_strata_hybrid_tuned",
]


def build_model(args, torch):
    class Block(torch.nn.Module):
        def __init__(self, d):
            super().__init__()
            self.norm = torch.nn.LayerNorm(d)
            self.up = torch.nn.Linear(d, 4 * d)
            self.down = torch.nn.Linear(4 * d, d)

        def forward(self, x):
            return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))

    class Model(torch.nn.Module):
        def __init__(self, d, n):
            super().__init__()
            self.blocks = torch.nn.ModuleList(Block(d) for _ in range(n))
            self.head = torch.nn.Linear(d, d)

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return self.head(x)

    torch.manual_seed(0)
    with torch.device("cuda"):
        return Model(args.d_model, args.blocks)


class Poller:
    """The device's used memory as the driver sees it, polled every 5 ms."""

    def __init__(self, torch):
        self.torch = torch
        self.peak = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def used(self):
        free, total = self.torch.cuda.mem_get_info()
        return total - free

    def run(self):
        while not self.stop.is_set():
            self.peak = max(self.peak, self.used())
            time.sleep(0.005)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        self.peak = max(self.peak, self.used())


# strata's byte and copy counters (Runtime.stats()) and its pools' segments taken from and given
# back to CUDA (memory_stats(): a pool that still grows in the timed steps pays cudaMalloc or
# cudaHostRegister inside them), or {} for a peer.
class StrataLog(logging.Handler):
    """strata's INFO lines of one run (what it decided, and when), each with the number of steps
    the loop had begun when it came: `strata_log` in the run's JSON."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.steps = 0
        self.lines: list = []
        logger = logging.getLogger("strata")
        logger.setLevel(logging.INFO)
        logger.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append([self.steps, record.levelname, record.getMessage()])


def strata_counters(opt) -> dict:
    runtime = getattr(opt, "runtime", None)
    if runtime is None or not hasattr(runtime, "stats"):
        return {}
    keys = (
        "migrated_bytes_h2d",
        "migrated_bytes_d2h",
        "undo_copied_bytes",
        "timed_bytes_h2d",
        "timed_bytes_d2h",
    )
    stats = runtime.stats()
    out = {k: stats[k] for k in keys if k in stats}
    memory = runtime.memory_stats()
    for tier in ("gpu", "pinned_host"):
        for k in ("num_segment_allocs", "num_segment_frees"):
            if f"{tier}.{k}" in memory:
                out[f"{tier}.{k}"] = memory[f"{tier}.{k}"]
    return out


def one_run(args):
    import torch

    torch.cuda.init()
    base = torch.cuda.mem_get_info()
    base_used = base[1] - base[0]
    fsdp = args.one.startswith("fsdp2")
    if args.one == "deepspeed":
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    if fsdp:
        import torch.distributed as dist

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        dist.init_process_group("nccl", rank=0, world_size=1)
    log = StrataLog()
    with Poller(torch) as poll:
        model = build_model(args, torch)
        clip_in_loop = True
        autocast = not fsdp and args.one != "deepspeed"
        engine = None
        sized = {"layer_bytes": args.layer_bytes} if args.layer_bytes else {}
        if fsdp:
            from torch.distributed.fsdp import (
                CPUOffloadPolicy,
                MixedPrecisionPolicy,
                fully_shard,
            )

            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            kw = {"mp_policy": mp}
            if args.one == "fsdp2_offload":
                kw["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
            for b in model.blocks:
                fully_shard(b, **kw)
            fully_shard(model, **kw)
        if args.one in ("resident", "fsdp2", "fsdp2_offload"):
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        elif args.one == "torchao":
            from torchao.optim import CPUOffloadOptimizer

            opt = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-4, fused=True)
        elif args.one in (
            "strata",
            "strata_seq",
            "strata_hostundo",
            "fsdp2_strata",
            "fsdp2_strata_seq",
            "fsdp2_strata_hostundo",
            "fsdp2_strata_int8",
            "fsdp2_strata_hybrid",
        ):
            import strata

            kw = {"state_dtype": "int8"} if args.one.endswith("_int8") else {}
            kw.update({"policy": "hybrid"} if "hybrid" in args.one else {})
            kw.update({"overlap": "none"} if args.one.endswith("_seq") else {})
            kw.update({"undo_on_gpu": False} if args.one.endswith("_hostundo") else {})
            kw.update({"prefetch_depth": args.tuned_depth} if args.depth_given else {})
            opt = strata.optim.AdamW(model.parameters(), lr=1e-4, **kw, **sized)
        elif args.one in (
            "fsdp2_strata_tuned",
            "fsdp2_strata_tuned_int8",
            "fsdp2_strata_hybrid_tuned",
        ):
            import strata

            kw = {"state_dtype": "int8"} if args.one.endswith("_int8") else {}
            kw.update({"policy": "hybrid"} if "hybrid" in args.one else {})
            opt = strata.optim.AdamW(
                model.parameters(), lr=1e-4, overlap="backward", max_grad_norm=1.0, **kw, **sized
            )
            clip_in_loop = False
        elif args.one == "strata_auto":
            import strata

            opt = strata.optim.AdamW(model.parameters(), lr=1e-4, gpu_budget="auto", **sized)
        elif args.one == "strata_hybrid":
            import strata

            opt = strata.optim.AdamW(model.parameters(), lr=1e-4, policy="hybrid", **sized)
        elif args.one in ("strata_int8", "strata_bf16"):
            import strata

            moments = "int8" if args.one == "strata_int8" else "bfloat16"
            depth = {"prefetch_depth": args.tuned_depth} if args.depth_given else {}
            opt = strata.optim.AdamW(
                model.parameters(), lr=1e-4, state_dtype=moments, **depth, **sized
            )
        elif args.one == "torchao_8bit":
            try:
                from torchao.optim import AdamW8bit
            except ImportError:
                from torchao.prototype.low_bit_optim import AdamW8bit

            opt = AdamW8bit(model.parameters(), lr=1e-4)
        elif args.one == "deepspeed":
            import deepspeed

            config = {
                "train_micro_batch_size_per_gpu": args.batch,
                "gradient_accumulation_steps": 1,
                "gradient_clipping": 1.0,
                "bf16": {"enabled": True},
                "zero_optimization": {
                    "stage": 2,
                    "offload_optimizer": {"device": "cpu", "pin_memory": True},
                    "overlap_comm": True,
                    "contiguous_gradients": True,
                },
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
            }
            engine, opt, _, _ = deepspeed.initialize(
                model=model, model_parameters=model.parameters(), config=config
            )
            clip_in_loop = False
        elif args.one in ("strata_tuned", "strata_tuned_int8", "strata_hybrid_tuned"):
            import strata

            depth = {"prefetch_depth": args.tuned_depth} if args.depth_given else {}
            opt = strata.optim.AdamW(
                model.parameters(),
                lr=1e-4,
                model=model,
                policy="hybrid" if args.one == "strata_hybrid_tuned" else "layer_prefetch",
                **depth,
                overlap="backward",
                max_grad_norm=1.0,
                state_dtype="int8" if args.one == "strata_tuned_int8" else "float32",
                undo_on_gpu=True if args.undo_on_gpu else None,
                **sized,
            )
            clip_in_loop = False
        else:
            raise SystemExit(f"unknown approach {args.one}")
        g = torch.Generator(device="cuda").manual_seed(1)
        x = torch.randn(args.batch, args.seq, args.d_model, device="cuda", generator=g)
        y = torch.randn(args.batch, args.seq, args.d_model, device="cuda", generator=g)

        memory_trace = []

        def trace_memory():
            row = [torch.cuda.memory_reserved() / 2**30]
            runtime = getattr(opt, "runtime", None)
            if hasattr(runtime, "memory_stats"):
                m = runtime.memory_stats()
                row += [m["gpu.reserved_bytes.current"] / 2**30]
                row += [m["pinned_host.reserved_bytes.current"] / 2**30]
                row += [m["pinned_host.segments.current"]]
            memory_trace.append(row)

        def step():
            log.steps += 1
            if args.memory_trace:
                trace_memory()
            if engine is not None:  # DeepSpeed's loop: the engine backward()s and step()s
                loss = torch.nn.functional.mse_loss(engine(x.bfloat16()).float(), y)
                engine.backward(loss)
                engine.step()
                return loss.detach().clone()  # See the note in the return below
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                out = model(x)
            loss = torch.nn.functional.mse_loss(out.float(), y)
            loss.backward()
            if clip_in_loop:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            # A copy: mse_loss's mean shares the storage of its elementwise buffer (batch x seq x
            # d_model floats, 128 MiB at batch 32), and keeping the loss itself kept that buffer
            # for every step of the run, in every approach alike.
            return loss.detach().clone()

        t_first = time.perf_counter()
        losses = [step()]
        torch.cuda.synchronize()
        first_ms = (time.perf_counter() - t_first) * 1e3
        for _ in range(args.warmup - 1):
            losses.append(step())
        torch.cuda.synchronize()
        # Each timed step's time between events on the current stream (recorded as the loop
        # reaches them, no host wait), to tell a slow run from one slow step.
        # strata's counters over the timed steps, and what each step was (in backward, after it,
        # redone: See Note [When to step in backward]).
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(args.steps + 1)]
        counters = strata_counters(opt)
        outcomes = []
        t0 = time.perf_counter()
        for k in range(args.steps):
            marks[k].record()
            losses.append(step())
            outcomes.append(getattr(opt, "last_step_outcome", None))
        marks[-1].record()
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1e3 / args.steps
        step_ms = [a.elapsed_time(b) for a, b in itertools.pairwise(marks)]
        counters = {k: (v - counters[k]) / args.steps for k, v in strata_counters(opt).items()}
        if args.profile:  # a few more steps under torch.profiler, after the timed ones
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
            with profile(activities=acts, with_stack=args.profile_stack) as prof:
                for _ in range(3):
                    step()
                torch.cuda.synchronize()
            table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=30)
            runtime = getattr(opt, "runtime", None)
            depth = f"-d{runtime.prefetch_depth}" if hasattr(runtime, "prefetch_depth") else ""
            stack = "-stack" if args.profile_stack else ""
            name = f"profile-{args.one}{depth}-b{args.batch}{stack}.txt"
            with open(os.path.join(args.profile, name), "w") as f:
                f.write(f"3 steps of {args.one}, batch {args.batch}\n{table}\n")
            # The streams' timeline, for chrome://tracing or Perfetto.
            trace = os.path.join(args.profile, name[: -len(".txt")] + ".json")
            prof.export_chrome_trace(trace)
            subprocess.run(["gzip", "-f", trace], check=False)
    out = {
        "approach": args.one,
        "batch": args.batch,
        "ms_per_step": ms,
        "step_ms": step_ms,
        "step_outcomes": outcomes,
        # Before each step: torch's reserved GiB, then strata's GPU and pinned reserved GiB and
        # pinned segments (--memory_trace).
        "memory_trace": memory_trace,
        "strata_per_step": counters,
        "first_step_ms": first_ms,
        "device_peak_gib": poll.peak / 2**30,
        "device_base_gib": base_used / 2**30,
        "torch_max_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
        "losses": [float(v) for v in losses],
        "gpu": torch.cuda.get_device_name(),
        "params": sum(p.numel() for p in model.parameters()),
    }
    if "strata" in args.one:
        stats = opt.runtime.memory_stats()
        out["strata_gpu_reserved_peak_gib"] = stats.get("gpu.reserved_bytes.peak", 0) / 2**30
        rt_stats = opt.runtime.stats()
        budget = rt_stats["gpu_budget_bytes"]
        out["strata_gpu_budget_gib"] = None if budget is None else budget / 2**30
        out["strata_undo_on_gpu"] = [rt_stats["undo_on_gpu"], rt_stats["undo_on_gpu_from"]]
        out["strata_steps_redone"] = getattr(opt, "steps_redone", None)
        out["strata_backward_share"] = getattr(opt, "backward_share", None)
        out["strata_layers"] = opt.runtime.num_layers
        out["prefetch_depth"] = opt.runtime.prefetch_depth
        # The hybrid's split and prediction, host threads, moments and measured rates.
        out["strata_placement"] = opt.placement
        opt.close()
        out["strata_log"] = log.lines
    print("RESULT " + json.dumps(out), flush=True)
    if fsdp or engine is not None:
        torch.distributed.destroy_process_group()


def driver(args):
    results = []
    for r in range(args.rounds):
        for batch in args.batches:
            for approach in args.approaches:
                cmd = [sys.executable, __file__, "--one", approach, "--batch", str(batch)]
                cmd += ["--d_model", str(args.d_model), "--blocks", str(args.blocks)]
                cmd += ["--seq", str(args.seq), "--steps", str(args.steps)]
                cmd += ["--warmup", str(args.warmup)]
                t0 = time.time()
                env = dict(os.environ)
                if approach == "deepspeed" and os.environ.get("DS_PKGS"):
                    env["PYTHONPATH"] = os.environ["DS_PKGS"] + ":" + env.get("PYTHONPATH", "")
                    env["PATH"] = os.environ["DS_PKGS"] + "/bin:" + env.get("PATH", "")
                try:
                    p = subprocess.run(
                        cmd,
                        capture_output=True,
                        text=True,
                        timeout=args.timeout,
                        env=env,
                        check=False,
                    )
                except subprocess.TimeoutExpired:
                    print(f"round {r} b{batch} {approach}: TIMED OUT", flush=True)
                    results.append({"approach": approach, "batch": batch, "error": ["timeout"]})
                    continue
                line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
                if p.returncode != 0 or not line:
                    err = (p.stderr or p.stdout).strip().splitlines()[-3:]
                    print(f"round {r} b{batch} {approach}: FAILED ({' | '.join(err)})", flush=True)
                    results.append({"approach": approach, "batch": batch, "error": err})
                    continue
                res = json.loads(line[-1][len("RESULT ") :])
                res["approach"] = approach  # with its :dK, if any
                res["round"] = r
                results.append(res)
                print(
                    f"round {r} b{batch} {approach:<14} {res['ms_per_step']:8.1f} ms  "
                    f"(steps {min(res['step_ms']):.1f}-{max(res['step_ms']):.1f})  "
                    f"peak {res['device_peak_gib']:6.2f} GiB  ({time.time() - t0:.0f} s)",
                    flush=True,
                )
    table = summarize(results, args)
    print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "table": table, "args": vars(args)}, f, indent=1)


def summarize(results, args):
    lines = [
        (
            f"{'approach':<14} {'batch':>5} {'median ms':>10} {'min':>8} {'max':>8} "
            f"{'x resident':>10} {'peak GiB':>9}"
        )
    ]
    for batch in args.batches:
        ok = [r for r in results if r.get("batch") == batch and "error" not in r]
        ref = {
            a: statistics.median([r["ms_per_step"] for r in ok if r["approach"] == a] or [0])
            for a in ("resident", "fsdp2")
        }
        for approach in args.approaches:
            runs = [r for r in ok if r["approach"] == approach]
            if not runs:
                lines.append(f"{approach:<14} {batch:>5}   failed")
                continue
            ms = [r["ms_per_step"] for r in runs]
            base = ref["fsdp2" if approach.startswith("fsdp2") else "resident"]
            peak = max(r["device_peak_gib"] for r in runs)
            ratio = statistics.median(ms) / base if base else float("nan")
            lines.append(
                f"{approach:<14} {batch:>5} {statistics.median(ms):10.1f} {min(ms):8.1f} "
                f"{max(ms):8.1f} {ratio:10.2f} {peak:9.2f}"
            )
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--one", default=None, help="run one approach in this process")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--approaches", nargs="+", default=APPROACHES)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--d_model", type=int, default=2048)
    ap.add_argument("--blocks", type=int, default=28)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--timeout", type=int, default=240)
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--profile", default=None, help="--one: write 3 more steps' torch.profiler table here"
    )
    ap.add_argument(
        "--profile_stack",
        action="store_true",
        help="--profile with Python's stack: the trace names the Python function of each host "
        "call (slows the host)",
    )
    ap.add_argument(
        "--memory_trace",
        action="store_true",
        help="--one: before every step, torch's reserved GPU bytes and strata's GPU and pinned "
        "pools' reserved bytes and segments, in the JSON's memory_trace (a pool that keeps "
        "growing shows there)",
    )
    args = ap.parse_args()
    if args.profile_stack and not args.profile:
        raise SystemExit("--profile_stack profiles with Python's stack: give --profile DIR too")
    if args.one:
        args.one, _, args.layer_bytes = args.one.partition("@")
        if args.layer_bytes and "strata" not in args.one:
            raise SystemExit(
                f"--one {args.one}@{args.layer_bytes}: only strata's approaches take @SIZE"
            )
        args.one, _, extra = args.one.partition("+")
        if extra not in ("", "undo", "torchcopies"):
            raise SystemExit(f"--one ...+{extra}: the suffixes are +undo and +torchcopies")
        if extra == "torchcopies" and not args.one.startswith("fsdp2_strata"):
            raise SystemExit(f"--one {args.one}: only fsdp2_strata approaches take +torchcopies")
        if extra == "torchcopies":  # before strata is imported
            os.environ["STRATA_FSDP_COPIES"] = "torch"
        args.undo_on_gpu = extra == "undo"
        if args.undo_on_gpu and not args.one.startswith("strata_tuned"):
            raise SystemExit(f"--one {args.one}: only strata_tuned approaches take +undo")
        args.one, _, depth = args.one.partition(":d")
        args.tuned_depth = int(depth) if depth else 3
        args.depth_given = bool(depth)
        if depth and "strata" not in args.one:
            raise SystemExit(f"--one {args.one}:d{depth}: only strata's approaches take :dK")
        one_run(args)
    else:
        driver(args)


if __name__ == "__main__":
    main()
