"""Placement: the cores each worker of an embedded stack runs on.

Disaggregation only keeps long prompts from stalling token streams if the two pools do not share
hardware. On a CPU host `tandem up` gives the prefill and decode pools disjoint sets of the cores
it may use, in proportion to their sizes (or the sets given with --prefill-cpus/--decode-cpus),
and each worker a slice of its pool's set, with as many torch threads as cores. The cores are
taken NUMA node by node, so a slice stays within one node where it fits. A pool that grows past
its cores shares them among its workers; it never takes the other pool's.

On a GPU host the GPUs are split between the pools the same way (--prefill-devices and
--decode-devices choose them), and each worker gets its slice's first GPU as its device (a
group per worker once a worker spans several). NATS, the scheduler and the gateway are left on
every core: they are light, and pinning them to either pool's cores would put them in its way.
"""

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

NODES = Path("/sys/devices/system/node")
NVIDIA = Path("/proc/driver/nvidia/gpus")
_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def parse_cpus(text: str) -> list[int]:
    """ "0-3,6" -> [0, 1, 2, 3, 6]; ValueError for anything else."""
    cpus: set[int] = set()
    for part in text.replace(" ", "").split(","):
        match = _RANGE.match(part)
        if not match:
            raise ValueError(f"not a CPU list: {text!r} (e.g. 0-3,6)")
        first, last = int(match[1]), int(match[2] or match[1])
        if last < first:
            raise ValueError(f"not a CPU list: {text!r} ({part} runs backwards)")
        cpus.update(range(first, last + 1))
    return sorted(cpus)


def format_cpus(cpus: list[int]) -> str:
    """[0, 1, 2, 3, 6] -> "0-3,6"."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][-1] + 1:
            runs[-1].append(cpu)
        else:
            runs.append([cpu])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def numa_order(available: list[int], nodes: Path = NODES) -> list[int]:
    """`available` ordered node by node (each node's CPUs ascending), where sysfs lists nodes;
    CPUs it does not place come last."""
    placed: list[int] = []
    for node in sorted(nodes.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        try:
            cpus = parse_cpus((node / "cpulist").read_text().strip())
        except (OSError, ValueError):
            continue
        placed += [c for c in cpus if c in available and c not in placed]
    return placed + [c for c in sorted(available) if c not in placed]


def pin(cpus: str) -> int:
    """Runs this process on `cpus` (a CPU list) from now on, threads it starts after included;
    the number of cores. Call it first thing, before any thread pool starts."""
    cores = parse_cpus(cpus)
    os.sched_setaffinity(0, cores)
    log.info("running on cores %s", format_cpus(cores))
    return len(cores)


def gpus_available(env=os.environ, driver: Path = NVIDIA) -> list[int]:
    """The CUDA device indices a worker started here can use: CUDA_VISIBLE_DEVICES' count where
    it is set, else one per GPU the NVIDIA driver lists; none without either."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return list(range(len([d for d in visible.split(",") if d.strip()])))
    try:
        return list(range(sum(1 for _ in driver.iterdir())))
    except OSError:
        return []


@dataclass
class Placement:
    pools: dict[str, list[int]]  # pool -> its cores (disjoint where there are enough)

    def share_of(self, pool: str, slot: int, count: int) -> list[int]:
        """The cores (GPUs) of the `slot`-th of `count` workers in `pool`: an equal slice of the
        pool's, or, with more workers than cores, one core shared in turn."""
        cores = self.pools[pool]
        if count >= len(cores):
            return [cores[slot % len(cores)]]
        size = len(cores) // count
        extra = len(cores) % count  # the first `extra` workers get one core more
        start = slot * size + min(slot, extra)
        return cores[start : start + size + (1 if slot < extra else 0)]

    def describe(self, unit: str = "cores") -> str:
        return ", ".join(f"{pool} on {unit} {format_cpus(c)}" for pool, c in self.pools.items())


def place(
    available: list[int],
    counts: dict[str, int],
    given: dict[str, str],
    nodes: Path | None = NODES,
    unit: str = "cpus",
) -> Placement:
    """Each pool's cores (`unit` "devices": GPUs): those `given` (a list per pool), else a share
    of `available` in proportion to `counts` (at least one each), the rest to the pools not
    given. `nodes`: where NUMA nodes are listed (None: keep `available`'s order)."""
    ordered = numa_order(available, nodes) if nodes is not None else sorted(available)
    pools = {pool: parse_cpus(text) for pool, text in given.items() if text and pool in counts}
    for pool, cores in pools.items():
        if not set(cores) <= set(available):
            raise ValueError(
                f"--{pool}-{unit} {format_cpus(cores)}: not all of them are available here "
                f"({format_cpus(available) or 'none'})"
            )
    free = [c for c in ordered if not any(c in cores for cores in pools.values())]
    rest = [pool for pool in counts if pool not in pools]
    if rest and not free:
        raise ValueError(f"no {unit} left for the {' and '.join(rest)} pool")
    for pool, cores in zip(rest, _shares(free, [counts[p] for p in rest])):
        pools[pool] = cores
    return Placement({pool: pools[pool] for pool in counts})


def _shares(cores: list[int], weights: list[int]) -> list[list[int]]:
    """`cores` cut into consecutive shares in proportion to `weights`, at least one core each
    (all of them shared when there are fewer cores than shares)."""
    if len(cores) < len(weights):
        return [cores] * len(weights)
    total, shares, start = sum(weights), [], 0
    for index, weight in enumerate(weights):
        left = len(weights) - index - 1
        size = round(len(cores) * weight / total) if left else len(cores) - start
        size = max(1, min(size, len(cores) - start - left))
        shares.append(cores[start : start + size])
        start += size
    return shares
