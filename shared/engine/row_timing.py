"""The fastest padded row count, timed once per machine and kept on disk.

`fastest_row_count` (projection.py) times a pass over every projection at each candidate row
count: about a second of each worker's start-up on a 2-core machine, spent again by every
replacement and every scale-out. What decides its answer is the CPU, torch (and the oneDNN it
bundles), the thread count and the projections' shapes, dtypes and kernels; with all of these
the same, the answer is read from a small JSON file instead. Any invariant count gives the same
bits (see `fastest_row_count`), so an entry that is out of date can cost speed, never a result.
"""

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

import torch

from shared.engine.kernels import cpu_flags
from shared.engine.projection import Projection, fastest_row_count

log = logging.getLogger(__name__)
MAX_ENTRIES = 64  # one per (machine, torch, threads, model shape): a handful in practice


def timing_key(projections: list[Projection], candidates: list[int]) -> str:
    """What decides the fastest count, hashed."""
    digest = hashlib.sha256()
    shapes = [(p.in_features, tuple(p.sizes), str(p.dtype), p.path) for p in projections]
    for part in (cpu_flags(), torch.__version__, torch.get_num_threads(), candidates, shapes):
        digest.update(repr(part).encode())
    return digest.hexdigest()[:32]


def cached_fastest_row_count(
    projections: list[Projection], candidates: list[int], path: Path | None
) -> int:
    """`fastest_row_count`, answered from `path` when it was timed before with the same key
    (and timed and recorded there when not); None: timed, nothing kept."""
    if path is None or len(candidates) <= 1:
        return fastest_row_count(projections, candidates)
    key = timing_key(projections, candidates)
    table = _read(path)
    kept = table.get(key)
    if type(kept) is int and kept in candidates:  # not a bool, a string or a stale count
        return kept
    rows = fastest_row_count(projections, candidates)
    table.pop(key, None)
    table[key] = rows
    _write(path, dict(list(table.items())[-MAX_ENTRIES:]))
    return rows


def _read(path: Path) -> dict:
    try:
        table = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as err:
        log.warning("row timing cache %s unreadable (%s): timing again", path, err)
        return {}
    return table if isinstance(table, dict) else {}


def _write(path: Path, table: dict) -> None:
    """Atomically (a worker starting at the same moment reads the old file or the new one)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            json.dump(table, f)
        os.replace(f.name, path)
    except OSError as err:  # a read-only cache costs the timing at the next start, nothing more
        log.warning("could not keep the row timing in %s: %s", path, err)
