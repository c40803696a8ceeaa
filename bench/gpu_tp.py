"""The GPU check's tensor-parallel step (bench/gpu_check.py): a TP=2 group decodes what the whole
model decodes, and its KV moves to a TP=1 pool intact.

Two rank processes (torch.multiprocessing, spawn) join one group: over NCCL where there are two
GPUs (rank r on cuda:r, KV GPU to GPU); on one GPU, where NCCL refuses two ranks on one device,
over gloo with both ranks' CUDA tensors on cuda:0 (gloo stages them through host memory); in the
dry run over gloo on CPU. Each rank loads the check's checkpoint in fp32, keeps its shard
(`shard_model`) and steps its own Engine over the same prompts in lockstep, its runner summing o's
and down's outputs across the group. After the prompt pass each rank gathers its KV heads of each
prompt's blocks for the routes TP=2 -> TP=1 (`routes`, `kv_routes.gather`), rank 1 sends its
share to rank 0, which scatters both into a TP=1 pool. The parent compares rank 0's tokens with
HF `generate` on the whole model and the TP=1 pool with the KV a whole-model runner computed.
With one GPU, an NCCL group of one is also started (an all-reduce of a CUDA tensor).
"""

import datetime
import gc
import os
import random
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.gpu_parts import BLOCK, EngineRun, hf_greedy
from shared import model_store
from shared.cli.processes import free_port
from shared.engine.kv_cache import KVPool
from shared.parallel.heads import HeadSplit, routes
from shared.parallel.kv_routes import gather, scatter
from shared.parallel.shard import shard_model

TP, NEW, LENGTHS = 2, 12, (40, 150)  # 150: a prompt computed in two chunks of 128
TIMEOUT = datetime.timedelta(seconds=120)  # each collective's
DEADLINE_S = 300  # the whole group's


@dataclass(frozen=True)
class Plan:  # what every rank is given (pickled to each)
    backend: str
    devices: tuple[str, ...]
    path: str
    prompts: tuple[tuple[int, ...], ...]
    port: int
    out: str  # the folder each rank writes its results to
    threads: int


def positions(kv: torch.Tensor, blocks: list[int], n: int) -> torch.Tensor:
    """The KV of a sequence's first `n` positions in pool `kv`: [layers, 2, n, heads, head_dim]."""
    return kv[blocks].permute(1, 2, 0, 3, 4, 5).flatten(2, 3)[:, :, :n]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def _spawn(fn, nprocs: int, args: tuple, deadline_s: float) -> None:
    """Runs fn(i, *args) in `nprocs` spawned processes; a rank's exception is raised here (with
    its traceback), and a group still running after `deadline_s` is killed."""
    context = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + deadline_s
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            raise TimeoutError(f"the group was still running after {deadline_s} s")


# -- each rank ---------------------------------------------------------------------------------


