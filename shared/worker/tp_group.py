"""A tensor-parallel worker's ranks: rank 0 is the worker's own process (its NATS identity, its
heartbeat, its one block table); ranks 1..tp-1 are processes it starts (`python -m
shared.worker.tp_rank`) and supervises.

Start-up (`start_group`): rank 0 checks the degree against the model's heads (TPError naming the
degrees that would work, before anything loads), makes every rank's KV pool as a shared region
(each rank's own memory, holding its heads only; rank 0 maps them all, so its data plane moves
each rank's KV straight from and into that rank's pool), starts the other ranks with their
region, a command link (a socket pair) and their share of the worker's cores, then all join one
gloo group (every collective with `tp_collective_timeout_s`). Each rank loads the model, keeps
its shard and builds its runner over its region; a barrier (`tp_start_timeout_s`) ends start-up.

Failure: a rank that exits is seen at once (a thread waits on each), a collective that fails or
times out raises GroupFailed; either way the group is finished: `failed` is set, the other ranks
are killed, and the worker exits so its supervisor (tandem up, compose, Kubernetes) starts a new
one, while its requests move to other workers. A rank whose rank 0 went away stops at the end of
its command link, or by the kernel's parent-death signal.
"""

import dataclasses
import logging
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import torch
import torch.distributed as dist

from shared import model_store
from shared.engine.architecture import UnsupportedModel
from shared.engine.file_pages import allocations_given_back
from shared.engine.kv_cache import KVPool, bytes_per_token, layout_of
from shared.engine.model_runner import ModelRunner
from shared.engine.shared_region import SharedRegion
from shared.parallel.commands import CommandWriter
from shared.parallel.group import GroupFailed, GroupRunner
from shared.parallel.heads import HeadSplit, TPError
from shared.values.kv_layout import KVLayout
from shared.worker.placement import parse_cpus
from shared.worker.settings import WorkerSettings
from shared.worker.tp_rank import RankSpec, build_rank_runner, join_group, loaded_barrier

log = logging.getLogger(__name__)


def rank_cores(cores: list[int], tp: int) -> list[list[int]]:
    """The worker's cores cut into one equal share per rank (the first ranks one more where they
    do not divide); with fewer cores than ranks, each rank one core, shared in turn."""
    if not cores:
        return [[] for _ in range(tp)]
    if len(cores) < tp:
        return [[cores[r % len(cores)]] for r in range(tp)]
    size, extra = divmod(len(cores), tp)
    out, at = [], 0
    for r in range(tp):
        take = size + (1 if r < extra else 0)
        out.append(cores[at : at + take])
        at += take
    return out


def split_of(config, tp: int) -> HeadSplit:
    """The model's heads split `tp` ways; TPError naming the degrees that work, also when the
    MLP's width does not divide."""
    split = HeadSplit(config.num_attention_heads, config.num_key_value_heads, tp)
    if config.intermediate_size % tp:
        raise TPError(
            f"a tensor-parallel degree of {tp} does not split the MLP's "
            f"{config.intermediate_size} columns"
        )
    return split


def rank_layout(layout: KVLayout, split: HeadSplit) -> KVLayout:
    """A rank's pool: the group's layout with the rank's KV heads only."""
    return dataclasses.replace(layout, num_kv_heads=split.kv_per_rank)


def pool_bytes(layout: KVLayout, num_blocks: int) -> int:
    return num_blocks * layout.block_size * bytes_per_token(layout)


