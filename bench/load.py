"""Loading a checkpoint as a worker does: time and peak memory, single-file and sharded.

    python bench/load.py DIR [DIR ...]        (make bench-models runs it on the 0.5B checkpoints)

Each directory is loaded in a fresh process, the way a worker starts: its config checked, the
dtype resolved (--dtype, default auto: the checkpoint's own), the safetensors memory-mapped by
Hugging Face, then the engine's projections packed one at a time, each original freed (and its
mapped pages given back) as soon as its packed copy exists. Reported: the time to load and to
pack, the weights' size in the dtype computed in, and the process's peak resident memory above
what it held before loading (the Python, torch and transformers imports), as a multiple of the
weights' size. Writes bench/results/load.{json,md}.
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results"


def rss_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(path: Path, dtype: str) -> dict:
    """One load, in this process (run by `main` in a fresh one per directory)."""
    sys.path.insert(0, str(ROOT))
    import torch

    from shared import model_store
    from shared.engine.architecture import check
    from shared.engine.dtypes import compute_dtype
    from shared.engine.file_pages import allocations_given_back
    from shared.engine.model_runner import ModelRunner
    from shared.worker.runtime import load_model

    torch.set_num_threads(os.cpu_count() or 1)
    before = rss_mb()
    started = time.perf_counter()
    config = model_store.load_config(path)
    check(config)
    with allocations_given_back():  # as a worker loads (shared/worker/runtime.py)
        computed = compute_dtype(dtype, config, "cpu")
        model = load_model(path, "cpu", computed, "native", config)
        loaded = time.perf_counter()
        itemsize = torch.empty((), dtype=computed).element_size()
        size = sum(p.numel() for p in model.parameters()) * itemsize / 2**20  # as computed
        runner = ModelRunner(
            model, path.name, "cpu", 16, 16, 128, release_weights=True, dtype=computed
        )
        packed = time.perf_counter()
    assert runner.projections  # held until measured: the packed weights are what a worker keeps
    files = sorted(path.glob("*.safetensors"))
    return {
        "checkpoint": path.name,
        "files": len(files),
        "file_mb": sum(f.stat().st_size for f in files) / 2**20,
        "dtype": str(runner.dtype).removeprefix("torch."),
        "weights_mb": size,
        "load_s": loaded - started,
        "pack_s": packed - loaded,
        "baseline_mb": before,
        "peak_above_baseline_mb": peak_mb() - before,
        "peak_ratio": (peak_mb() - before) / size,
        "resident_after_mb": rss_mb() - before,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dirs", nargs="*", type=Path)
    parser.add_argument("--dtype", action="append", help="auto (default), float32, bfloat16")
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # DIR DTYPE: the child
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(Path(args.one[0]), args.one[1])))
        return 0
    rows = []
    for path in args.dirs:
        for dtype in args.dtype or ["auto"]:
            done = subprocess.run(
                [sys.executable, __file__, "--one", str(path), dtype],
                capture_output=True,
                text=True,
                check=True,
            )
            rows.append({"asked": dtype, **json.loads(done.stdout.strip().splitlines()[-1])})
            print(table_row(rows[-1]), flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "load.json").write_text(json.dumps(rows, indent=2))
    (OUT / "load.md").write_text("\n".join([HEADER, RULE, *map(table_row, rows)]) + "\n")
    return 0


HEADER = (
    "| checkpoint | files | on disk MB | --dtype | computed in | weights MB | load s | pack s "
    "| peak RSS above baseline MB | peak / weights | resident after MB |"
)
RULE = "| " + " | ".join(["---"] * 11) + " |"


def table_row(r: dict) -> str:
    return (
        f"| {r['checkpoint']} | {r['files']} | {r['file_mb']:.0f} | {r['asked']} | {r['dtype']} "
        f"| {r['weights_mb']:.0f} | {r['load_s']:.1f} | {r['pack_s']:.1f} "
        f"| {r['peak_above_baseline_mb']:.0f} | {r['peak_ratio']:.2f}x | {r['resident_after_mb']:.0f} |"
    )


if __name__ == "__main__":
    sys.exit(main())
