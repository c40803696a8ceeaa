"""Two gloo ranks on this host for a test: `run_ranks(work, *args)` spawns them, each joins the
group (a timeout on every collective), runs `work(rank, results, *args)` and leaves; returns what
they put in `results`. `work` must be a module-level function (the ranks import it by name)."""

import datetime
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

RANKS = 2
TIMEOUT = datetime.timedelta(seconds=60)


def _rank(rank: int, port: int, work, args: tuple, results) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=RANKS,
        timeout=TIMEOUT,
    )
    torch.set_num_threads(1)
    try:
        work(rank, results, *args)
    finally:
        dist.destroy_process_group()


def run_ranks(work, *args) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank, args=(port, work, args, results), nprocs=RANKS, join=True)
        return dict(results)
