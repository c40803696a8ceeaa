"""WorkerPools: the prefill and decode (or colocated) workers of an embedded stack, grown and shrunk live.

Nothing lists workers statically: the scheduler learns of a new worker from its heartbeats and
forgets a leaving one when it announces `stopping`, so growing is spawning and shrinking is SIGTERM
(the worker drains, then exits).
"""

import os
import sys
import time
from dataclasses import dataclass, field

from shared.cli.processes import ProcessGroup, child_env
from shared.control.worker_roles import Mode, Role
from shared.worker.placement import Placement, format_cpus, gpus_available, place
from shared.worker.settings import WorkerSettings

POOLS = ("prefill", "decode")
MAX_WORKERS = 64  # per pool: a typo must not fork hundreds of model-loading processes
EXIT_MARGIN_S = 15.0  # beyond the drain timeout: closing the bus and the KV plane
MAX_RESTARTS = 5  # crashed workers replaced per pool within RESTART_WINDOW_S; more is a crash loop
RESTART_WINDOW_S = 300.0


class ScaleError(ValueError):
    """A scale request this stack cannot carry out; the message is for the user."""


class Restarts:
    """The crash-loop guard: a key (a pool, a service) may be restarted MAX_RESTARTS times within
    RESTART_WINDOW_S; one more crash in the window means something is wrong that a restart will not fix."""

    def __init__(self) -> None:
        self._times: dict[str, list[float]] = {}

    def allow(self, key: str) -> bool:
        now = time.monotonic()
        recent = [t for t in self._times.get(key, []) if now - t < RESTART_WINDOW_S]
        self._times[key] = recent + ([now] if len(recent) < MAX_RESTARTS else [])
        return len(recent) < MAX_RESTARTS


def pool_of(role: str, mode: Mode) -> str:
    """The pool a role names: `decode` is the decode pool, or the colocated one in colocated mode."""
    if role == Role.DECODE or (role == Role.COLOCATED and mode == Mode.COLOCATED):
        return "decode"
    if role == Role.PREFILL and mode != Mode.COLOCATED:
        return "prefill"
    if role in (Role.PREFILL, Role.COLOCATED):
        raise ScaleError(f"a {mode} stack has no {role} workers")
    raise ScaleError(f"unknown role {role!r}: use prefill, decode or colocated")


def validate_targets(targets, mode: Mode) -> dict[str, int]:
    """{"prefill": 2, "decode": 3} -> workers wanted per pool; ScaleError when the request is wrong."""
    if not isinstance(targets, dict) or not targets:
        raise ScaleError("nothing to scale: give prefill=N and/or decode=M")
    counts: dict[str, int] = {}
    for role, count in targets.items():
        pool = pool_of(str(role), mode)
        if pool in counts:
            raise ScaleError(f"the {pool} pool is given twice")
        if not isinstance(count, int) or isinstance(count, bool):
            raise ScaleError(f"{role}: the count must be a whole number, got {count!r}")
        if count < 1:
            raise ScaleError(f"{role}={count}: at least 1 {role} worker must remain")
        if count > MAX_WORKERS:
            raise ScaleError(f"{role}={count}: at most {MAX_WORKERS} workers per pool")
        counts[pool] = count
    return counts


def drain_grace_s(env=os.environ) -> float:
    """How long a retired worker may take to exit: its drain timeout, as the worker reads it, plus a margin."""
    try:
        drain = float(env.get("TANDEM_DRAIN_TIMEOUT_S", WorkerSettings.drain_timeout_s))
    except ValueError:
        drain = WorkerSettings.drain_timeout_s  # the worker itself refuses that value and exits
    return drain + EXIT_MARGIN_S


@dataclass
class WorkerSpec:
    """How to start one worker of a pool; the same for the first worker and the fiftieth."""

    argv: list[str]
    env: dict[str, str]


