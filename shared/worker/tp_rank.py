"""One rank of a tensor-parallel worker: what it is given (RankSpec, alike for every rank of a
group), how it joins the group's collectives and loads its shard over the KV pool rank 0 made for
it. Rank 0 is the worker's own process (shared.worker.tp_group); `python -m shared.worker.tp_rank`
is each of the others: it runs what rank 0 sends until told to stop, and exits when rank 0 goes
away (the end of its command link, or the kernel's parent-death signal) or a collective fails."""

import argparse
import dataclasses
import datetime
import json
import logging
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from shared import model_store
from shared.dataplane.helper import die_with_parent
from shared.engine.model_runner import ModelRunner
from shared.engine.shared_region import SharedRegion
from shared.parallel.commands import CommandReader, GroupGone
from shared.parallel.group import follow
from shared.parallel.shard import shard_model
from shared.worker.placement import format_cpus, pin

log = logging.getLogger("tandem.tp_rank")


@dataclass(frozen=True)
class RankSpec:
    """What every rank of one group builds alike (JSON on a follower's command line)."""

    model_dir: str
    model_name: str
    device: str
    dtype: str  # "float32", "bfloat16", ...
    weights: str
    block_size: int
    num_blocks: int
    chunk: int
    batch_invariant: bool
    use_kernels: bool
    row_timing: str
    tp: int
    port: int  # the gloo group's rendezvous on 127.0.0.1
    collective_timeout_s: float
    start_timeout_s: float
    cores: list[list[int]]  # each rank's cores ([] each: not placed)
    threads: list[int]  # each rank's torch threads

    def encode(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def decode(cls, text: str) -> "RankSpec":
        return cls(**json.loads(text))

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


def build_rank_runner(spec: RankSpec, rank: int, region: SharedRegion) -> ModelRunner:
    """Rank `rank`'s runner: the model loaded, cut to its shard, an all-reduce after o and down,
    its KV pool in `region`."""
    model_dir = Path(spec.model_dir)
    config = model_store.load_config(model_dir)
    model = model_store.load_model(model_dir, spec.device, spec.torch_dtype, spec.weights, config)
    shard_model(model, spec.tp, rank)
    return ModelRunner(
        model,
        spec.model_name,
        spec.device,
        spec.num_blocks,
        spec.block_size,
        spec.chunk,
        spec.batch_invariant,
        use_kernels=spec.use_kernels,
        row_timing=Path(spec.row_timing) if spec.row_timing else None,
        release_weights=True,
        dtype=spec.torch_dtype,
        cuda_graphs=False,
        reduce=dist.all_reduce,
        pool_region=region,
    )


def join_group(spec: RankSpec, rank: int) -> None:
    """This process joins the group's gloo collectives (waits for every rank to)."""
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{spec.port}",
        rank=rank,
        world_size=spec.tp,
        timeout=datetime.timedelta(seconds=spec.collective_timeout_s),
    )


def loaded_barrier(spec: RankSpec) -> None:
    """Every rank has its shard loaded (model loading may take longer than one collective may)."""
    dist.monitored_barrier(
        timeout=datetime.timedelta(seconds=spec.start_timeout_s), wait_all_ranks=True
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--pool-fd", type=int, required=True)
    parser.add_argument("--commands-fd", type=int, required=True)
    parser.add_argument("--spec", required=True)
    args = parser.parse_args(argv)
    die_with_parent()
    spec = RankSpec.decode(args.spec)
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s tp-rank-{args.rank} %(levelname)s %(name)s: %(message)s",
    )
    cores = spec.cores[args.rank]
    if cores:
        pin(format_cpus(cores))
    torch.set_num_threads(spec.threads[args.rank])
    commands = CommandReader(socket.socket(fileno=args.commands_fd))
    region = SharedRegion.attach(args.pool_fd, os.fstat(args.pool_fd).st_size)
    try:
        join_group(spec, args.rank)
        runner = build_rank_runner(spec, args.rank, region)
        loaded_barrier(spec)
        log.info("rank %d of %d ready (%d threads)", args.rank, spec.tp, torch.get_num_threads())
        passes = follow(runner, commands)
    except GroupGone as gone:
        log.error("%s: leaving", gone)
        return 3
    except RuntimeError as err:  # a collective failed or timed out
        log.error("the group failed: %s", err)
        return 3
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    log.info("rank %d stopped after %d passes", args.rank, passes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