class TPGroup:
    """Rank 0's view of its group: the other ranks' processes and every rank's pool."""

    def __init__(self, spec: RankSpec, split: HeadSplit, layout: KVLayout):
        self.spec, self.split = spec, split
        self.layout = layout  # the group's (every KV head): what peers pair with
        per_rank = rank_layout(layout, split)
        nbytes = pool_bytes(per_rank, spec.num_blocks)
        self.regions = [SharedRegion(nbytes) for _ in range(spec.tp)]
        self.pools = [
            KVPool(per_rank, spec.num_blocks, spec.block_size, "cpu", region=region)
            for region in self.regions
        ]
        self.processes: list[subprocess.Popen] = []
        self.failed = threading.Event()
        self.failure = ""
        self._on_failure = lambda: None
        self._stopping = False
        self._commands: CommandWriter | None = None
        self.runner: GroupRunner | None = None

    def start(self) -> None:
        """Starts ranks 1..tp-1 and joins the group with them (a follower that cannot join, or
        exits, fails the start)."""
        sockets = []
        for rank in range(1, self.spec.tp):
            ours, theirs = socket.socketpair()
            region = self.regions[rank]
            argv = [sys.executable, "-m", "shared.worker.tp_rank", "--rank", str(rank)]
            argv += ["--pool-fd", str(region.fd), "--commands-fd", str(theirs.fileno())]
            argv += ["--spec", self.spec.encode()]
            try:
                self.processes.append(
                    subprocess.Popen(
                        argv, pass_fds=[region.fd, theirs.fileno()], stdin=subprocess.DEVNULL
                    )
                )
            finally:
                theirs.close()
            sockets.append(ours)
        self._commands = CommandWriter(sockets)
        for rank, process in enumerate(self.processes, start=1):
            threading.Thread(
                target=self._watch, args=(rank, process), name=f"tp-rank-{rank}", daemon=True
            ).start()
        join_group(self.spec, 0)

    def serve(self, runner: ModelRunner) -> GroupRunner:
        """Rank 0's runner once its shard is loaded: waits for the others' (the start barrier)."""
        try:
            loaded_barrier(self.spec)
        except RuntimeError as err:
            self.fail(f"a rank did not load its shard: {err}")
            raise GroupFailed(self.failure) from None
        self.runner = GroupRunner(runner, self._commands, self.fail)
        return self.runner

    def on_failure(self, callback) -> None:
        """`callback()` (from any thread) once the group fails."""
        self._on_failure = callback
        if self.failed.is_set():
            callback()

    def _watch(self, rank: int, process: subprocess.Popen) -> None:
        code = process.wait()
        if not self._stopping:
            self.fail(f"rank {rank} (pid {process.pid}) exited with code {code}")

    def fail(self, why: str) -> None:
        """The group is finished: the other ranks are killed (nothing waits on them)."""
        if self.failed.is_set():
            return
        self.failure = why
        self.failed.set()
        log.error("tensor-parallel group failed: %s", why)
        self.kill()
        self._on_failure()

    def kill(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()

    def stop(self, timeout_s: float) -> None:
        """The other ranks leave (told to, else killed) and the group's collectives end."""
        self._stopping = True
        if self.runner is not None and not self.failed.is_set():
            try:
                self.runner.stop()
            except GroupFailed:
                pass
        for process in self.processes:
            try:
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self._commands is not None:
            self._commands.close()
        if dist.is_initialized():
            dist.destroy_process_group()

    def describe(self) -> list[str]:
        """Each rank's share, as `tandem status` shows it: "rank 0: q 0-6, kv 0 (pid 123)"."""
        out = []
        pids = [os.getpid()] + [p.pid for p in self.processes]
        for rank in range(self.spec.tp):
            q, kv = self.split.q_heads(rank), self.split.kv_heads(rank)
            out.append(
                f"rank {rank}: q {q[0]}-{q[1] - 1}, kv {kv[0]}-{kv[1] - 1} (pid {pids[rank]})"
            )
        return out


def start_group(
    settings: WorkerSettings,
    model_dir: Path,
    config,
    device: str,
    dtype: torch.dtype,
    row_timing: Path,
) -> tuple[TPGroup, ModelRunner]:
    """A tensor-parallel worker's group and rank 0's runner; TPError before anything loads when
    the degree does not split the model."""
    split = split_of(config, settings.tp)
    if device != "cpu":
        raise UnsupportedModel(
            f"tensor parallelism (--tp {settings.tp}) runs on CPU ranks here; "
            f"on {device} it is not built"
        )
    name = model_store.model_name(settings.model)
    layout = layout_of(config, name, dtype, settings.block_size)
    spec = rank_spec(settings, model_dir, name, rank_layout(layout, split), row_timing)
    torch.set_num_threads(spec.threads[0])
    group = TPGroup(spec, split, layout)
    group.start()
    try:
        with allocations_given_back():
            runner = build_rank_runner(spec, 0, group.regions[0])
        group.serve(runner)
    except BaseException:
        group.kill()
        raise
    log.info("tensor-parallel group of %d ranks: %s", spec.tp, "; ".join(group.describe()))
    return group, runner


def rank_spec(
    settings: WorkerSettings, model_dir: Path, name: str, per_rank: KVLayout, row_timing: Path
) -> RankSpec:
    """What every rank of this worker's group builds: each rank's pool of --kv-cache-mb, its
    share of --cpus (threads: one per core; unplaced, the worker's --torch-threads, else the
    machine's cores, shared out among its ranks)."""
    tp = settings.tp
    cores = rank_cores(parse_cpus(settings.cpus) if settings.cpus else [], tp)
    threads = max(1, (settings.torch_threads or os.cpu_count() or 1) // tp)
    block_bytes = bytes_per_token(per_rank) * settings.block_size
    return RankSpec(
        model_dir=str(model_dir),
        model_name=name,
        device="cpu",
        dtype=per_rank.dtype,
        weights=settings.weights,
        block_size=settings.block_size,
        num_blocks=max(1, settings.kv_cache_mb * 2**20 // block_bytes),
        chunk=settings.prefill_chunk_tokens,
        batch_invariant=settings.batch_invariant,
        use_kernels=settings.kernels == "auto",
        row_timing=str(row_timing),
        tp=tp,
        port=free_port(),
        collective_timeout_s=settings.tp_collective_timeout_s,
        start_timeout_s=settings.tp_start_timeout_s,
        cores=cores,
        threads=[len(c) if c else threads for c in cores],
    )


def free_port() -> int:
    """A port free on 127.0.0.1 now (the group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