@dataclass
class WorkerPools:
    group: ProcessGroup
    mode: Mode
    specs: dict[str, WorkerSpec]  # pool -> how to start one of its workers
    address: str  # the gateway, for clients that wait for ClusterStatus
    grace_s: float = field(default_factory=drain_grace_s)
    # pool -> (name, pid), oldest first
    workers: dict[str, list[tuple[str, int]]] = field(default_factory=dict)
    # pool -> workers ever started: names never repeat
    spawned: dict[str, int] = field(default_factory=dict)
    restarts: Restarts = field(default_factory=Restarts)  # crashed workers replaced, per pool
    placement: Placement | None = None  # the cores of each pool; None: every worker on every core
    devices: Placement | None = None  # the GPUs of each pool; None: no GPUs (or the device set)

    def resize(self, pool: str, count: int) -> tuple[list[dict], list[dict]]:
        """Starts or retires (newest first) workers until `pool` has `count`; returns (started, stopping)."""
        members = self.workers.setdefault(pool, [])
        started, stopping = [], []
        while len(members) < count:
            started.append(self._spawn(pool, len(members), count))
        while len(members) > count:
            name, pid = members.pop()
            self.group.retire(name, self.grace_s)
            stopping.append({"name": name, "pid": pid})
        return started, stopping

    def replace_crashed(self, dead: dict[str, int] | None = None) -> list[tuple[str, int, str]]:
        """Starts a new worker for each one that exited on its own (a crash, a kill): its requests
        have moved to the others already, and the pool gets back to its size. `dead`: the group's
        exited children, name -> exit code (read now when not given). (dead name, exit code, new
        name) for each; ScaleError when a pool crash-loops (MAX_RESTARTS in the window)."""
        dead = dict(self.group.dead()) if dead is None else dead
        replaced = []
        for pool, members in self.workers.items():
            for name, pid in list(members):
                code = dead.get(name)
                if code is None:
                    continue
                if not self.restarts.allow(pool):
                    raise ScaleError(
                        f"{name} exited with code {code}, the {MAX_RESTARTS + 1}th {pool} worker "
                        f"to exit within {RESTART_WINDOW_S:.0f}s: not restarting it"
                    )
                slot, count = members.index((name, pid)), len(members)
                members.remove((name, pid))
                self.group.forget(name)
                replaced.append((name, code, self._spawn(pool, slot, count)["name"]))
        return replaced

    def _spawn(self, pool: str, slot: int, count: int) -> dict:
        """Starts the `slot`-th of `count` workers of `pool` (on that slot's cores)."""
        index = self.spawned.get(pool, 0)
        self.spawned[pool] = index + 1
        name = f"{pool}-{index}"
        spec = self.specs[pool]
        env = spec.env
        if self.placement is not None:
            env = {**env, "TANDEM_CPUS": format_cpus(self.placement.share_of(pool, slot, count))}
        if self.devices is not None:
            env = {**env, "TANDEM_DEVICE": f"cuda:{self.devices.share_of(pool, slot, count)[0]}"}
        pid = self.group.spawn(name, spec.argv, env).pid
        self.workers[pool].append((name, pid))
        return {"name": name, "pid": pid}

    # -- the control socket's handler -----------------------------------------------------------

    def scale(self, targets) -> dict:
        counts = validate_targets(targets, self.mode)
        started, stopping = [], []
        for pool, count in counts.items():
            more, fewer = self.resize(pool, count)
            started += more
            stopping += fewer
        if started or stopping:
            print(
                f"scaled to {self._counts_text()}: started {_names(started)}; stopping {_names(stopping)}",
                file=sys.stdout,
                flush=True,
            )
        return {"started": started, "stopping": stopping, **self.status()}

    def status(self) -> dict:
        retiring = [
            {"name": name, "pid": proc.pid}
            for name, (proc, _) in self.group.retired.items()
            if proc.poll() is None
        ]
        return {
            "mode": self.mode,
            "address": self.address,
            "counts": {self.label(pool): len(members) for pool, members in self.workers.items()},
            "workers": {
                self.label(pool): [{"name": n, "pid": p} for n, p in members]
                for pool, members in self.workers.items()
            },
            "retiring": retiring,
        }

    def label(self, pool: str) -> str:
        """What users call the pool: the decode pool of a colocated stack holds colocated workers."""
        return Role.COLOCATED if pool == "decode" and self.mode == Mode.COLOCATED else pool

    def _counts_text(self) -> str:
        return ", ".join(
            f"{len(members)} {self.label(pool)}" for pool, members in self.workers.items()
        )