def _rank(rank: int, plan: Plan) -> None:
    device = plan.devices[rank]
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    torch.set_num_threads(plan.threads)
    dist.init_process_group(
        plan.backend,
        init_method=f"tcp://127.0.0.1:{plan.port}",
        rank=rank,
        world_size=TP,
        timeout=TIMEOUT,
    )
    try:
        started = time.perf_counter()
        reduce, reduce_how = _reduce_for(device, plan.backend)
        model = model_store.load_model(Path(plan.path), device, "float32")
        split = shard_model(model, TP, rank)
        tokens = sum(len(p) + NEW for p in plan.prompts)
        run = EngineRun(model, device, tokens, cuda_graphs=False, reduce=reduce)
        result = {"load_s": time.perf_counter() - started, "reduce": reduce_how}
        result.update(_lockstep(run, split, plan, rank))
        result["kv_heads"] = run.runner.layout.num_kv_heads
        torch.save(result, Path(plan.out) / f"tp-rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _reduce_for(device: str, backend: str):
    """The runner's all-reduce, and how it runs: gloo's on CUDA tensors where it takes them,
    else staged through host memory here (both ranks find the same)."""
    if backend == "nccl" or not device.startswith("cuda"):
        return dist.all_reduce, f"{backend} all_reduce on {device.split(':')[0]} tensors"
    probe = torch.ones(4, device=device)
    try:
        dist.all_reduce(probe)
        return dist.all_reduce, "gloo all_reduce on CUDA tensors (gloo stages through host)"
    except RuntimeError as err:

        def staged(tensor: torch.Tensor) -> None:
            host = tensor.cpu()
            dist.all_reduce(host)
            tensor.copy_(host)

        return staged, f"staged through host here (gloo refused CUDA tensors: {err})"


def _lockstep(run: EngineRun, split: HeadSplit, plan: Plan, rank: int) -> dict:
    """Every rank steps the same sequences; after the prompt pass the KV moves TP=2 -> TP=1."""
    device = run.device
    seqs = [run.seq(list(p), NEW) for p in plan.prompts]
    for seq in seqs:
        run.engine.add(seq)
    _sync(device)
    started = time.perf_counter()
    while not all(s.output_ids for s in seqs):  # every prompt computed
        run.engine.step()
    _sync(device)
    prompt_s = time.perf_counter() - started
    blocks = [s.block_table[: -(-len(s.prompt_token_ids) // BLOCK)] for s in seqs]
    out = _transfer(run.runner.pool, blocks, split, plan, rank)
    started = time.perf_counter()
    while run.engine.has_work():
        run.engine.step()
    _sync(device)
    out.update(prompt_s=prompt_s, decode_s=time.perf_counter() - started)
    out["tokens"] = [s.output_ids for s in seqs]
    return out


def _transfer(pool: KVPool, blocks: list[list[int]], split: HeadSplit, plan: Plan, rank: int):
    """Each rank's heads of each prompt's blocks gathered for the routes TP=2 -> TP=1, rank 1's
    sent to rank 0, which scatters both into a TP=1 pool (other blocks, in another order)."""
    staged = plan.backend == "gloo" and pool.device.startswith("cuda")
    layout = replace(pool.layout, num_kv_heads=split.num_kv_heads)
    target = KVPool(layout, sum(map(len, blocks)), BLOCK, pool.device) if rank == 0 else None
    plan_routes = routes(split, HeadSplit(split.num_heads, split.num_kv_heads, 1))
    sent, dests = 0, []
    _sync(pool.device)
    started = time.perf_counter()
    for table in blocks:
        at = sum(map(len, dests))
        dests.append(list(range(at, at + len(table)))[::-1])
        for route in plan_routes:
            data = gather(pool.kv, table, route) if route.source == rank else None
            sent += 0 if data is None else data.numel() * data.element_size()
            data = _move(data, route, len(table), pool, staged)
            if data is not None:
                scatter(target.kv, dests[-1], route, data)
    _sync(pool.device)
    took = time.perf_counter() - started
    pairs = zip(dests, plan.prompts) if target is not None else []
    kv = [positions(target.kv, dest, len(prompt)).cpu() for dest, prompt in pairs]
    return {"kv": kv, "bytes": sent, "transfer_s": took}


def _move(data, route, blocks: int, pool: KVPool, staged: bool):
    """The route's buffer on its destination rank (its own, or received from its source);
    None elsewhere. Staged: a CUDA tensor goes through host memory (gloo)."""
    rank = dist.get_rank()
    if rank == route.source and route.source != route.dest:
        dist.send(data.cpu() if staged else data, dst=route.dest)
    if rank != route.dest or route.source == route.dest:
        return data if rank == route.dest else None
    _, layers, _, size, _, dim = pool.kv.shape
    shape = (blocks, layers, 2, size, route.heads, dim)
    buffer = torch.empty(shape, dtype=pool.kv.dtype, device="cpu" if staged else pool.device)
    dist.recv(buffer, src=route.source)
    return buffer.to(pool.device)


# -- the parent --------------------------------------------------------------------------------


def group_plan(path: Path, dry: bool, work: Path) -> Plan:
    gpus = 0 if dry else torch.cuda.device_count()
    if gpus >= TP:
        backend, devices = "nccl", tuple(f"cuda:{r}" for r in range(TP))
    else:
        backend, devices = "gloo", ("cpu",) * TP if dry else ("cuda:0",) * TP
    threads = max(1, (os.cpu_count() or 2) // TP)
    rng = random.Random(2)
    prompts = tuple(tuple(rng.randrange(3, 49152) for _ in range(n)) for n in LENGTHS)
    return Plan(backend, devices, str(path), prompts, free_port(), str(work), threads)


def reference(path: Path, device: str, prompts) -> tuple[list, list]:
    """The whole model's greedy tokens (HF `generate`) and each prompt's KV (a whole-model
    runner's prompt pass), in fp32 on one device."""
    model = model_store.load_model(path, device, "float32")
    want = [hf_greedy(model, list(p), NEW) for p in prompts]
    run = EngineRun(model, device, sum(len(p) + NEW for p in prompts), cuda_graphs=False)
    seqs = [run.seq(list(p), 1, prefill_only=True) for p in prompts]
    for seq in seqs:
        run.engine.add(seq)
    while not all(s.output_ids for s in seqs):
        run.engine.step()
    kv = [positions(run.runner.pool.kv, s.block_table, len(p)).cpu() for s, p in zip(seqs, prompts)]
    del run, model
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return want, kv


def compare(got: list[torch.Tensor], want: list[torch.Tensor]) -> dict:
    """The TP=1 pool's KV against the whole model's: equal within fp32's 1e-5 (relative to the
    largest value, where that is over 1)."""
    diff = max(float((g - w).abs().max()) for g, w in zip(got, want, strict=True))
    largest = max(float(w.abs().max()) for w in want)
    exact = all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    ok = diff <= 1e-5 * max(1.0, largest)
    return {"ok": ok, "exact": exact, "max_abs_diff": diff, "largest": largest}


def moved_how(plan: Plan) -> str:
    if plan.backend == "nccl":
        return "nccl send/recv, GPU to GPU"
    if plan.devices[0].startswith("cuda"):
        return "gloo send/recv, CUDA tensors staged through host memory"
    return "gloo send/recv, host memory"


def tp(path: Path, dry: bool, work: Path, report: dict) -> None:
    """The step: its figures in report["tp"] as they come (kept should a later part fail)."""
    plan = group_plan(path, dry, work)
    out = report["tp"] = {"backend": plan.backend, "devices": list(plan.devices)}
    out.update(prompts=list(LENGTHS), new_tokens=NEW, nccl_one=nccl_one(dry, work))
    started = time.perf_counter()
    want, want_kv = reference(path, plan.devices[0], plan.prompts)
    out["reference_s"] = time.perf_counter() - started
    started = time.perf_counter()
    _spawn(_rank, TP, (plan,), DEADLINE_S)
    out["group_s"] = time.perf_counter() - started
    ranks = [torch.load(work / f"tp-rank{r}.pt") for r in range(TP)]
    out["tokens_identical"] = all(r["tokens"] == want for r in ranks)
    out["identical"] = sum(a == b for a, b in zip(ranks[0]["tokens"], want, strict=True))
    out.update(reduce=ranks[0]["reduce"], kv_heads_per_rank=[r["kv_heads"] for r in ranks])
    out["kv"] = compare(ranks[0]["kv"], want_kv) | {
        "moved": moved_how(plan),
        "bytes_per_rank": [r["bytes"] for r in ranks],
        "whole_bytes": sum(-(-k.shape[2] // BLOCK) * BLOCK * k[:, :, 0].nbytes for k in want_kv),
        "transfer_s": ranks[0]["transfer_s"],
    }
    for name in ("load_s", "prompt_s", "decode_s"):
        out[name] = max(r[name] for r in ranks)  # the group's: its slowest rank's


def nccl_one(dry: bool, work: Path) -> dict:
    """An NCCL group of one on the one GPU (an all-reduce of a CUDA tensor) in a process of its
    own; where it does not apply, the reason."""
    if dry or not torch.cuda.is_available():
        return {"skipped": "no GPU"}
    if torch.cuda.device_count() >= TP:
        return {"skipped": f"{torch.cuda.device_count()} GPUs: the TP=2 group runs on NCCL"}
    result = work / "nccl-one.pt"
    started = time.perf_counter()
    try:
        _spawn(_nccl_rank, 1, (free_port(), str(result)), 120)
        return torch.load(result) | {"s": time.perf_counter() - started}
    except Exception as err:  # recorded, not raised: the TP=2 group is the step's point
        return {"ok": False, "error": f"{type(err).__name__}: {err}"[-2000:]}


def _nccl_rank(rank: int, port: int, result: str) -> None:
    torch.cuda.set_device(0)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, timeout=TIMEOUT
    )
    try:
        tensor = torch.full((1 << 20,), 2.0, device="cuda:0")
        dist.all_reduce(tensor)
        torch.cuda.synchronize()
        ok = bool((tensor == 2.0).all())
        version = ".".join(map(str, torch.cuda.nccl.version()))
        torch.save({"ok": ok, "nccl": version}, result)
    finally:
        dist.destroy_process_group()