def _counts(args) -> dict[str, int]:
    counts = {"decode": args.decode}
    return counts if args.mode == Mode.COLOCATED else {"prefill": args.prefill, **counts}


def tp_degrees(args) -> dict[str, int]:
    """Each pool's tensor-parallel degree (ranks per worker)."""
    degrees = {"prefill": args.prefill_tp, "decode": args.decode_tp}
    return {pool: degrees[pool] for pool in _counts(args)}


def _ranks(args) -> dict[str, int]:
    """Each pool's processes: workers times their ranks (the weight of its share of cores)."""
    degrees = tp_degrees(args)
    return {pool: count * degrees[pool] for pool, count in _counts(args).items()}


def placement_of(args) -> Placement | None:
    """The cores of each pool (None with --no-pin), shared in proportion to their ranks;
    ValueError for a wrong --*-cpus."""
    if args.no_pin:
        return None
    given = {"prefill": args.prefill_cpus, "decode": args.decode_cpus}
    return place(sorted(os.sched_getaffinity(0)), _ranks(args), given)


def sharing_notes(args) -> list[str]:
    """Where a pool has fewer cores than ranks: its ranks share cores (and run slower for it)."""
    placement, notes = placement_of(args), []
    if placement is None:
        return notes
    degrees = tp_degrees(args)
    for pool, ranks in _ranks(args).items():
        cores = placement.pools[pool]
        if degrees[pool] > 1 and len(cores) < ranks:
            notes.append(
                f"the {pool} pool has {len(cores)} core(s) ({format_cpus(cores)}) for {ranks} "
                f"tensor-parallel ranks ({_counts(args)[pool]} worker(s) x tp {degrees[pool]}): "
                "its ranks share cores"
            )
    return notes


def devices_of(args, gpus: list[int] | None = None) -> Placement | None:
    """The GPUs of each pool, a device per worker (None on a host without GPUs, or where
    TANDEM_DEVICE chooses one for every worker); ValueError for a wrong --*-devices."""
    gpus = gpus_available() if gpus is None else gpus
    given = {"prefill": args.prefill_devices, "decode": args.decode_devices}
    if "TANDEM_DEVICE" in os.environ or not (gpus or any(given.values())):
        return None
    return place(gpus, _counts(args), given, nodes=None, unit="devices")


def worker_specs(args, common: dict[str, str], role_env: dict[str, dict]) -> dict[str, WorkerSpec]:
    """Workers started later by `tandem scale` get the same settings as the first ones."""
    per_rank = max(1, (os.cpu_count() or 1) // sum(_ranks(args).values()))
    worker_env = dict(common)
    colocated = {"TANDEM_COLOCATED": "1" if args.mode == Mode.COLOCATED else "0"}
    tp = {pool: {"TANDEM_TP": str(degree)} for pool, degree in tp_degrees(args).items()}
    if args.no_pin and "TANDEM_TORCH_THREADS" not in os.environ:  # workers share every core
        for pool, degree in tp_degrees(args).items():  # a worker's threads: its ranks'
            tp[pool]["TANDEM_TORCH_THREADS"] = str(per_rank * degree)
    python = [sys.executable, "-m"]
    return {
        "prefill": WorkerSpec(
            python + ["services.prefill"],
            child_env({**worker_env, **tp.get("prefill", {}), **role_env["prefill"]}),
        ),
        "decode": WorkerSpec(
            python + ["services.decode"],
            child_env({**worker_env, **colocated, **tp["decode"], **role_env["decode"]}),
        ),
    }


def _names(workers: list[dict]) -> str:
    return ", ".join(w["name"] for w in workers) or "none"
